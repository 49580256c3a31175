"""Bad arguments are refused, never reinterpreted: each raises ``TypeError``/``ValueError`` naming the
argument; a generator that would yield nothing says why; the accessor's signatures are spelled out."""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest
import xarray as xr

import xinsitu  # noqa: F401  (registers ds.insitu)
from xinsitu import BatchGenerator


@pytest.fixture(scope="module")
def ds() -> xr.Dataset:
    rng = np.random.default_rng(0)
    return xr.Dataset({"a": (("t", "x"), rng.standard_normal((40, 3))),
                       "b": (("t", "x"), rng.standard_normal((40, 3)))}).chunk({"t": 4})


@pytest.fixture(scope="module")
def m(ds):
    return ds.insitu.split("t", fractions={"train": 0.5, "val": 0.5})


BAD_BATCHES = [
    ({"shuffle": "no"}, TypeError, "shuffle"),
    ({"shuffle": 1}, TypeError, "shuffle"),
    ({"drop_last": "False"}, TypeError, "drop_last"),
    ({"progress": "yes"}, TypeError, "progress"),
    ({"rank": 1.9, "world_size": 2}, TypeError, "rank"),
    ({"rank": True, "world_size": 2}, TypeError, "rank"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank"),
    ({"rank": -1, "world_size": 2}, ValueError, "rank"),
    ({"world_size": 2.0}, TypeError, "world_size"),
    ({"world_size": 0}, ValueError, "world_size"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": 3.5}, TypeError, "batch_size"),
    ({"batch_size": "8"}, TypeError, "batch_size"),
    ({"block_chunks": -2}, ValueError, "block_chunks"),
    ({"max_inflight": 0}, ValueError, "max_inflight"),
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"seed": "0"}, TypeError, "seed"),
    ({"variables": 1.5}, TypeError, "variables"),
    ({"variables": ["a", 2]}, TypeError, "variables"),
    ({"variables": []}, ValueError, "variables"),
    ({"variables": ["nope"]}, ValueError, "variables"),
    ({"variables": ["a", "a"]}, ValueError, "variables"),
    ({"window": {"t": 2.5}}, TypeError, "window"),
    ({"window": {"t": 0}}, ValueError, "window"),
    ({"window": {"q": 2}}, ValueError, "window"),
    ({"window": 3}, TypeError, "window"),
    ({"patch": {"x": 9}}, ValueError, "patch"),
    ({"stride": {"x": 1}}, ValueError, "stride"),
    ({"output": "pandas"}, ValueError, "output"),
    ({"stack": "yes"}, TypeError, "stack"),
    ({"device": "cpu"}, ValueError, "device"),
    # a window longer than any run of the split's chunks: no sample at all
    ({"window": {"t": 21}}, ValueError, "window"),
    # a world so large that this rank gets no batch
    ({"world_size": 1000, "rank": 0}, ValueError, "world_size"),
    # issue 39, item 3c: ranks without a rank, and more ranks than a plan can hold
    ({"world_size": 2}, ValueError, "rank="),
    ({"world_size": 2**40, "rank": 0}, ValueError, "world_size"),
    ({"world_size": 3, "rank": 2, "batch_size": 8, "drop_last": True}, ValueError, "world_size"),
    ({"batch_size": 64, "drop_last": True}, ValueError, "batch_size"),
]


@pytest.mark.parametrize(("kwargs", "error", "name"), BAD_BATCHES, ids=[str(k) for k, _, _ in BAD_BATCHES])
def test_bad_batches_argument(ds, m, kwargs, error, name):
    with pytest.raises(error, match=name):
        ds.insitu.batches(m, "train", **kwargs)


