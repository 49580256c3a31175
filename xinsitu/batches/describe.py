"""A ``BatchGenerator``'s repr: its title, headline and sections (``repr.formatting`` draws them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from xinsitu.batches.buffer import budget_note, unit_nbytes
from xinsitu.index.plan import EpochPlan, epoch_size, plan_quality, rank_share
from xinsitu.repr.formatting import Section, fmt_bytes

if TYPE_CHECKING:
    from xinsitu.batches.generator import BatchGenerator
    from xinsitu.codecs.gpu_chain import GpuChain


def generator_parts(gen: BatchGenerator, drawing: bool = False) -> tuple[str, str, list[Section]]:
    """Title, headline and sections of ``gen``'s repr."""
    return "xinsitu.BatchGenerator", _generator_headline(gen), _generator_sections(gen, drawing)


def _generator_headline(gen: BatchGenerator) -> str:
    return f"{gen.split!r}: {len(gen)} batches of {gen.batch_size}, output={gen.output!r}"


def _display_plan(gen: BatchGenerator) -> tuple[EpochPlan, int]:
    """The plan the repr describes (its first 50 batches at least) and how many units it reads:
    where the unit order cannot change what the repr shows (units of equal size), the same cut
    with the units in split order, and for one rank only its head (no permutation of, nor pass
    over, 10^7 units just to print); else the plan."""
    c = gen.space.counts
    if gen.elastic_remainder or not len(c) or not bool((c == c[0]).all()) or not c[0]:
        p = gen.plan()
        return p, len(p.units)
    kw: dict[str, Any] = dict(block_chunks=gen.block_chunks, batch_size=gen.batch_size, drop_last=gen.drop_last,
              shuffle=gen.shuffle, seed=gen.seed, epoch=gen.epoch, rank=gen.rank, world_size=gen.world_size)
    if gen.world_size == 1:
        size = epoch_size(gen.space, world_size=1, rank=0, batch_size=gen.batch_size, drop_last=gen.drop_last)
        assert size is not None  # one rank, units of equal size: the size is known without a plan
        n, units = size
        k = min(units, (-(-50 * gen.batch_size // int(c[0])) // gen.block_chunks + 1) * gen.block_chunks)
        return EpochPlan(units=np.arange(k), lo=np.zeros(k, np.int64), hi=c[:k].copy(), n_samples=n, **kw), units
    pos, lo, hi, n = rank_share(c, gen.world_size, gen.rank, gen.batch_size, gen.drop_last)
    return EpochPlan(units=pos, lo=lo, hi=hi, n_samples=n, **kw), len(pos)


def _epoch_bytes(gen: BatchGenerator, p: EpochPlan, n_units: int | None = None) -> int:
    """Decoded bytes of the chunk blocks this rank reads in an epoch (halos and partial chunks aside)."""
    sp = gen.space
    split = {d.name for d in sp.split_dims}
    n_units = len(p.units) if n_units is None else n_units
    if n_units == len(sp.blocks) and all(lay.static or split <= set(lay.src.dims) for lay in gen.layouts.values()):
        # every unit once (one rank): the split's positions, O(runs of the manifest)
        n = gen.manifest.positions(gen.split)
        total = 0
        for lay in gen.layouts.values():
            rest = lay.src.raw_dtype.itemsize * int(np.prod([k for d, k in zip(lay.src.dims, lay.src.shape,
                                                                              strict=True) if d not in split]))
            total += rest * (1 if lay.static else n)
        return total
    coords = np.unravel_index(sp.blocks[p.units], sp.grid)
    extent = {d.name: np.diff(sp.edges[k])[coords[k]] for k, d in enumerate(sp.split_dims)}
    total = 0
    for lay in gen.layouts.values():
        src = lay.src
        per = np.ones(len(p.units), dtype=np.int64)
        rest = src.raw_dtype.itemsize
        for d, n in zip(src.dims, src.shape, strict=True):
            if d in extent:
                per = per * extent[d]
            else:
                rest *= n
        total += rest if lay.static else int(per.sum()) * rest  # a static variable is read once
    return total


def _batch_shape(gen: BatchGenerator) -> str:
    """What one batch is, its axes named: a stacked batch is ``(batch, channel, *window/patch and whole
    dims)`` -- a window's axis after the channels, and the call that puts it before them."""
    b = gen.builder
    sizes = {d.name: d.width for d in gen.space.dims if d.keep}
    n = gen.batch_size
    if not b.stack:
        if gen.output == "xarray":
            return f"xr.Dataset: sample ({n}), then each variable's dims per sample (below)"
        return f"dict: one array per variable, ({n}, *per sample) (below); a static variable: per sample only"
    dims = [(d, sizes.get(d, gen.geometry.sizes.get(d, 0))) for d in b.base_dims]
    lead = ("sample", "variable") if gen.output == "dataarray" else ("batch", "channel")
    shape = ", ".join(f"{a}: {k}" for a, k in [(lead[0], n), (lead[1], len(gen.channels)), *dims])
    window = next((d for d in gen.space.dims if d.keep and d.stride == 1 and d.width > 1), None)
    if window is None or not dims or dims[0][0] != window.name:
        return f"({shape})"
    w = window.name
    move = (f"b.transpose('sample', '{w}', ...)" if gen.output == "dataarray" else "x.swapaxes(1, 2)")
    return f"({shape}); ({lead[0]}, {w}, {lead[1]}, ...): {move}"


def _generator_sections(gen: BatchGenerator, drawing: bool = False) -> list[Section]:
    p, n_units = _display_plan(gen)
    nvar = sum(1 for lay in gen.layouts.values() if not lay.static)
    batches = f"{p.n_batches} x {gen.batch_size} samples"
    if p.n_samples % gen.batch_size:
        batches += " (short last batch dropped)" if gen.drop_last else " (last one short)"
    samples = f"{p.n_samples} of {gen.space.n_samples} in split {gen.split!r}"
    if gen.world_size > 1:
        samples += f" (rank {gen.rank} of {gen.world_size})"
    if gen.shuffle:
        shuffle = (f"seed {gen.seed}, epoch {gen.epoch}, blocks of {gen.block_chunks} chunk blocks; "
                   f"quality {plan_quality(p, gen.space, gen.batch_size, 50):.2f} (1.0 ~ global)")
    else:
        shuffle = f"off: chunk blocks in split order (epoch {gen.epoch})"
    once = ("" if any(d.width > 1 for d in gen.space.split_dims) or gen.manifest.block  # blocks: per buffer
            else ", each chunk read once")
    info = [("batches", batches), ("batch", _batch_shape(gen)), ("samples", samples),
            ("reads / epoch", f"{n_units} chunk blocks x {nvar} variable{'s' if nvar != 1 else ''}, "
                              f"~{fmt_bytes(_epoch_bytes(gen, p, n_units))} decoded{once}"),
            ("shuffle", shuffle), ("buffer", gen.buffer_summary), ("output", gen.output + (f" on {gen.builder.device}"
                                                           if getattr(gen.builder, "device", None) else ""))]
    if getattr(gen, "decode_summary", None):
        info.append(("decode", gen.decode_summary))
    if gen.cache is not None:
        info.append(("cache", gen.cache.summary()))
        info.extend(("cache note", note) for note in getattr(gen.cache, "notes", ()))  # what it could not keep
    roles: list[tuple[str, str, str, str]] = []
    sampled = {d.name for d in gen.space.dims}
    for d in gen.space.dims:
        if d.width == 1:
            what = "1 position"
        elif d.stride == 1:
            what = f"window of {d.width}"
        else:
            what = f"tile of {d.width}, stride {d.stride}"
        role = "split dim" if d.split else ("over: one sample per position" if not d.keep else "window / patch")
        roles.append((d.name, str(d.size), what, role))
    for kept, n in gen.geometry.sizes.items():
        if kept not in sampled:
            roles.append((kept, str(n), f"whole ({n})", "kept"))
    width = {d.name: d.width for d in gen.space.dims if d.keep}
    var_rows = []
    for name, lay in gen.layouts.items():
        shape = ", ".join(f"{d}: {width.get(d, gen.geometry.sizes.get(d, 0))}" for d in lay.out_dims)
        out = np.dtype(gen.builder.var_dtypes.get(name, lay.src.dtype))  # what the batch holds (dtype=, normalize=)
        dtype = str(lay.src.dtype) if out == lay.src.dtype else f"{lay.src.dtype} -> {out}"
        var_rows.append((name, f"({shape})", dtype, "static: same in every batch" if lay.static else ""))
    sections = [Section("Epoch", (), info),
                Section("Sample", ("dim", "length", "takes", "role"), roles),
                Section("Variables", ("variable", "per sample", "dtype", ""), var_rows, summary=f"({len(var_rows)})")]
    last = gen.io_stats
    io = {k: last.get(k, 0) for k in ("chunks", "requests", "bytes_read", "bytes_decoded", "samples_per_s",
                                      "mb_per_s", "seconds", "wait_s", "epoch", "batches")}
    if last:  # a repr never raises: missing counters read as 0
        sections.append(Section("Last epoch I/O", (), [
            ("read", f"{io['chunks']} chunks in {io['requests']} requests, {fmt_bytes(io['bytes_read'])} "
                     f"stored -> {fmt_bytes(io['bytes_decoded'])} decoded"),
            ("rate", f"{io['samples_per_s']:.0f} samples/s, {io['mb_per_s']:.1f} MB/s decoded "
                     f"over {io['seconds']:.2f} s"),
            ("waited for data", f"{io['wait_s']:.2f} s")]
            + ([("cache", f"{last.get('cache_hits', 0)} hits ({last.get('cache_disk_hits', 0)} from disk), "
                          f"{last.get('cache_misses', 0)} misses")] if gen.cache is not None else []),
            summary=f"(epoch {io['epoch']}, {io['batches']} batches)", collapsed=True))
    return sections


def buffer_words(gen: BatchGenerator) -> str:
    """``gen.buffer_summary``: no buffer, or the buffer's chunk blocks and bytes and what set them."""
    if gen.buffer_reason is None:
        return "none: each chunk block is one sample, decoded straight into the batch"
    nbytes = gen.block_chunks * unit_nbytes(gen.space, gen.layouts)
    why = "block_chunks=" if gen._block_chunks_given else budget_note(
        gen.space, nbytes, gen.buffer_budget, gen.batch_size, gen.block_chunks)
    return f"{gen.block_chunks} chunk blocks, ~{fmt_bytes(nbytes)} a buffer ({why}; {gen.buffer_reason})"


def decode_words(gen: BatchGenerator, chain: GpuChain) -> str:
    """The decode path of variables with codec chain ``chain`` and why (``gen.decode_summary``)."""
    gpu = gen._gpu
    if not chain.gpu or gpu is None:
        return chain.describe()
    verdict = gpu.verdicts.get(chain)
    if verdict is None:
        return f"gpu ({chain.reason}, nvCOMP; " + (
            "its first buffer, decoded both ways, decides)" if gen.decode == "auto" else "decode='gpu')")
    if gen.decode == "auto" and not verdict.gpu_faster:
        return f"cpu ({chain.reason}: {verdict.words()})"
    return f"gpu ({chain.reason}, nvCOMP: {verdict.words()}" + ("" if gen.decode == "auto" else "; decode='gpu'") + ")"


def missing_note(n: int, variable: str, chunk: Any, key: str) -> str:
    """Words for ``n`` chunks that had no object in the store and read as the fill value (zarr's rule),
    one of them named: a deleted archive or a store answering 404 looks just like that."""
    return (f"{n} chunk(s) had no object in the store and read as the fill value (e.g. chunk {tuple(chunk)} of "
            f"variable {variable!r}, key {key!r}); zarr writers skip chunks that are all fill value, but a deleted "
            "archive or a store answering 404 looks the same")


def progress_bar(**kw: Any) -> Any:
    """A tqdm bar (``tqdm.auto``): a widget in Jupyter where ipywidgets is installed (the ``notebook``
    extra), else a text bar, without tqdm's warning that it is missing."""
    import sys

    if "tqdm.autonotebook" not in sys.modules:  # its import warns, once: held then (warning filters are global)
        import warnings

        from tqdm.std import TqdmWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TqdmWarning)
            import tqdm.autonotebook  # noqa: F401
    from tqdm.auto import tqdm

    return tqdm(**kw)
