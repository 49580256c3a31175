"""Store construction and credential hygiene (``xinsitu.stores.opening``): URLs and paths become obstore
stores, options are passed through or refused by name, and no message quotes a secret."""

from __future__ import annotations

import warnings

import obstore.store
import pytest

import xinsitu
from xinsitu.stores.opening import make_store
from xinsitu.stores.redact import redact, redact_url, scrubbed, secrets_in_options, secrets_of


def test_a_local_path_becomes_a_local_store(tmp_path):
    store = make_store(tmp_path)
    assert isinstance(store, obstore.store.LocalStore)
    assert str(store.prefix) == str(tmp_path)


def test_a_missing_directory_and_options_on_a_path_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no zarr store at"):
        make_store(tmp_path / "nope")
    with pytest.raises(TypeError, match="apply to URLs, not to a local path"):
        make_store(tmp_path, client_options={"timeout": "1s"})


def test_unknown_scheme_is_refused_without_the_query(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported URL scheme 'ftp'") as err:
        make_store("ftp://host/data?sig=SECRET123")
    assert "SECRET123" not in str(err.value)


def test_anonymous_applies_to_object_storage_only():
    with pytest.raises(TypeError, match="anonymous= applies to object storage URLs"):
        make_store("memory:///", anonymous=True)
    store = make_store("s3://bucket/path", anonymous=True, region="us-east-1")
    assert str(store.config.get("skip_signature")).lower() == "true"


def test_http_urls_get_the_default_client_and_retry_options():
    store = make_store("http://127.0.0.1:9/data.zarr")
    assert str(store.client_options.get("allow_http")).lower() == "true"
    assert "timeout" in store.client_options  # DEFAULT_CLIENT_OPTIONS laid under the user's


@pytest.mark.parametrize(("url", "want"), [
    ("https://user:pw@host.example:8443/a/b.zarr?X-Amz-Signature=abc", "https://host.example:8443/a/b.zarr?…"),
    ("s3://bucket/key", "s3://bucket/key"),
    ("http://h/p", "http://h/p"),
])
def test_redact_url(url, want):
    assert redact_url(url) == want


def test_secrets_in_options_walks_nested_options_and_the_url():
    found = secrets_in_options("https://u:hunter22@h/p?sig=QUERYSECRET",
                               {"config": {"aws_secret_access_key": "AKSECRETVALUE", "region": "eu-west-1"},
                                "client_options": {"default_headers": {"authorization": "Bearer TOKEN12345678"}}})
    assert {"hunter22", "QUERYSECRET", "AKSECRETVALUE", "TOKEN12345678"} <= set(found)
    assert "eu-west-1" not in found  # not a credential key
    assert found == sorted(found, key=len, reverse=True)  # longest first: no partial replacement


def test_redact_and_scrubbed_remove_credentials_and_keep_the_kind():
    text = "GET https://user:pw@h/p?token=T0KEN failed with key AKSECRETVALUE"
    out = redact(text, ["AKSECRETVALUE"])
    assert "AKSECRETVALUE" not in out and "T0KEN" not in out and "pw@" not in out
    err = scrubbed(FileNotFoundError("no object https://h/p?sig=SIGNATURE1\n\nDebug source: SIGNATURE1"))
    assert isinstance(err, FileNotFoundError) and "SIGNATURE1" not in str(err) and "Debug source" not in str(err)

    class ObstoreThing(Exception):
        pass

    other = scrubbed(ObstoreThing("boom"))
    assert isinstance(other, OSError) and str(other) == "ObstoreThing: boom"


def test_redact_removes_encoded_credentials_and_the_key_id_of_a_credential_scope():
    url = ("https://h/p?X-Amz-Credential=AKIDSCOPE0001%2F20250101%2Fus-east-1%2Fs3%2Faws4_request"
           "&X-Amz-Security-Token=tok%2Fen%2Bpart%3D%3D")
    secrets = secrets_in_options(url, {})
    assert "AKIDSCOPE0001" in secrets and "us-east-1" not in secrets
    text = ("<AWSAccessKeyId>AKIDSCOPE0001</AWSAccessKeyId> X-Amz-Credential=AKIDSCOPE0001%2F20250101%2Fus-east-1"
            "%2Fs3%2Faws4_request&X-Amz-Security-Token=tok%2Fen%2Bpart%3D%3D form: tok%2Fen%2Bpart%3D%3D tok/en+part==")
    out = redact(text, secrets)
    assert "AKIDSCOPE0001" not in out and "tok" not in out and "part" not in out, out
    assert redact("a%20b%2Bc x+y+z", ["a b+c", "x y z"]) == "*** ***"  # percent- and form-encoded


def test_secrets_of_a_local_store_is_empty(tmp_path):
    assert secrets_of(obstore.store.LocalStore(prefix=str(tmp_path))) == []


@pytest.mark.parametrize("kw, name", [({"group": 123}, "group"), ({"group": b"g"}, "group"),
                                      ({"consolidated": "yes"}, "consolidated"), ({"consolidated": 1}, "consolidated"),
                                      ({"decode_times": "x"}, "decode_times"), ({"decode_times": 0}, "decode_times")])
def test_open_zarr_refuses_arguments_of_the_wrong_type(era5_path, kw, name):
    with pytest.raises(TypeError, match=f"^{name} must be"):
        xinsitu.open_zarr(era5_path, **kw)



@pytest.mark.parametrize("zarr_format", [2, 3])
def test_open_of_an_unconsolidated_archive_says_nothing(tmp_path, zarr_format):
    """A local archive without consolidated metadata opens without xarray's six-line "Failed to open
    Zarr store with consolidated metadata" RuntimeWarning (the first output of a notebook), and with
    its arrays in name order as before; ``consolidated=True`` on it still raises."""
    import warnings

    import numpy as np
    import xarray as xr

    path = tmp_path / "noc.zarr"
    xr.Dataset({"b": (("t",), np.arange(4.0)), "a": (("t",), np.arange(4.0) * 2)}).to_zarr(
        path, zarr_format=zarr_format, consolidated=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (conftest ignores that warning for the other tests)
        ds = xinsitu.open_zarr(str(path))
        assert list(ds.data_vars) == ["a", "b"] and float(ds.a[1]) == 2.0
        for consolidated in (None, False):
            xinsitu.open_zarr(str(path), consolidated=consolidated, decode_times=False)
    with pytest.raises((KeyError, ValueError)):  # as xarray says it
        xinsitu.open_zarr(str(path), consolidated=True)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_plain_file_beside_the_arrays_is_no_node(tmp_path, zarr_format):
    """A README (or ``.DS_Store``, or the v2 metadata zarr's ``migrate_v2_to_v3`` leaves) at the root of an
    archive without consolidated metadata: zarr asks ``README.md/zarr.json``, which obstore's local store
    answered with a "Not a directory" error where zarr's finds nothing; the open failed. It opens as with
    xarray."""
    import numpy as np
    import xarray as xr

    path = tmp_path / "a.zarr"
    xr.Dataset({"a": (("t",), np.arange(4.0))}).to_zarr(path, zarr_format=zarr_format, consolidated=False)
    (path / "README.md").write_text("hello\n")
    (path / ".DS_Store").write_bytes(b"\0\1")
    ds = xinsitu.open_zarr(str(path))
    assert list(ds.data_vars) == ["a"] and ds.a.values.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("kw", [{"mask_and_scale": False}, {"decode_cf": False}, {"drop_variables": ["b"]},
                                {"use_cftime": True}, {"decode_coords": "all"}, {"concat_characters": False}])
def test_open_zarr_takes_xarrays_decoding_options(tmp_path, kw):
    """``xinsitu.open_zarr(path, mask_and_scale=False)`` (and ``decode_cf``, ``drop_variables``), as
    ``xr.open_zarr`` takes them: the same Dataset, and batches of its (raw) values (it said "store
    options ['mask_and_scale'] apply to URLs, not to a local path")."""
    import numpy as np
    import pandas as pd
    import xarray as xr

    path = str(tmp_path / "p.zarr")
    xr.Dataset({"a": (("time", "x"), np.linspace(-5, 5, 24).reshape(8, 3)), "b": (("time",), np.arange(8.0))},
               coords={"time": pd.date_range("2000", periods=8)}).to_zarr(
        path, encoding={"a": {"dtype": "int16", "scale_factor": 0.01, "_FillValue": -999, "chunks": (2, 3)},
                        "b": {"chunks": (2,)}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (xarray's own, about use_cftime)
        ds, ref = xinsitu.open_zarr(path, **kw), xr.open_zarr(path, chunks=None, **kw)
    assert list(ds.data_vars) == list(ref.data_vars) and ds.a.dtype == ref.a.dtype and ds.time.dtype == ref.time.dtype
    assert type(ds.time.values[0]) is type(ref.time.values[0]) and set(ds.coords) == set(ref.coords)
    m = ds.insitu.split("time", fractions={"train": 0.5, "val": 0.5})
    b = next(iter(ds.insitu.batches(m, "train", batch_size=4, shuffle=False, output="numpy")))
    assert b["a"].dtype == ref.a.dtype
    np.testing.assert_array_equal(b["a"], ref.a.values[:4])


def test_open_zarr_refuses_chunks_naming_xr_open_zarr(tmp_path):
    import numpy as np
    import xarray as xr

    path = str(tmp_path / "c.zarr")
    xr.Dataset({"a": (("time",), np.arange(4.0))}).to_zarr(path)
    with pytest.raises(ValueError, match=r"chunks=\{'time': 2\}: xinsitu.open_zarr reads without dask.*xr.open_zarr"):
        xinsitu.open_zarr(path, chunks={"time": 2})
    with pytest.raises(TypeError, match="use_cftime must be"):
        xinsitu.open_zarr(path, use_cftime="yes")


def test_a_path_to_a_file_or_an_icechunk_repository_names_what_opens_it(tmp_path):
    """``open_zarr`` on a NetCDF, GRIB or JSON file, or on an Icechunk repository's directory: it said there was
    no zarr store there, as if the path did not exist. It names what the path holds and what opens it."""
    cases = {"a.nc": b"CDF\x01" + bytes(40), "b.nc": b"\x89HDF\r\n\x1a\n" + bytes(40), "c.grib": b"GRIB" + bytes(40),
             "refs.json": b'{"version": 1, "refs": {}}', "notes.txt": b"hello"}
    said = {"a.nc": "NetCDF-3 file.*open_netcdf", "b.nc": "NetCDF-4/HDF5 file.*open_netcdf",
            "c.grib": "GRIB file.*open_grib", "refs.json": "JSON file.*KerchunkJSONParser", "notes.txt": "is a file"}
    for name, head in cases.items():
        (tmp_path / name).write_bytes(head)
        with pytest.raises(ValueError, match=said[name]):
            xinsitu.open_zarr(str(tmp_path / name))
    for version, parts in ((1, ("refs", "snapshots")), (2, ("repo", "snapshots"))):
        repo = tmp_path / f"repo{version}"
        for d in parts:
            (repo / d).mkdir(parents=True)
        with pytest.raises(ValueError, match=r"Icechunk repository.*readonly_session"):
            xinsitu.open_zarr(str(repo))
    import xarray as xr  # a zarr store whose groups are named as an Icechunk repository's folders: opened

    path = str(tmp_path / "groups.zarr")
    for g in ("refs", "snapshots"):
        xr.Dataset({"a": ("x", [1.0, 2.0])}).to_zarr(path, group=g, mode="a")
    xr.Dataset({"b": ("x", [3.0, 4.0])}).to_zarr(path, mode="a")
    assert list(xinsitu.open_zarr(path).data_vars) == ["b"]