def test_bad_positional_arguments(ds, m):
    with pytest.raises(TypeError, match="manifest"):
        ds.insitu.batches({"train": [0]}, "train")
    with pytest.raises(TypeError, match="split"):
        ds.insitu.batches(m, None)
    with pytest.raises(ValueError, match="split"):
        ds.insitu.batches(m, "test")
    with pytest.raises(TypeError, match=r"manifest must be a SplitManifest, got str 'train': make one first"):
        ds.insitu.batches("train", batch_size=4)  # (was Python's "missing 1 required positional argument: 'split'")
    with pytest.raises(TypeError, match=r"split: name the split to read, one of \['train', 'val'\]"):
        ds.insitu.batches(m, batch_size=4)
    with pytest.raises(AttributeError, match=r"'.insitu.split' works on a Dataset, not a DataArray: use ds\[\['a'\]\]"):
        ds["a"].insitu.split("t", fractions={"train": 1.0})  # (was xarray's "has no attribute 'insitu'")


BAD_SPLIT = [
    ((None,), {"fractions": {"a": 1.0}}, TypeError, "dim"),
    ((3,), {"fractions": {"a": 1.0}}, TypeError, "dim"),
    (([],), {"fractions": {"a": 1.0}}, TypeError, "dim"),
    (("t",), {"fractions": [0.5, 0.5]}, TypeError, "fractions"),
    (("t",), {"ranges": [slice(0, 3)]}, TypeError, "ranges"),
    (("t",), {"fractions": {"a": 0.5, "b": 0.5}, "gap": 1.5}, TypeError, "gap"),
    (("t",), {"fractions": {"a": 0.5, "b": 0.5}, "gap": True}, TypeError, "gap"),
    (("t",), {"fractions": {"a": 0.5, "b": 0.5}, "contiguous": "no"}, TypeError, "contiguous"),
    (("t",), {"fractions": {"a": 0.5, "b": 0.5}, "seed": -1}, ValueError, "seed"),
    (("t",), {"fractions": {"a": 0.5, "b": 0.5}, "seed": 0.5}, TypeError, "seed"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "name"), BAD_SPLIT,
                         ids=[f"{a}-{k}" for a, k, _, _ in BAD_SPLIT])
def test_bad_split_argument(ds, args, kwargs, error, name):
    with pytest.raises(error, match=name):
        ds.insitu.split(*args, **kwargs)


@pytest.mark.parametrize(("i", "error"), [(1.5, TypeError), ("1", TypeError), (True, TypeError),
                                          (-21, IndexError), (20, IndexError)])
def test_bad_sample_index(ds, m, i, error):
    gen = ds.insitu.batches(m, "train")
    assert gen.n_samples == 20
    with pytest.raises(error, match=r"\bi\b"):
        gen.sample(i)
    with pytest.raises(error, match=r"\bi\b"):
        ds.insitu.sample(m, "train", i)


def test_good_arguments_still_pass(ds, m):
    """numpy integers and booleans are integers and booleans."""
    gen = ds.insitu.batches(m, "train", batch_size=np.int64(4), shuffle=np.bool_(False), seed=np.uint8(3),
                            rank=np.int32(1), world_size=2, drop_last=np.True_, variables=("b", "a"))
    assert (gen.batch_size, gen.shuffle, gen.seed, gen.rank, gen.drop_last) == (4, False, 3, 1, True)
    assert gen.channels == ["b", "a"]
    assert float(gen.sample(np.int64(3))["a"][0]) == float(ds.a[3, 0])


def test_meta_device_is_refused(ds, m):
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="meta"):
        ds.insitu.batches(m, "train", output="torch", device="meta")


@pytest.mark.parametrize("device, err", [("nope", ValueError), ("cuda:x", ValueError), (3.5, TypeError),
                                         (object(), TypeError)])
def test_a_bad_torch_device_is_refused_naming_it(ds, m, device, err):
    pytest.importorskip("torch")
    with pytest.raises(err, match="device="):
        ds.insitu.batches(m, "train", output="torch", device=device)


def test_a_torch_device_this_machine_lacks_is_refused_when_the_generator_is_made(ds, m):
    """``device="mps"`` (or xla) on a torch without that backend: a RuntimeError naming ``device=`` in
    one line, when the generator is made (it came from torch, naming nothing, at the first batch)."""
    torch = pytest.importorskip("torch")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(RuntimeError, match=r"^device='mps' cannot be used on this machine: [^\n]*$"):
        ds.insitu.batches(m, "train", output="torch", device="mps")


