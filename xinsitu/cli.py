"""``python -m xinsitu``: look at an archive and measure how fast it can feed training.

``inspect URL``
    The chunk geometry and a suggested split (80/10/10 on the first chunked dim, with a
    gap of one chunk block), with the line of Python that makes it.
``doctor``
    One line to paste into an issue: the versions that matter and the decode path chosen.
``bench URL``
    Reads chunk blocks of one split twice: a *raw* pass fetches every stored object once
    through the same backend the loader uses (no decoding), then the loader itself
    (``ds.insitu.batches``) reads and decodes every chunk once and gathers batches;
    ``gen.io_stats`` reports what that cost. From the two it tells whether the store,
    the decoding, or the model is likely to limit training.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time
import warnings
from typing import Any, NoReturn
from urllib.parse import urlsplit

import numpy as np

from xinsitu import __version__
from xinsitu.index.source import CONSOLIDATED_WARNING
from xinsitu.repr import formatting as _repr

DEFAULT_FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}


# ----------------------------------------------------------------------------- arguments
def _option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value), with ``true``/``false`` converted and a JSON object or list parsed
    (``filter_by_keys={"typeOfLevel": "surface"}`` for GRIB); other values stay strings, as obstore takes
    them (``timeout=60``, ``pool_max_idle_per_host=4``)."""
    if "=" not in text:  # the text is not echoed: 'secret_access_key SECRET' holds a credential
        word = text.split(None, 1)[0] if text.strip() else ""
        named = f" starting {word!r}" if word.isidentifier() else ""
        raise argparse.ArgumentTypeError(f"a store option{named} must look like KEY=VALUE (no '=' in it; the rest "
                                         "of it is not shown, it may hold a credential)")
    key, value = text.split("=", 1)
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    if value.startswith(("{", "[")):  # JSON: -o 'filter_by_keys={"typeOfLevel": "surface"}'
        try:
            return key, json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"store option {key}= looks like JSON but is not ({e})") from None
    return key, value


