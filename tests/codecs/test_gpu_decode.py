"""GPU decode's host side (SPEC §4 "GPU"): which codec chains nvCOMP can decode (from the metadata,
with the reason where not), the framing stripped on the host (crc32c verified), a buffer's chunks
landing once in page-locked staging (a local file read straight into it, other bytes copied in once),
staging buffers reused once their copy's event completed, copied in ONE transfer and decoded in ONE
batched call straight into the destinations -- run through the stand-in decoder (numpy + numcodecs for
cupy + nvCOMP) and checked bit for bit against zarr's own decode. The nvCOMP decoder itself is tested on
a GPU (``gpu`` marker)."""

from __future__ import annotations

import os

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, TransposeCodec, ZstdCodec

from tests.support.gpu import CUDA
from xinsitu.codecs.gpu import check_decode, resolve_decode
from xinsitu.codecs.gpu_batch import GpuBatch
from xinsitu.codecs.gpu_chain import ChecksumError, GpuChain, gpu_chain, payload, zstd_content_size
from xinsitu.codecs.nvcomp import StandInDecoder
from xinsitu.codecs.staging import ALIGN, PinnedRing, Staging

CHAINS = {
    "v3-zstd": (3, dict(compressors=[ZstdCodec(level=3)]), "zstd"),
    "v3-zstd-checksum": (3, dict(compressors=[ZstdCodec(level=1, checksum=True)]), "zstd"),
    "v3-zstd-crc32c": (3, dict(compressors=[ZstdCodec(), Crc32cCodec()]), "zstd + crc32c"),
    "v3-gzip": (3, dict(compressors=[GzipCodec(level=5)]), "gzip"),
    "v3-none": (3, dict(compressors=None), "uncompressed"),
    "v3-crc32c-only": (3, dict(compressors=[Crc32cCodec()]), "uncompressed + crc32c"),
    "v2-zstd": (2, dict(compressors=numcodecs.Zstd(level=2)), "zstd"),
    "v2-lz4": (2, dict(compressors=numcodecs.LZ4()), "lz4"),
    "v2-zlib": (2, dict(compressors=numcodecs.Zlib(level=6)), "zlib"),
    "v2-gzip": (2, dict(compressors=numcodecs.GZip(level=1)), "gzip"),
    "v2-none": (2, dict(compressors=None), "uncompressed"),
}


def make(tmp_path, fmt, kw, dtype="f4", shape=(10, 6), chunks=(4, 3), **more):
    path = os.fspath(tmp_path / f"a{fmt}.zarr")
    a = zarr.create_array(path, shape=shape, chunks=chunks, dtype=dtype, zarr_format=fmt, fill_value=0, **kw,
                          **more)
    rng = np.random.default_rng(1)
    vals = rng.normal(size=shape).astype(dtype) if np.dtype(dtype).kind == "f" else \
        rng.integers(-1000, 1000, size=shape).astype(dtype)
    a[...] = vals
    return zarr.open_array(path, mode="r"), path