def test_cuda_on_a_machine_torch_sees_no_gpu_on_is_refused_naming_the_way_on(ds, m):
    """``device="cuda"`` where torch sees no GPU (a CPU-only build, here): refused when the generator is made,
    naming torch's build and ``device='cpu'`` (it said only that CUDA was not available)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"device='cuda': CUDA is not available to torch .*use device='cpu'"):
        ds.insitu.batches(m, "train", output="torch", device="cuda")


def test_output_torch_without_torch_names_the_extra(ds, m, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed
    with pytest.raises(RuntimeError, match=r"output='torch' needs torch: pip install 'xinsitu\[torch\]'"):
        ds.insitu.batches(m, "train", output="torch")


def test_bfloat16_is_refused_saying_what_to_do_instead(ds, m):
    with pytest.raises(ValueError, match="bfloat16 is not an output dtype: take float32"):
        ds.insitu.batches(m, "train", dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["complex256", "float128", ">f4"])
def test_a_dtype_torch_has_no_tensor_for_is_refused_naming_it(ds, m, dtype):
    """Refused when the generator is made, not by torch in the first batch."""
    pytest.importorskip("torch")
    if dtype[0].isalpha() and not hasattr(np, dtype):  # (platforms without extended precision)
        pytest.skip(f"numpy has no {dtype} here")
    for stack in (False, True):
        with pytest.raises(TypeError, match="dtype: output='torch' has no tensor type"):
            ds.insitu.batches(m, "train", output="torch", dtype=dtype, stack=stack)
    ds.insitu.batches(m, "train", output="torch", dtype="uint16")  # torch >= 2.3 has it


def test_accessor_signatures_are_spelled_out():
    from xinsitu.accessor import InsituAccessor

    gen_params = inspect.signature(BatchGenerator.__init__).parameters
    batches = inspect.signature(InsituAccessor.batches)
    assert not any(p.kind is p.VAR_KEYWORD for p in batches.parameters.values())
    assert [p for p in batches.parameters if p != "self"] == [p for p in gen_params if p not in ("self", "ds")]
    for name, p in batches.parameters.items():
        if name not in ("self", "split"):  # (split: None, so that batches("train") names the manifest missing)
            assert p.default == gen_params[name].default, name
    hints = typing.get_type_hints(InsituAccessor.batches)
    assert hints["return"] is BatchGenerator
    assert {"batch_size", "shuffle", "window", "rank"} <= set(hints)
    sample = inspect.signature(InsituAccessor.sample)
    assert not any(p.kind is p.VAR_KEYWORD for p in sample.parameters.values())
    assert {"window", "patch", "stride", "over", "variables", "normalize"} <= set(sample.parameters)
    assert typing.get_type_hints(InsituAccessor.sample)["return"] is xr.Dataset
    stats = inspect.signature(InsituAccessor.stats)
    assert {"variables", "block_chunks", "max_inflight"} <= set(stats.parameters)
    for meth in (InsituAccessor.batches, InsituAccessor.sample, InsituAccessor.stats):
        doc = inspect.getdoc(meth)
        assert "Parameters\n----------" in doc and "Returns\n-------" in doc
        for name in inspect.signature(meth).parameters:
            if name not in ("self", "rank", "world_size", "window", "patch", "stride", "over", "variables",
                            "normalize"):
                assert name in doc, (meth.__name__, name)


@pytest.mark.parametrize(("kwargs", "error", "name"), [({"variables": 1.5}, TypeError, "variables"),
                                                      ({"variables": ["zz"]}, ValueError, "variables"),
                                                      ({"block_chunks": 0}, ValueError, "block_chunks"),
                                                      ({"max_inflight": 2.5}, TypeError, "max_inflight")])
def test_bad_stats_argument(ds, m, kwargs, error, name):
    with pytest.raises(error, match=name):
        ds.insitu.stats(m, "train", **kwargs)
    assert ds.insitu.stats(m, "train", variables="a")["channels"] == ["a"]


# ----------------------------------------------------------------- issue 39, item 3c: normalize=
@pytest.mark.parametrize(("var", "key", "value", "match"), [
    ("a", "std", -1.0, r"'std' of 'a', channel 'a' is -1.0"),
    ("b", "std", float("nan"), r"'std' of 'b', channel 'b' is nan"),
    ("a", "std", float("inf"), r"'std' of 'a'.*is inf"),
    ("b", "mean", float("nan"), r"'mean' of 'b'.*is nan"),
])
def test_statistics_that_cannot_normalise_are_refused(ds, m, var, key, value, match):
    """A negative, NaN or infinite std (or a NaN mean) was applied without a word: batches of NaN, or of
    flipped signs. ``None`` stays the documented "no statistics for this channel" (NaN)."""
    import copy

    st = copy.deepcopy(ds.insitu.stats(m, "train"))
    st[var][key] = value
    with pytest.raises(ValueError, match=match):
        ds.insitu.batches(m, "train", normalize=st)
    with pytest.raises(ValueError, match=match):
        ds.insitu.sample(m, "train", 0, normalize=st)
    st[var][key] = None
    ds.insitu.batches(m, "train", normalize=st)


def test_statistics_of_another_split_or_manifest_are_named(ds, m):
    """``channels.check_stats_origin``: statistics of a split the manifest lacks, or of a split of that name
    made of other chunk blocks (another manifest), raise; statistics of a split other than ``"train"`` warn;
    statistics of the same split of other data (another region) are the user's choice, also after
    ``m.stats`` was replaced by another region's."""
    import copy

    from xinsitu.index.channels import check_stats_origin

    own = ds.insitu.stats(m, "train")  # also m.stats
    check_stats_origin(own, m, "val")  # train's statistics for the val split: as documented
    other = ds.insitu.split("t", fractions={"fit": 0.25, "check": 0.75})
    with pytest.raises(ValueError, match=r"split 'fit', which this manifest does not have.*another manifest"):
        check_stats_origin(ds.insitu.stats(other, "fit"), m, "train")
    shifted = ds.insitu.split("t", fractions={"train": 0.25, "val": 0.75})
    theirs = ds.insitu.stats(shifted, "train")  # same split name, other positions
    with pytest.raises(ValueError, match=r"split 'train' made of other chunk blocks than this manifest's"):
        check_stats_origin(theirs, m, "train")
    val = copy.deepcopy(ds.insitu.stats(m, "val"))
    with pytest.warns(UserWarning, match=r"statistics are of split 'val', not 'train'.*leaks"):
        check_stats_origin(val, m, "val")
    check_stats_origin({k: v for k, v in own.items() if k != "split"}, m, "train")  # hand-written: no record
    # and what batches(), dataset() and sample() do with them: the same checks, at the caller's line
    with pytest.raises(ValueError, match="another manifest"):
        ds.insitu.batches(m, "train", normalize=ds.insitu.stats(other, "fit"))
    ds.insitu.stats(m, "train")  # m.stats: train's again (the val statistics above replaced them)
    with pytest.raises(ValueError, match="made of other chunk blocks"):
        ds.insitu.dataset(m, "train", normalize=theirs)
    part = ds.isel({d: slice(0, 2) for d in ds.a.dims if d != "t"})  # another region: its own statistics
    mine = part.insitu.stats(m, "train")
    ds.insitu.stats(m, "train")  # m.stats: the whole region's
    next(iter(part.insitu.batches(m, "train", normalize=mine)))
    with pytest.warns(UserWarning, match="not 'train'") as rec:
        ds.insitu.batches(m, "val", normalize=val)
    assert rec[0].filename == __file__


