"""Variable (channel) order is deterministic: ``xinsitu.open_zarr`` sorts the data variables of a store
read without consolidated metadata (whose listing order changes from process to process), and a state,
statistics or ``normalize=`` recorded with another channel order is refused, naming both orders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xarray as xr

import xinsitu

NAMES = ["zeta", "alpha", "mid", "beta", "omega", "c2", "c1", "kappa"]
PROCESSES = 6

CHILD = textwrap.dedent("""
    import hashlib, json, sys, warnings
    warnings.simplefilter("ignore")
    import xinsitu
    where = sys.argv[1]
    if where.startswith("xr:"):  # plain xarray: the accessor sorts the channels (SPEC §1)
        import xarray as xr
        ds = xr.open_zarr(where[3:])
    elif where.startswith("xrds:"):
        import xarray as xr
        ds = xr.open_dataset(where[5:], engine="zarr", chunks=None).isel(t=slice(0, 12))
    elif where.startswith("icechunk:"):
        import icechunk
        repo = icechunk.Repository.open(icechunk.local_filesystem_storage(where[len("icechunk:"):]))
        ds = xinsitu.open_zarr(repo.readonly_session(branch="main").store)
    else:
        ds = xinsitu.open_zarr(where)
    m = ds.insitu.split("t", fractions={"train": 0.5, "val": 0.5})
    gen = ds.insitu.batches(m, "train", batch_size=4, output="numpy", stack=True, shuffle=False)
    batch = next(iter(gen))
    st = ds.insitu.stats(m, "train")
    print(json.dumps({"data_vars": list(ds.data_vars), "channels": gen.channels, "stats": st["channels"],
                      "state": gen.state_dict()["channels"], "batch": hashlib.sha256(batch.tobytes()).hexdigest()}))
