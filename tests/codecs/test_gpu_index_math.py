"""Index math of the GPU paths, as hypothesis properties: the packing of a buffer's compressed chunks
into one page-locked staging for one transfer (offsets aligned, disjoint, exact, whatever fits and
whatever is kept aside) and the staging ring of device copies
(slots in order, every value intact whatever the caller's lag). Apart from the GPU tests' own files,
so that those run on a GPU machine without hypothesis."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from xinsitu.batches.device_copy import DeviceMover, StandInDevice
from xinsitu.codecs.staging import ALIGN, PinnedRing, Staging


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=80), min_size=1, max_size=12), st.integers(0, 400))
def test_packed_spans_aligned_disjoint_and_exact(parts, capacity):
    staging = Staging(PinnedRing(lambda n: np.zeros(n, dtype=np.uint8)), capacity)
    offs = [staging.put(memoryview(p)) for p in parts]
    host, moved = staging.finish()
    offs = [moved[-o - 1] if o < 0 else o for o in offs]  # those kept aside, packed behind the rest
    spans = sorted(zip(offs, map(len, parts), strict=True))
    assert all(off % ALIGN == 0 for off in offs)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))  # disjoint
    assert max(o + len(p) for o, p in zip(offs, parts, strict=True)) <= staging.used <= host.nbytes
    assert all(bytes(host[o:o + len(p)]) == p for o, p in zip(offs, parts, strict=True))


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(2, 5), sizes=st.lists(st.integers(0, 50), min_size=1, max_size=15),
       lag=st.integers(0, 6))
def test_ring_property_values_intact_whatever_the_caller_lag(slots, sizes, lag):
    """Batches of any sizes, handed out ``lag`` batches late: slots go round in order, every value
    arrives intact, and pinned buffers are only allocated for a slot's first use or growth."""
    dev = StandInDevice()
    mover = DeviceMover(dev, slots=slots)
    srcs = [np.arange(n, dtype="f8") + 1000 * i for i, n in enumerate(sizes)]
    moved, out = [], []
    for s in srcs:
        moved.append(mover.move({"x": s}))
        if len(moved) > lag:
            out.append(mover.hand_out(moved[len(out)]))
    while len(out) < len(moved):
        out.append(mover.hand_out(moved[len(out)]))
    assert mover.stats.slot_of == [i % slots for i in range(len(srcs))][-64:]
    assert all(np.array_equal(o["x"], s) for o, s in zip(out, srcs, strict=True))
    assert dev.pinned_allocs <= len(srcs)