# ------------------------------------------- issue 39, item 3c: errors that came from deep inside a dependency
BAD_CACHE = [
    ({"immutable": "false"}, TypeError, "immutable"),  # was True: version checks silently off
    ({"immutable": 1}, TypeError, "immutable"),
    ({"fsync": "no"}, TypeError, "fsync"),
    ({"memory": float("nan")}, ValueError, "memory"),  # was "cannot convert float NaN to integer"
    ({"memory": float("inf")}, ValueError, "memory"),  # was OverflowError
    ({"disk": 1}, TypeError, "disk"),  # was os.fspath's "expected str, bytes or os.PathLike object"
    ({"disk": b"/tmp/x"}, TypeError, "disk"),
    ({"disk": ""}, ValueError, "disk"),  # was a disk tier in the working directory
    ({"disk": "a\0b"}, ValueError, "disk"),  # was "embedded null byte"
    ({"disk_size": float("nan"), "disk": "{tmp}"}, ValueError, "disk_size"),
]


@pytest.mark.parametrize(("kwargs", "error", "name"), BAD_CACHE, ids=[str(k) for k, _, _ in BAD_CACHE])
def test_bad_chunk_cache_argument(tmp_path, kwargs, error, name):
    kwargs = {k: str(tmp_path / "c") if v == "{tmp}" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=name):
        xinsitu.ChunkCache(**kwargs)