def _at_least(low: float, kind: type = int) -> Any:
    """An argparse type: a number of ``kind`` no smaller than ``low``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    return parse


def _flag(text: str) -> bool:
    """``true``/``false`` -> bool."""
    low = text.lower()
    if low not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return low == "true"


def _fractions(text: str) -> dict[str, float]:
    """``train=0.8,val=0.1,test=0.1`` -> dict."""
    out = {}
    for part in text.split(","):
        name, _, val = part.partition("=")
        try:
            out[name.strip()] = float(val)
        except ValueError:
            raise argparse.ArgumentTypeError(f"fractions must look like train=0.8,val=0.2, got {text!r}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``xinsitu`` command-line parser (``inspect`` and ``bench``).

    Returns
    -------
    argparse.ArgumentParser
    """
    ap = argparse.ArgumentParser(prog="xinsitu", description="Train ML models in place on chunked archives.")
    ap.add_argument("--version", action="version", version=f"xinsitu {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{inspect,bench,doctor}")
    doc = sub.add_parser("doctor", help="print one line of versions and the decode path, to paste into an issue",
                         description="Print Python, xinsitu, zarr, numpy, xarray, obstore, torch, jax, cupy, "
                         "CUDA and the decode path chosen, on one line.")
    doc.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    doc.set_defaults(func=cmd_doctor)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", nargs="+", metavar="URL",
                        help="archive URL (s3://, gs://, az://, http(s)://, file://) or local path; or NetCDF "
                        "(classic, NetCDF4) or GRIB files read in place (one or more, or a quoted glob such as "
                        "'data/*.nc')")
    common.add_argument("--consolidated", type=_flag, default=None, metavar="{true,false}",
                        help="use the store's consolidated metadata (default: if present); false skips looking "
                        "for it")
    common.add_argument("-o", "--option", dest="options", action="append", type=_option, default=[],
                        metavar="KEY=VALUE", help="store option for obstore, e.g. region=us-east-1 or "
                        "skip_signature=true (repeatable)")
    common.add_argument("--group", default=None, help="group inside the store")
    common.add_argument("--dim", default=None, help="dim to split (default: the first chunked dim)")
    common.add_argument("--fractions", type=_fractions, default=None, metavar="NAME=F,...",
                        help="split fractions (default: train=0.8,val=0.1,test=0.1)")
    common.add_argument("--gap", type=_at_least(0), default=None,
                        help="chunk blocks left out between splits (default 1)")
    common.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    ins = sub.add_parser("inspect", parents=[common], help="print the chunk geometry and a suggested split",
                         description="Print the chunk geometry and a suggested chunk-aligned split.")
    ins.set_defaults(func=cmd_inspect)

    b = sub.add_parser("bench", parents=[common], help="measure read+decode throughput of the store",
                       description="Measure how fast the store can feed training: a raw pass (fetch only) and "
                       "the loader (fetch, decode, gather) over the same chunks, each read once.")
    b.add_argument("--manifest", default=None, help="split manifest JSON (default: the suggested split)")
    b.add_argument("--split", default="train", help="split to read (default: train)")
    b.add_argument("--variables", default=None, help="comma-separated variables (default: all on the split dim)")
    b.add_argument("--batch-size", type=_at_least(1), default=32)
    b.add_argument("--block-chunks", type=_at_least(1), default=16, help="shuffle buffer, in chunk blocks (default 16)")
    b.add_argument("--max-inflight", type=_at_least(1), default=None,
                   help="requests in flight (default: the loader sizes them from latency; the raw pass keeps 256)")
    b.add_argument("--max-blocks", type=_at_least(0), default=64,
                   help="read at most this many chunk blocks of the split (default 64; 0: the whole split)")
    b.add_argument("--step-ms", type=_at_least(0.0, float), default=None,
                   help="your model's time per training step (ms) for one batch, to name the bottleneck")
    b.set_defaults(func=cmd_bench)
    return ap