""")


def _dataset() -> xr.Dataset:
    # each variable holds its own constant, so a permuted channel axis changes the batch
    return xr.Dataset({n: (("t", "x"), np.full((16, 3), i, dtype="f4")) for i, n in enumerate(NAMES)},
                      coords={"t": np.arange(16)})


def _runs(where: str, processes: int = PROCESSES) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    out = []
    for seed in range(processes):
        env["PYTHONHASHSEED"] = str(seed)
        res = subprocess.run([sys.executable, "-c", CHILD, where], env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert res.returncode == 0, res.stderr[-3000:]
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def _assert_same_sorted(runs: list[dict]) -> None:
    first = runs[0]
    assert first["data_vars"] == sorted(NAMES)
    assert first["channels"] == first["stats"] == first["state"] == sorted(NAMES)
    for r in runs[1:]:
        assert r == first


@pytest.mark.slow
def test_unconsolidated_v3_store_has_one_order(tmp_path):
    path = str(tmp_path / "u.zarr")
    _dataset().to_zarr(path, zarr_format=3, consolidated=False, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    _assert_same_sorted(_runs(path))


@pytest.mark.parametrize("how", ["xr", "xrds"])
@pytest.mark.slow
def test_unconsolidated_store_through_xarray_has_one_order(tmp_path, how):
    """xr.open_zarr / xr.open_dataset(engine="zarr") list an unconsolidated store's arrays in no fixed
    order; the accessor sorts them by name for the channels, statistics and state (SPEC §1)."""
    path = str(tmp_path / "u.zarr")
    _dataset().to_zarr(path, zarr_format=3, consolidated=False, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    runs = _runs(f"{how}:{path}", 3)
    assert any(r["data_vars"] != sorted(NAMES) for r in runs)  # xarray's own order: the store's listing
    for r in runs:
        assert r["channels"] == r["stats"] == r["state"] == sorted(NAMES)
        assert r["batch"] == runs[0]["batch"]


def test_accessor_sorts_only_a_listed_order(tmp_path):
    """The order is sorted where it may be a store's listing: the Dataset's variables are stored in a
    group without consolidated metadata, whether it still holds the backend that read it or not (copy,
    rename, drop_vars, assign_attrs and ds[[...]] drop it and keep the listed order, which changes from
    process to process); variables= is kept, and so is the order of a consolidated store's Dataset."""
    path = str(tmp_path / "u.zarr")
    _dataset().to_zarr(path, zarr_format=3, consolidated=False, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    ds = xr.open_zarr(path, chunks=None)
    m = ds.insitu.split("t", fractions={"train": 0.5, "val": 0.5})
    kw = dict(batch_size=4, output="numpy", stack=True, shuffle=False)
    assert ds.insitu.batches(m, "train", **kw).channels == sorted(NAMES)
    assert ds.isel(x=[0, 2]).insitu.batches(m, "train", **kw).channels == sorted(NAMES)
    assert ds.insitu.dataset(m, "train", stack=True).channels == sorted(NAMES)
    batch = next(iter(ds.insitu.batches(m, "train", **kw)))
    np.testing.assert_array_equal(batch[:, :, 0], [[NAMES.index(n) for n in sorted(NAMES)]] * 4)
    assert ds.insitu.batches(m, "train", variables=["zeta", "alpha"], **kw).channels == ["zeta", "alpha"]
    for made in (ds.copy(), ds.rename(mid="mid2").rename(mid2="mid"), ds.assign_attrs(a=1), ds[list(ds.data_vars)],
                 ds.drop_vars("zeta").assign(zeta=ds.zeta), ds[["zeta", "mid", "alpha"]]):
        assert made.insitu.batches(m, "train", **kw).channels == sorted(made.data_vars), list(made.data_vars)
    assert ds[["zeta", "mid", "alpha"]].insitu.batches(m, "train", variables=["zeta", "mid", "alpha"],
                                                      **kw).channels == ["zeta", "mid", "alpha"]
    cons = str(tmp_path / "c.zarr")
    _dataset().to_zarr(cons, zarr_format=3, consolidated=True, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    ds = xr.open_zarr(cons, chunks=None)
    assert ds.insitu.batches(m, "train", **kw).channels == list(ds.data_vars)
    for made in (ds.copy(), ds[["zeta", "mid", "alpha"]]):  # a consolidated store's order is fixed: kept
        assert made.insitu.batches(m, "train", **kw).channels == list(made.data_vars)


@pytest.mark.slow
def test_icechunk_repository_has_one_order(tmp_path):
    icechunk = pytest.importorskip("icechunk")
    icechunk.set_logs_filter("error")
    path = str(tmp_path / "repo")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(path))
    s = repo.writable_session("main")
    _dataset().to_zarr(s.store, zarr_format=3, consolidated=False, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    s.commit("eight variables")
    _assert_same_sorted(_runs("icechunk:" + path))


def test_consolidated_order_is_kept(tmp_path):
    """With consolidated metadata, the stored order is fixed: open_zarr keeps what xarray lists."""
    path = str(tmp_path / "c.zarr")
    _dataset().to_zarr(path, zarr_format=3, consolidated=True, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    assert list(xinsitu.open_zarr(path).data_vars) == list(xr.open_zarr(path, chunks=None).data_vars)


def test_sorted_dataset_keeps_coords_attrs_and_laziness(tmp_path):
    path = str(tmp_path / "u.zarr")
    ds = _dataset().assign_coords(lab=("x", np.array([10, 20, 30])), scalar=3)
    ds.attrs["title"] = "eight"
    ds.to_zarr(path, zarr_format=3, consolidated=False, encoding={n: {"chunks": (4, 3)} for n in NAMES})
    got = xinsitu.open_zarr(path)
    assert list(got.data_vars) == sorted(NAMES)
    assert set(got.coords) == {"t", "lab", "scalar"} and got.attrs == {"title": "eight"}
    assert not isinstance(got["alpha"].variable._data, np.ndarray)  # still lazy
    xr.testing.assert_identical(got.load(), xr.open_zarr(path, chunks=None).load()[sorted(NAMES)])


# ------------------------------------------------------------------ recorded channel order
@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> xr.Dataset:
    path = str(tmp_path_factory.mktemp("order") / "s.zarr")
    rng = np.random.default_rng(0)
    ds = xr.Dataset({n: (("t", "x"), rng.normal(i, 1 + i, (16, 3)).astype("f4")) for i, n in enumerate("abc")},
                    coords={"t": np.arange(16)})
    ds.to_zarr(path, zarr_format=3, encoding={n: {"chunks": (4, 3)} for n in "abc"})
    return xinsitu.open_zarr(path)


def test_state_records_channel_order(small):
    m = small.insitu.split("t", fractions={"train": 0.5, "val": 0.5})
    gen = small.insitu.batches(m, "train", batch_size=2, variables=["a", "b"], stack=True, output="numpy")
    it = iter(gen)
    next(it)
    state = json.loads(json.dumps(gen.state_dict()))
    assert state["channels"] == ["a", "b"]
    other = small.insitu.batches(m, "train", batch_size=2, variables=["b", "a"], stack=True, output="numpy")
    with pytest.raises(ValueError, match=r"channel order.*\['a', 'b'\].*\['b', 'a'\]"):
        other.load_state_dict(state)
    same = small.insitu.batches(m, "train", batch_size=2, variables=["a", "b"], stack=True, output="numpy")
    same.load_state_dict(state)
    # a state from before channels were recorded still loads
    old = {k: v for k, v in state.items() if k != "channels"}
    same.load_state_dict(old)
    assert np.array_equal(next(iter(same)), next(it))


def test_normalize_applies_statistics_by_channel_name(small):
    """SPEC §1: m.stats is keyed by channel name; normalize= applies it whatever the order of variables=."""
    m = small.insitu.split("t", fractions={"train": 0.5, "val": 0.5})
    st = small.insitu.stats(m, "train", variables=["a", "b", "c"])
    assert st["channels"] == ["a", "b", "c"]
    raw = {v: small[v].isel(t=slice(8, 16)).values for v in "abc"}
    exp = {v: (raw[v] - np.float32(st[v]["mean"])) / np.float32(st[v]["std"]) for v in "abc"}
    gen = small.insitu.batches(m, "val", variables=["c", "a"], normalize=st, stack=True, output="numpy",
                               shuffle=False, batch_size=8)
    assert gen.channels == ["c", "a"]
    got = next(iter(gen))
    np.testing.assert_array_equal(got[:, 0], exp["c"])
    np.testing.assert_array_equal(got[:, 1], exp["a"])
    got = next(iter(small.insitu.batches(m, "val", variables=["b", "a"], normalize=st, output="numpy",
                                         shuffle=False, batch_size=8)))
    for v in "ab":
        np.testing.assert_array_equal(got[v], exp[v])
    # a variable the statistics lack raises, naming it
    part = small.insitu.stats(m, "train", variables=["a", "b"])
    with pytest.raises(ValueError, match=r"no statistics for variable 'c'"):
        small.insitu.batches(m, "val", variables=["c", "a"], normalize=part, stack=True)
    # statistics without recorded channels (older ones, or hand-written) apply by variable name too
    old = {k: v for k, v in st.items() if k not in ("channels", "variables")}
    old = {k: {kk: vv for kk, vv in v.items() if kk != "channels"} if isinstance(v, dict) else v
           for k, v in old.items()}
    got = next(iter(small.insitu.batches(m, "val", variables=["c", "a"], normalize=old, output="numpy",
                                         shuffle=False, batch_size=8)))
    for v in "ac":
        np.testing.assert_array_equal(got[v], exp[v])


def test_level_order_of_stats_by_name(small):
    """A variable with an extra dim: its labels are channels; labels in another order (or fewer of
    them) take the statistics of their own names."""
    ds = small.assign(z=(("t", "level", "x"), np.stack([small.a.values, 10 * small.b.values], axis=1)))
    ds = ds.assign_coords(level=[500, 850])
    m = ds.insitu.split("t", fractions={"train": 0.5, "val": 0.5})
    st = ds.insitu.stats(m, "train", variables=["a", "z"])
    assert st["channels"] == ["a", "z_500", "z_850"]
    kw = dict(variables=["a", "z"], normalize=st, stack=True, output="numpy", shuffle=False, batch_size=8)
    ref = next(iter(ds.insitu.batches(m, "val", **kw)))
    flip = ds.isel(level=[1, 0]).insitu.batches(m, "val", **kw)
    assert flip.channels == ["a", "z_850", "z_500"]
    np.testing.assert_array_equal(next(iter(flip)), ref[:, [0, 2, 1]])
    one = ds.sel(level=[850]).insitu.batches(m, "val", **kw)
    np.testing.assert_array_equal(next(iter(one)), ref[:, [0, 2]])


def test_state_of_many_channels_stays_small(tmp_path):
    """A time-only variable beside a field makes the field's every grid point a channel (SPEC §4): 400
    here, 65k on a 1-degree grid. The state records their order as a count, a digest and the first and
    last names, not all of them: still small JSON, still refusing another order, still resuming."""
    from xinsitu.index.state import MAX_STATE_CHANNELS

    rng = np.random.default_rng(1)
    ds = xr.Dataset({"f": (("t", "y", "x"), rng.normal(size=(8, 20, 20)).astype("f4")),
                     "s": (("t",), np.arange(8, dtype="f4"))}, coords={"t": np.arange(8)})
    m = ds.insitu.split("t", fractions={"train": 1.0})
    gen = ds.insitu.batches(m, "train", batch_size=2, output="numpy", seed=4)
    assert len(gen.channels) == 401 > MAX_STATE_CHANNELS
    it = iter(gen)
    next(it)
    state = json.loads(json.dumps(gen.state_dict()))
    assert len(json.dumps(state)) < 2000 and state["channels"]["n"] == 401
    other = ds.insitu.batches(m, "train", batch_size=2, output="numpy", seed=4, variables=["s", "f"])
    with pytest.raises(ValueError, match="channel order"):
        other.load_state_dict(state)
    same = ds.insitu.batches(m, "train", batch_size=2, output="numpy", seed=4)
    same.load_state_dict(state)
    a, b = next(iter(same)), next(it)
    assert all(np.array_equal(a[v], b[v]) for v in ("f", "s"))