BAD_OPEN = [
    ((None,), {}, TypeError, "store"),  # was FileNotFoundError "no zarr group found at NoneType"
    (("s3://bucket/a.zarr",), {"anonymous": "no"}, TypeError, "anonymous"),  # was read as True
    (("s3://bucket/a.zarr",), {"region": 1}, TypeError, "region"),  # "'int' object is not an instance of 'str'"
    (("http://127.0.0.1:9/a.zarr",), {"client_options": 1}, TypeError, "client_options"),  # "'int' ... not iterable"
    (("http://127.0.0.1:9/a.zarr",), {"client_options": {"timeout": 30}}, TypeError, r"client_options\['timeout'\]"),
    (("http://127.0.0.1:9/a.zarr",), {"retry_config": 3}, TypeError, "retry_config"),
    (("http://127.0.0.1:9/a.zarr",), {"retry_config": {"max_retries": "3"}}, TypeError, "max_retries"),
    (("http://127.0.0.1:9/a.zarr",), {"retry_config": {"retry_timeout": 60}}, TypeError, "retry_timeout"),
    (("http://127.0.0.1:9/a.zarr",), {"retry_config": {"max_retry": 3}}, ValueError, "max_retry"),  # was ignored
    (("s3://bucket/a.zarr",), {"credential_provider": "me"}, TypeError, "credential_provider"),  # at the first request
]


@pytest.mark.parametrize(("args", "kwargs", "error", "name"), BAD_OPEN, ids=[f"{a}-{k}" for a, k, _, _ in BAD_OPEN])
def test_bad_open_zarr_argument(args, kwargs, error, name):
    with pytest.raises(error, match=name):
        xinsitu.open_zarr(*args, **kwargs)


def test_open_zarr_names_a_group_that_is_not_there(tmp_path):
    """A group the consolidated metadata lacks was zarr's ``KeyError``; it is a ``ValueError`` naming ``group``."""
    from xinsitu.synthetic import write_era5_like

    write_era5_like(str(tmp_path / "a.zarr"), nt=8, ny=2, nx=3, chunk_time=4)
    with pytest.raises(ValueError, match="group='nope'"):
        xinsitu.open_zarr(str(tmp_path / "a.zarr"), group="nope")


@pytest.mark.parametrize("other", [lambda d: d.isel(t=0), lambda d: d.rename(t="time")], ids=["isel", "rename"])
def test_a_manifest_on_a_dataset_without_its_split_dim_names_the_dim(ds, m, other):
    """The manifest's split dim is what the Dataset lacks (it said "the Dataset has no data variables")."""
    for call in (lambda d: d.insitu.batches(m, "train"), lambda d: d.insitu.dataset(m, "train"),
                 lambda d: d.insitu.stats(m, "train")):
        with pytest.raises(ValueError, match=r"manifest splits dim\(s\) \['t'\], which no data variable"):
            call(other(ds))
