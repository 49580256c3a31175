"""The GPU path's objects freed in a safe order (issue "GPU decode that pays": the last real-GPU run
crashed at garbage collection). nvCOMP's codecs hold their CUDA stream's raw handle: a stream freed
before the codecs that borrow it crashes the process when they are freed. Streams (one per device and
decode thread) and codecs (one per thread, stream and compressor) therefore live for the process
(``nvcomp.LIFETIMES``), and at exit the codecs are freed first. The stand-in models the rule --
its codecs hold only a stream handle, and one freed after its stream is recorded -- so CI checks it
with generators collected mid-epoch and a process exiting mid-epoch; the ``gpu`` variant runs the same
on a real device."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import xinsitu
from tests.support.gpu import CUDA
from xinsitu.codecs import nvcomp
from xinsitu.codecs.gpu import StandInGpu
from xinsitu.codecs.gpu_chain import gpu_chain
from xinsitu.codecs.nvcomp import LIFETIME_ERRORS, LIFETIMES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def borrowed_from_freed_streams() -> list[tuple[int, int, str]]:
    """Codecs of the stand-in whose stream (by handle) was freed: what would crash nvCOMP."""
    live = nvcomp._LIVE_STREAMS
    return [k for k, c in LIFETIMES.codecs.items()
            if isinstance(c, nvcomp.StandInCodec) and c.stream not in live]


@pytest.mark.slow
def test_generators_collected_mid_epoch_leave_no_codec_without_its_stream(era5_path):
    ds = xinsitu.open_zarr(era5_path)
    m = ds.insitu.split("time", fractions={"train": 0.8, "val": 0.2})
    errors = len(LIFETIME_ERRORS)
    for split in ("train", "val", "train"):
        gen = ds.insitu.batches(m, split, batch_size=4, block_chunks=2, output="numpy", stack=True,
                                variables=["t2m", "tp"])
        gen._use_gpu(StandInGpu(), {n: gpu_chain(lay.src.array) for n, lay in gen.layouts.items()})
        it = iter(gen)
        next(it)
        next(it)  # mid-epoch: buffers read ahead, decodes under way
        del it, gen
        gc.collect()
    assert any(isinstance(c, nvcomp.StandInCodec) for c in LIFETIMES.codecs.values())  # (exercised)
    assert borrowed_from_freed_streams() == []
    assert LIFETIME_ERRORS[errors:] == []


SCRIPT = """
import atexit
import sys


@atexit.register  # first registered: runs last, after xinsitu's own exit hooks
def freed():
    from xinsitu.codecs.nvcomp import _LIVE_STREAMS, LIFETIME_ERRORS, LIFETIMES
    print(f"at exit: codecs {{len(LIFETIMES.codecs)}}, streams {{len(LIFETIMES.streams)}}, "
          f"stand-in streams alive {{len(_LIVE_STREAMS)}}, out of order {{len(LIFETIME_ERRORS)}}", flush=True)


import xinsitu
ds = xinsitu.open_zarr(sys.argv[1])
m = ds.insitu.split("time", fractions={{"train": 0.8, "val": 0.2}})
kw = dict(batch_size=4, block_chunks=2, stack=True, variables=["t2m", "tp"])
{make}
it = iter(gen)
next(it)  # the process ends mid-epoch: buffers read ahead, decodes under way, nothing closed
print("mid-epoch", flush=True)
"""


def _run(script: str, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", script, path], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.slow
def test_a_process_exiting_mid_epoch_frees_codecs_before_their_streams(era5_path):
    make = textwrap.dedent("""
        from xinsitu.codecs.gpu import StandInGpu
        from xinsitu.codecs.gpu_chain import gpu_chain
        gen = ds.insitu.batches(m, "train", output="numpy", **kw)
        gen._use_gpu(StandInGpu(), {n: gpu_chain(lay.src.array) for n, lay in gen.layouts.items()})
    """)
    r = _run(SCRIPT.format(make=make), era5_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mid-epoch" in r.stdout and "freed after its stream" not in r.stderr, r.stderr[-3000:]
    # every codec freed at exit, then every stream, none out of order
    assert "at exit: codecs 0, streams 0, stand-in streams alive 0, out of order 0" in r.stdout, r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_real_gpu_no_crash_at_garbage_collection_or_exit(era5_path):
    """On a real device: generators decoding with nvCOMP collected mid-epoch, then a process exiting
    mid-epoch -- no crash (a freed stream under a live codec segfaults: a negative return code)."""
    pytest.importorskip("cupy")
    try:
        nvcomp.gpu_modules()
    except RuntimeError as e:
        pytest.skip(str(e))
    make = textwrap.dedent("""
        import gc
        for split in ("val", "train"):
            g = ds.insitu.batches(m, split, output="cupy", decode="gpu", **kw)
            i = iter(g)
            next(i)
            del i, g
            gc.collect()
        gen = ds.insitu.batches(m, "train", output="torch", device="cuda", decode="gpu", **kw)
    """)
    r = _run(SCRIPT.format(make=make), era5_path)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "mid-epoch" in r.stdout and "at exit: codecs 0, streams 0" in r.stdout, r.stdout