def entry() -> NoReturn:
    """``python -m xinsitu`` and the ``xinsitu`` script: ``main``, then the process ends at once with its
    status, its output flushed, without the interpreter's finalization. There, a thread of a native library
    that the command used (a Rust runtime's, reading a file for a NetCDF parser) may still call into Python
    and abort the process after its work is done: twice in CI, under load, an ``inspect`` printed its
    whole result and then exited on SIGABRT."""
    try:
        code = main()
    except SystemExit as e:  # argparse's: it has said why already
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status: 0 on success, 1 when the archive cannot be used as asked.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, OSError) as e:  # bad input or an unreadable store: a message, no traceback
        print(_scrubbed(args, f"xinsitu {args.command}: {type(e).__name__}: {e}"), file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # an extra not installed: xinsitu.virtual's message names it
        print(_scrubbed(args, f"xinsitu {args.command}: {e}"), file=sys.stderr)
        return 1


def _scrubbed(args: argparse.Namespace, text: str) -> str:
    """``text`` (a message to print) without the credentials of the URLs and store options given, nor a
    URL's user info or query string."""
    from xinsitu.stores.redact import redact, secrets_in_options

    options = dict(getattr(args, "options", None) or [])
    urls = [u for u in getattr(args, "url", None) or [] if isinstance(u, str)]
    return redact(text, [s for u in urls or [""] for s in secrets_in_options(u, options)])


#: leading bytes of the files ``inspect``/``bench`` open in place: NetCDF classic (CDF-1, CDF-2), NetCDF4
#: (HDF5), GRIB
_SIGNATURES = {b"CDF\x01": "netcdf", b"CDF\x02": "netcdf", b"\x89HDF": "netcdf", b"GRIB": "grib"}
_OPENERS = {"netcdf": "xinsitu.virtual.open_netcdf", "grib": "xinsitu.virtual.open_grib"}


def file_kind(path: str) -> str | None:
    """``"netcdf"`` or ``"grib"`` by the file's signature, None for anything else (a directory, a URL,
    another file)."""
    if "://" in path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        head = f.read(4)
    return _SIGNATURES.get(head)


def _paths(urls: list[str]) -> list[str]:
    """Local glob patterns expanded (sorted); URLs and existing paths as given."""
    out: list[str] = []
    for u in urls:
        if "://" not in u and not os.path.exists(u) and glob.has_magic(u):
            found = sorted(glob.glob(os.path.expanduser(u)))
            if not found:
                raise FileNotFoundError(f"no file matches {u!r}")
            out += found
        else:
            out.append(u)
    return out


def _open(args: argparse.Namespace) -> Any:
    """The Dataset ``args.url`` names (a Zarr archive, or NetCDF/GRIB files opened in place); sets
    ``args.code``, the line of Python that opens it, and ``args.in_place``, whether they are files read in
    place (NetCDF or GRIB)."""
    import xinsitu
    from xinsitu.stores.opening import opened_consolidated
    from xinsitu.stores.redact import masked_url

    paths = _paths(args.url)
    kinds = {p: file_kind(p) for p in paths}
    kind = next(iter(set(kinds.values()))) if len(set(kinds.values())) == 1 else None
    args.in_place = kind is not None
    if kind is not None:
        name = _OPENERS[kind]
        arg = masked_url(paths[0]) if len(paths) == 1 else [masked_url(p) for p in paths]
        args.code = f"ds = {name}({arg!r}{_options_code(args.options)})"
        import xinsitu.virtual

        if kind == "grib":
            if args.group:
                raise TypeError("--group applies to Zarr archives and NetCDF files, not to GRIB files")
            return xinsitu.virtual.open_grib(paths, **dict(args.options))
        return xinsitu.virtual.open_netcdf(paths, group=args.group, **dict(args.options))
    if len(paths) > 1:
        named = ", ".join(repr(masked_url(p)) for p in paths[:3])
        raise ValueError(f"several paths given ({named}{', ...' if len(paths) > 3 else ''})"
                         f" but they are not all NetCDF or all GRIB files ({_kinds_text(kinds)}): give one Zarr "
                         "archive, or NetCDF or GRIB files")
    url = paths[0]
    if "://" not in url and os.path.isfile(url):
        raise ValueError(f"{url!r} is a file, not a Zarr archive, and not a NetCDF (classic or NetCDF4/HDF5) or "
                         "GRIB file by its first bytes: open NetCDF files with xinsitu.virtual.open_netcdf(paths), "
                         "GRIB files with xinsitu.virtual.open_grib(paths), a Zarr archive (a directory) with "
                         "xinsitu.open_zarr(path)")
    args.code = (f"ds = xinsitu.open_zarr({masked_url(url)!r}" + ("" if args.consolidated is None else
                                                       f", consolidated={args.consolidated}")
                 + _options_code(args.options) + ")")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ds = xinsitu.open_zarr(url, group=args.group, consolidated=args.consolidated, **dict(args.options))
    for w in said:  # xarray's long advice on consolidated metadata, were it given, is the line below
        if CONSOLIDATED_WARNING not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if args.consolidated is None and opened_consolidated(ds) is False:  # one line that names the option
        print(f"xinsitu {args.command}: note: no consolidated metadata (the open read each array's metadata); "
              "--consolidated false skips looking for it, zarr.consolidate_metadata(store) writes it",
              file=sys.stderr)
    return ds


def _options_code(options: list[tuple[str, Any]]) -> str:
    """The store options of ``-o``, as keyword arguments of the line that opens the archive; a credential
    as ``'...'``, at any depth (``client_options={'default_headers': {'Authorization': '...'}}``), and a
    URL's password and query string too (the line is printed: it never holds one)."""
    from xinsitu.stores.redact import masked, secrets_in_options

    secrets = secrets_in_options("", dict(options))
    return "".join(f", {k}={masked(v, secrets)!r}" for k, v in options)


def _kinds_text(kinds: dict[str, str | None]) -> str:
    return ", ".join(f"{os.path.basename(urlsplit(p).path if '://' in p else p)}: {k or 'neither'}"
                     for p, k in list(kinds.items())[:4])


# ----------------------------------------------------------------------------- split
def split_dim(geometry: Any) -> str | None:
    """The dim a split goes on by default: the first dim, in the order of the largest
    variable's dims, that is chunked into at least two chunk blocks (None if none is).

    Parameters
    ----------
    geometry : Geometry

    Returns
    -------
    str or None
    """
    order: list[str] = []
    for g in sorted(geometry.variables.values(), key=lambda g: -int(np.prod(g.shape, dtype=np.float64))):
        order += [d for d in g.dims if d not in order]
    return next((d for d in order if geometry.nblocks(d) >= 2), None)


def suggest_split(ds: Any, dim: str | None = None, fractions: dict[str, float] | None = None,
                  gap: int | None = None) -> tuple[Any, str]:
    """A chunk-aligned split to start from, and a note on how it was chosen.

    80/10/10 train/val/test on ``dim`` (default: :func:`split_dim`) with a gap of one
    chunk block; on a dim with too few chunk blocks, without the gap, then train/val 80/20,
    then 50/50 (two chunk blocks: one each).

    Parameters
    ----------
    ds : xr.Dataset
    dim : str, optional
    fractions : dict, optional
        ``{split: fraction}``; given fractions and gap are used as they are.
    gap : int, optional

    Returns
    -------
    (SplitManifest, str)
        The manifest and the Python line that makes it.

    Raises
    ------
    ValueError
        If no dim is chunked into two or more chunk blocks, or the split is impossible.
    """
    g = ds.insitu.geometry
    if dim is None:
        dim = split_dim(g)
        if dim is None:
            raise ValueError("no dim is chunked into two or more chunks, so there is nothing to split on: "
                             "re-chunk the archive along the dim to split (e.g. time)")
    tries = [(fractions or DEFAULT_FRACTIONS, 1 if gap is None else gap)]
    if fractions is None and gap is None:
        tries += [(DEFAULT_FRACTIONS, 0), ({"train": 0.8, "val": 0.2}, 0), ({"train": 0.5, "val": 0.5}, 0)]
    err: ValueError | None = None
    for fr, gp in tries:
        try:
            m = ds.insitu.split(dim, fractions=fr, gap=gp)
        except ValueError as e:
            err = e
            continue
        code = f"m = ds.insitu.split({dim!r}, fractions={fr!r}, gap={gp})"
        return m, code
    assert err is not None
    raise err


# ----------------------------------------------------------------------------- inspect
def _geometry_dict(g: Any) -> dict[str, Any]:
    return {
        "dims": {d: {"length": g.sizes[d], "chunk": c if isinstance(c, int) else list(c), "blocks": g.nblocks(d)}
                 for d, c in g.dims.items()},
        "variables": {n: {"dims": list(v.dims), "shape": list(v.shape), "chunks": list(v.chunks),
                          "shards": list(v.shards) if v.shards else None, "dtype": v.dtype, "codecs": list(v.codecs),
                          "chunk_nbytes": v.chunk_nbytes, "nchunks": v.nchunks}
                      for n, v in g.variables.items()},
    }


#: codecs that carry a checksum of the chunk (zarr v3 ``crc32c``; numcodecs' ``crc32``, ``adler32``...)
_CHECKSUMS = ("crc32c", "crc32", "adler32", "fletcher32")


def checksums(ds: Any) -> dict[str, str | None]:
    """Per data variable, the checksum codec its stored chunks carry (None: none).

    Parameters
    ----------
    ds : xr.Dataset

    Returns
    -------
    dict of str to str or None
    """
    out: dict[str, str | None] = {}
    for name, v in ds.insitu.geometry.variables.items():
        names = [str(c).lower() for c in v.codecs]
        enc = ds[name].encoding if name in ds else {}
        for key in ("compressors", "filters", "serializer", "codecs"):  # inner codecs of a shard too
            for c in np.atleast_1d(np.asarray(enc.get(key) or [], dtype=object)):
                cfg = c.to_dict() if hasattr(c, "to_dict") else getattr(c, "get_config", lambda: {})()
                names.append(json.dumps(cfg, default=str).lower())
        out[name] = next((k for k in _CHECKSUMS if any(k in n for n in names)), None)
    return out


def checksum_note(found: dict[str, str | None], in_place: bool = False) -> str:
    """One paragraph: whether a transfer that corrupts a chunk can be detected.

    ``in_place``: GRIB or NetCDF files read as they are, which no codec can be added to (no advice
    to write the archive again)."""
    without = sorted(n for n, c in found.items() if c is None)
    if not found:
        return "Checksums: no data variable."
    if not without:
        kinds = ", ".join(sorted({c for c in found.values() if c}))
        return (f"Checksums: every variable's chunks carry one ({kinds}): a chunk corrupted in transit is "
                "detected, fetched again, and raises if it never matches.")
    if in_place:
        return (f"Checksums: none on {', '.join(without)} (files read in place, as they are): a chunk corrupted "
                "in transit (a flipped bit) cannot be detected.")
    return (f"Checksums: none on {', '.join(without)}. A chunk corrupted in transit (a flipped bit) cannot be "
            "detected and may decode into wrong values; write the archive with a crc32c codec "
            "(zarr v3: compressors=[zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec()]).")


def cmd_inspect(args: argparse.Namespace) -> int:
    """``xinsitu inspect URL``: geometry, whether chunks carry checksums, and a suggested split."""
    ds = _open(args)
    g = ds.insitu.geometry
    found = checksums(ds)
    note = checksum_note(found, in_place=args.in_place)
    try:
        m, code = suggest_split(ds, args.dim, args.fractions, args.gap)
        problem = None
    except ValueError as e:
        if args.dim is not None or args.fractions is not None or args.gap is not None:
            raise  # the split asked for cannot be made: an error (exit 1), not "no split suggested"
        m, code, problem = None, None, str(e)
    if args.json:
        print(json.dumps({"geometry": _geometry_dict(g), "checksums": found, "checksum_note": note,
                          "split": m.to_dict() if m else None, "code": code, "problem": problem}, indent=1))
        return 0
    print(repr(g))
    print()
    print(note)
    print()
    if m is None:
        print(f"No split suggested: {problem}")
        return 0
    print("Suggested split:")
    print(m.summary())
    print()
    print("In Python:")
    print("    import xinsitu")
    print(f"    {args.code}")
    print(f"    {code}")
    return 0


# ----------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    """``xinsitu bench URL``: raw fetch pass, then the loader over the same chunk blocks."""
    from xinsitu.cli_bench import raw_keys, raw_pass, verdict
    from xinsitu.index.runs import Blocks
    from xinsitu.index.split import SplitManifest
    from xinsitu.io.inflight import AUTO_INFLIGHT

    ds = _open(args)
    if args.manifest:
        m = SplitManifest.from_json(args.manifest)
        code = f"m = SplitManifest.from_json({args.manifest!r})"
    else:
        m, code = suggest_split(ds, args.dim, args.fractions, args.gap)
    blocks = m.blocks(args.split)
    if args.max_blocks and len(blocks) > args.max_blocks:
        m = dataclasses.replace(m, splits={**m.splits, args.split: Blocks.from_ids(blocks[:args.max_blocks])})
    used = len(m.splits[args.split])
    variables = args.variables.split(",") if args.variables else None
    gen = ds.insitu.batches(m, args.split, batch_size=args.batch_size, shuffle=True, seed=0, output="numpy",
                            variables=variables, block_chunks=args.block_chunks, max_inflight=args.max_inflight,
                            rank=0, world_size=1)  # one process measures the store (and torch isn't imported)
    stored = any(s.stored for s in gen.sources.values())
    if not args.json:
        print(f"split {args.split!r}: {used} of {len(blocks)} chunk blocks ({code})")
        print(f"variables: {', '.join(gen.sources)}")
    raw = None
    if stored:
        keys = raw_keys(gen)
        raw = raw_pass(keys, args.max_inflight or AUTO_INFLIGHT[1])
        if not args.json:
            print(f"raw pass   : {raw['objects']} objects, {_repr.fmt_bytes(raw['bytes'])} fetched in "
                  f"{raw['seconds']:.2f} s = {raw['mb_per_s']:.1f} MB/s, {raw['requests_per_s']:.0f} requests/s"
                  + (f" ({raw['missing']} missing: fill value)" if raw["missing"] else ""))
    n = 0
    t0 = time.perf_counter()
    for batch in gen:
        n += 1
        del batch
    wall = time.perf_counter() - t0
    io = gen.io_stats
    batches_per_s = io["batches"] / io["seconds"] if io["seconds"] > 0 else 0.0
    lines = verdict(raw, io, args.batch_size, args.step_ms)
    if args.json:
        print(json.dumps({"split": args.split, "blocks": used, "blocks_in_split": len(blocks),
                          "variables": list(gen.sources), "batch_size": args.batch_size, "raw": raw,
                          "loader": {**io, "batches_per_s": batches_per_s, "wall_s": wall}, "verdict": lines},
                         indent=1, default=float))
        return 0
    print(f"loader     : {io['chunks']} chunks read once each, {_repr.fmt_bytes(io['bytes_read'])} stored -> "
          f"{_repr.fmt_bytes(io['bytes_decoded'])} decoded in {io['seconds']:.2f} s = {io['mb_per_s']:.1f} MB/s "
          f"decoded")
    print(f"             {io['samples_per_s']:.0f} samples/s = {batches_per_s:.1f} batches/s of {args.batch_size}; "
          f"the caller waited {io['wait_s']:.2f} s for data")
    print()
    for line in lines:
        print(line)
    return 0


# ----------------------------------------------------------------------------- doctor
DOCTOR_PACKAGES = ("zarr", "numpy", "xarray", "obstore", "numcodecs", "virtualizarr", "icechunk", "torch", "jax",
                   "cupy")


def _installed(name: str) -> str | None:
    """The installed version of distribution ``name`` (cupy under any of its wheel names), without importing it."""
    from importlib import metadata

    names = [name] if name != "cupy" else ["cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x"]
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cuda() -> str:
    """CUDA as torch sees it (the only GPU stack imported here), else what the machine says."""
    import shutil

    if _installed("torch") is not None:
        try:
            import torch

            if torch.version.cuda is None:
                return "none (CPU build of torch)"
            return f"{torch.version.cuda} ({'available' if torch.cuda.is_available() else 'no GPU visible'})"
        except Exception as e:  # noqa: BLE001 - a broken install is what doctor is for
            return f"torch failed to import: {type(e).__name__}: {e}"
    return "nvidia-smi found, no torch" if shutil.which("nvidia-smi") else "none"


def doctor() -> dict[str, str]:
    """What ``python -m xinsitu doctor`` reports: versions ("-" where not installed), CUDA and the decode path."""
    import platform

    from xinsitu.codecs.cpu import decode_path
    from xinsitu.codecs.gpu import gpu_status

    out = {"python": f"{platform.python_version()} ({platform.system()} {platform.machine()})",
           "xinsitu": __version__}
    for name in DOCTOR_PACKAGES:
        out[name] = _installed(name) or "-"
    out["cuda"] = _cuda()
    out["decode"] = decode_path()
    out["gpu decode"] = gpu_status()
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    info = doctor()
    if args.json:
        print(json.dumps(info))
    else:
        print(" | ".join(f"{k} {v}" for k, v in info.items()))
    return 0