def raw_chunks(a, path):
    grid = [range(-(-s // c)) for s, c in zip(a.shape, a.chunks, strict=True)]
    out = []
    for coords in np.ndindex(*[len(g) for g in grid]):
        key = a.metadata.encode_chunk_key(coords)
        with open(os.path.join(path, key), "rb") as f:
            out.append((coords, f.read()))
    return out


def expected(a, coords):
    """zarr's decode of chunk ``coords``, padded to the whole chunk as it is stored."""
    sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, a.chunks, strict=True))
    got = a[sel]
    full = np.zeros(a.chunks, a.dtype)
    full[tuple(slice(0, n) for n in got.shape)] = got
    return full


@pytest.mark.parametrize("name", list(CHAINS))
def test_stand_in_decoder_bit_identical_to_zarr(tmp_path, name):
    fmt, kw, words = CHAINS[name]
    a, path = make(tmp_path, fmt, kw)
    chain = gpu_chain(a)
    assert chain.gpu and chain.reason == words and chain.shape == (4, 3) and chain.dtype == np.float32
    chunks = raw_chunks(a, path)
    dec = StandInDecoder()
    dests = [np.full(chain.shape, np.nan, chain.dtype) for _ in chunks]
    dec.decode_many([r for _, r in chunks], dests, chain)
    for (coords, _), d in zip(chunks, dests, strict=True):
        # edge chunks hold zarr's padding past the array's end: compare what the array has
        e = expected(a, coords)
        n = tuple(min(c, s - i * c) for i, c, s in zip(coords, a.chunks, a.shape, strict=True))
        inner = tuple(slice(0, k) for k in n)
        assert np.array_equal(d[inner].view("u4"), e[inner].view("u4"))  # bit for bit
    # one transfer, one batched call for the buffer (none where the chunks are stored as they are)
    assert (dec.transfers, dec.decode_calls) == (1, int(chain.compressor is not None))


@pytest.mark.parametrize("dtype", ["i2", "u1", "f8", "i8"])
def test_dtypes(tmp_path, dtype):
    a, path = make(tmp_path, 3, dict(compressors=[ZstdCodec()]), dtype=dtype)
    chain = gpu_chain(a)
    chunks = raw_chunks(a, path)
    dests = [np.empty(chain.shape, chain.dtype) for _ in chunks]
    StandInDecoder().decode_many([r for _, r in chunks], dests, chain)
    assert np.array_equal(dests[0], expected(a, chunks[0][0]))


def test_pinned_buffer_reused_across_batches(tmp_path):
    a, path = make(tmp_path, 3, dict(compressors=[ZstdCodec()]))
    chain = gpu_chain(a)
    chunks = [r for _, r in raw_chunks(a, path)]
    dec = StandInDecoder()
    for _ in range(4):
        dests = [np.empty(chain.shape, chain.dtype) for _c in chunks]
        dec.decode_many(chunks, dests, chain)
    assert dec.ring.allocs == 1 and dec.transfers == 4 and dec.decode_calls == 4


def test_payload_offsets_are_aligned_and_packed_in_order(tmp_path):
    a, path = make(tmp_path, 2, dict(compressors=numcodecs.LZ4()))
    chain = gpu_chain(a)
    raws = [r for _, r in raw_chunks(a, path)]
    parts = [payload(r, chain) for r in raws]
    staging = Staging(PinnedRing(lambda n: np.zeros(n, np.uint8)), sum(chain.bound for _ in raws))
    spans = [(staging.put(p), len(p)) for p in parts]
    host, moved = staging.finish()
    assert moved == [] and [n for _, n in spans] == [len(r) - 4 for r in raws]  # lz4's size prefix stripped
    assert all(off % ALIGN == 0 for off, _ in spans)
    assert all(bytes(host[o:o + n]) == bytes(p) for (o, n), p in zip(spans, parts, strict=True))


def test_crc32c_verified_on_the_host(tmp_path):
    a, path = make(tmp_path, 3, dict(compressors=[ZstdCodec(), Crc32cCodec()]))
    chain = gpu_chain(a)
    (coords, raw), *_ = raw_chunks(a, path)
    bad = bytearray(raw)
    bad[5] ^= 0xFF
    dec = StandInDecoder()
    with pytest.raises(ChecksumError, match=r"t2m chunk \(0, 0\).*crc32c"):
        dec.decode_many([bytes(bad)], [np.empty(chain.shape, chain.dtype)], chain, ["t2m chunk (0, 0)"])
    assert dec.transfers == 0  # nothing copied


def test_wrong_sizes_and_destinations_raise(tmp_path):
    a, path = make(tmp_path, 2, dict(compressors=numcodecs.GZip()))
    chain = gpu_chain(a)
    (_, raw), *_ = raw_chunks(a, path)
    dec = StandInDecoder()
    with pytest.raises(ValueError, match="destination"):
        dec.decode_many([raw], [np.empty((3, 4), chain.dtype)], chain)
    with pytest.raises(ValueError, match="2 chunks but 1 destinations"):
        dec.decode_many([raw, raw], [np.empty(chain.shape, chain.dtype)], chain)
    other = GpuChain(True, "gzip", "gzip", False, (5, 3), np.dtype("f4"))
    with pytest.raises(ValueError, match="gzip stream holds 48 bytes, the chunk 60"):
        payload(raw, other, "v chunk (0, 0)")


def test_gpu_batch_collects_and_flushes_once(tmp_path):
    a, path = make(tmp_path, 3, dict(compressors=[ZstdCodec()]))
    chain = gpu_chain(a)
    dec = StandInDecoder()
    chunks = raw_chunks(a, path)
    batch = GpuBatch(dec, len(chunks) * chain.bound)
    dests = []
    for coords, raw in chunks:
        dests.append(np.empty(chain.shape, chain.dtype))
        batch.add(raw, chain, dests[-1], ("x", coords, f"x/c/{coords}"))
    got = batch.flush()
    assert got.decoded == {chain: len(chunks)} and not got.refetch and dec.transfers == 1
    assert np.array_equal(dests[0], expected(a, chunks[0][0]))
    assert batch.flush().decoded == {}


@pytest.mark.parametrize("name", ["v3-zstd", "v3-zstd-crc32c", "v2-lz4", "v3-gzip", "v2-zlib", "v3-none"])
def test_local_reads_land_in_the_staging_once(tmp_path, name):
    """A local chunk file is read straight into the batch's page-locked staging (``LocalBackend.read``
    with the staging as its scratch): no copy after the read -- a payload behind framing (lz4's size
    prefix, gzip's and zlib's headers) is only moved back to its aligned start -- and the decode is
    zarr's, bit for bit."""
    from xinsitu.stores.backend import LocalBackend

    fmt, kw, _ = CHAINS[name]
    a, path = make(tmp_path, fmt, kw)
    chain = gpu_chain(a)
    chunks = raw_chunks(a, path)
    dec = StandInDecoder()
    batch = GpuBatch(dec, len(chunks) * chain.bound)
    store = LocalBackend(path, None)
    dests = [np.full(chain.shape, np.nan, chain.dtype) for _ in chunks]
    for (coords, raw), d in zip(chunks, dests, strict=True):
        got = store.read(a.metadata.encode_chunk_key(coords), batch.staging)
        assert bytes(got) == raw
        batch.add(got, chain, d, ("x", coords, "x/c"))
    # every region is the file's size and the one byte more a read asks, aligned: nothing was copied in
    assert batch.staging.used == sum(-(-(len(r) + 1) // ALIGN) * ALIGN for _, r in chunks)
    assert all(e.off % ALIGN == 0 for e in batch.entries)
    out = batch.flush()
    assert out.decoded == {chain: len(chunks)} and dec.transfers == 1
    for (coords, _), d in zip(chunks, dests, strict=True):
        e = expected(a, coords)
        inner = tuple(slice(0, min(c, s - i * c)) for i, c, s in zip(coords, a.chunks, a.shape, strict=True))
        assert np.array_equal(d[inner].view("u1"), e[inner].view("u1"))


def test_bytes_that_do_not_fit_the_staging_are_packed_behind_it(tmp_path):
    a, path = make(tmp_path, 3, dict(compressors=[ZstdCodec()]))
    chain = gpu_chain(a)
    chunks = raw_chunks(a, path)
    dec = StandInDecoder()
    batch = GpuBatch(dec, 2 * ALIGN)  # room for the first chunk or so: the others kept aside
    dests = [np.empty(chain.shape, chain.dtype) for _ in chunks]
    for (coords, raw), d in zip(chunks, dests, strict=True):
        batch.add(raw, chain, d, ("x", coords, "x/c"))
    assert batch.staging.aside
    assert batch.flush().decoded == {chain: len(chunks)} and dec.transfers == 1
    for (coords, _), d in zip(chunks, dests, strict=True):
        assert np.array_equal(d, expected(a, coords))


class _Event:
    """A CUDA event of a copy still under way until ``synchronize`` (or ``done`` set)."""

    def __init__(self):
        self.done, self.waited = False, 0

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_staging_buffer_reused_only_after_its_copy_completed():
    ring = PinnedRing(lambda n: np.empty(n, np.uint8), slots=2)
    a = ring.take(100)
    first = _Event()
    ring.give_back(a, first)
    b = ring.take(100)  # a's copy is under way and the ring has room: a new buffer, no wait
    assert b is not a and first.waited == 0 and ring.allocs == 2
    second = _Event()
    ring.give_back(b, second)
    c = ring.take(100)  # both copies under way, the ring full: the oldest, once its copy completed
    assert c is a and first.waited == 1 and second.waited == 0 and ring.waits == 1
    second.done = True
    assert ring.take(50) is b and second.waited == 0  # its copy done: reused at once
    assert ring.allocs == 2


def test_chunks_that_are_not_the_chains_go_the_cpu_way(tmp_path):
    """A chunk whose stored bytes are not what its chain says -- a zstd frame of another size, garbage --
    is not decoded on the device: the flush hands it back, to be fetched again and decoded the CPU way
    (where a damaged chunk is named)."""
    a, path = make(tmp_path, 3, dict(compressors=[ZstdCodec()]))
    chain = gpu_chain(a)
    (c0, raw), (c1, _), *_ = raw_chunks(a, path)
    assert zstd_content_size(memoryview(raw)) == chain.nbytes
    other = numcodecs.Zstd().encode(np.zeros(chain.nbytes // 2, "u1"))
    dec = StandInDecoder()
    batch = GpuBatch(dec, 4 * chain.bound)
    dests = [np.empty(chain.shape, chain.dtype) for _ in range(3)]
    batch.add(raw, chain, dests[0], ("x", c0, "x/c/0/0"))
    batch.add(other, chain, dests[1], ("x", c1, "x/c/1/0"))
    batch.add(b"\x28\xb5\x2f\xfd garbage that is no frame", chain, dests[2], ("x", (2, 0), "x/c/2/0"))
    out = batch.flush()
    assert out.decoded == {chain: 1} and np.array_equal(dests[0], expected(a, c0))
    assert [n for _, _, n in out.refetch] == [("x", c1, "x/c/1/0"), ("x", (2, 0), "x/c/2/0")]


@pytest.mark.parametrize("fmt,kw,more,why", [
    (3, dict(compressors=[BloscCodec()]), {}, "blosc"),
    (2, dict(compressors=numcodecs.Blosc()), {}, "blosc (shuffle inside the blosc frame)"),
    (2, dict(compressors=numcodecs.Zstd(), filters=[numcodecs.Delta("f4")]), {}, "filters ['delta']"),
    (3, dict(compressors=[ZstdCodec()], filters=[TransposeCodec(order=(1, 0))]), {}, "array-to-array"),
    (3, dict(compressors=[ZstdCodec()], serializer=BytesCodec(endian="big")), {}, "bytes in big endian order"),
    (3, dict(compressors=[ZstdCodec()]), dict(shards=(8, 6)), "sharded"),
    (3, dict(compressors=[GzipCodec(), ZstdCodec()]), {}, "gzip + zstd"),
])
def test_chains_nvcomp_cannot_decode_say_why(tmp_path, fmt, kw, more, why):
    a, _ = make(tmp_path, fmt, kw, **more)
    chain = gpu_chain(a)
    assert not chain.gpu and why in chain.reason
    assert chain.describe().startswith("cpu (")
    with pytest.raises(ValueError, match="decodes on the CPU"):
        StandInDecoder().decode_many([b""], [np.empty(a.chunks, a.dtype)], chain)


@pytest.mark.parametrize("bad,exc", [(1, TypeError), (None, TypeError), ("GPU", ValueError), ("cuda", ValueError)])
def test_decode_argument_validated(bad, exc):
    with pytest.raises(exc, match="decode"):
        check_decode(bad)


def test_resolve_decode(tmp_path):
    good, _ = make(tmp_path / "g", 3, dict(compressors=[ZstdCodec()]))
    blosc, _ = make(tmp_path / "b", 3, dict(compressors=[BloscCodec()]))
    arrays = {"t2m": good, "u10": blosc, "lsm": None}

    def have():
        return None

    def missing():
        raise RuntimeError("decode='gpu' needs cupy and nvCOMP (cupy is missing): pip install 'xinsitu[gpu-cu12]'")

    # auto: the GPU where it can, the CPU elsewhere, each with its reason
    got = resolve_decode("auto", None, arrays, have)
    assert got["t2m"].gpu and not got["u10"].gpu and not got["lsm"].gpu
    assert "blosc" in got["u10"].reason and "not a stored zarr array" in got["lsm"].reason
    assert not any(c.gpu for c in resolve_decode("auto", "output='numpy'", arrays, have).values())
    assert not any(c.gpu for c in resolve_decode("auto", None, arrays, missing).values())
    assert not any(c.gpu for c in resolve_decode("cpu", None, arrays, have).values())
    # gpu: raises where it cannot be honoured, naming why
    with pytest.raises(ValueError, match=r"'u10' \(blosc.*'lsm' \(not a stored zarr array\)"):
        resolve_decode("gpu", None, arrays, have)
    with pytest.raises(ValueError, match="needs batches on a CUDA device.*output='numpy'"):
        resolve_decode("gpu", "output='numpy'", arrays, have)
    with pytest.raises(RuntimeError, match=r"xinsitu\[gpu-cu12\]"):
        resolve_decode("gpu", None, {"t2m": good}, missing)
    assert resolve_decode("gpu", None, {"t2m": good}, have)["t2m"].describe() == "gpu (zstd, nvCOMP)"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CHAINS))
def test_nvcomp_decoder_bit_identical_to_zarr(tmp_path, name):
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("nvidia.nvcomp")
    from xinsitu.codecs.nvcomp import NvcompDecoder

    fmt, kw, _ = CHAINS[name]
    a, path = make(tmp_path, fmt, kw)
    chain = gpu_chain(a)
    chunks = raw_chunks(a, path)
    dec = NvcompDecoder()
    dests = [cupy.empty(chain.shape, chain.dtype) for _ in chunks]
    dec.decode_many([r for _, r in chunks], dests, chain)
    for (coords, _), d in zip(chunks, dests, strict=True):
        e = expected(a, coords)
        n = tuple(min(c, s - i * c) for i, c, s in zip(coords, a.chunks, a.shape, strict=True))
        inner = tuple(slice(0, k) for k in n)
        assert np.array_equal(cupy.asnumpy(d)[inner].view("u4"), e[inner].view("u4"))
    assert dec.transfers == 1


# ------------------------------------------------------------------ decode= on the generator
@pytest.fixture
def ds_m(era5_path):
    import xinsitu

    ds = xinsitu.open_zarr(era5_path)
    return ds, ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})


@pytest.mark.parametrize("bad,exc", [(True, TypeError), ("GPU", ValueError)])
def test_batches_decode_validated(ds_m, bad, exc):
    ds, m = ds_m
    with pytest.raises(exc, match="decode must be one of"):
        ds.insitu.batches(m, "train", output="numpy", decode=bad)


@pytest.mark.parametrize("kw,why", [(dict(output="numpy"), "output='numpy'"),
                                    (dict(output="torch", device="cpu"), "device='cpu'")])
def test_batches_decode_gpu_without_cuda_device_raises(ds_m, kw, why):
    if kw["output"] == "torch":
        pytest.importorskip("torch")
    ds, m = ds_m
    with pytest.raises(ValueError, match=f"decode='gpu' needs batches on a CUDA device.*{why}"):
        ds.insitu.batches(m, "train", decode="gpu", **kw)


def test_batches_repr_says_the_decode_path(ds_m):
    ds, m = ds_m
    gen = ds.insitu.batches(m, "train", output="numpy", variables=["t2m", "u10"])
    assert gen.decode == "auto" and set(gen.decode_paths) == {"t2m", "u10"}
    assert not any(c.gpu for c in gen.decode_paths.values())
    assert "decode" in repr(gen) and "cpu (no CUDA device: output='numpy'" in repr(gen)
    gen = ds.insitu.batches(m, "train", output="numpy", variables=["t2m"], decode="cpu")
    assert "cpu (decode='cpu')" in repr(gen)
