"""``RegionPlans.whole_chunks``: the vectorised ``whole_chunk`` of the one-sample-per-chunk path
(``DirectLoader``) agrees with it region by region (hypothesis), over selections that start anywhere,
chunks of any length and positions inside and outside the selection."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from xinsitu.index.regions import RegionPlans
from xinsitu.index.source import VarSource


@st.composite
def cases(draw):
    nt = draw(st.integers(1, 12))  # the split dim's selected length
    t0 = draw(st.integers(0, 5))  # where the selection starts in the stored array
    ct = draw(st.sampled_from([1, 1, 1, 2, 3]))  # the chunk length along it (1: one sample per chunk)
    nx = draw(st.integers(1, 6))
    x0 = draw(st.integers(0, 3))
    cx = draw(st.sampled_from([nx, nx + x0, 2, 3]))  # whole along x only where the selection is a chunk
    pos = draw(st.lists(st.integers(-1, nt), min_size=1, max_size=8))
    return nt, t0, ct, nx, x0, cx, pos


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_whole_chunks_is_whole_chunk_of_each_region(case):
    nt, t0, ct, nx, x0, cx, pos = case
    src = VarSource(name="v", dims=("time", "x"), shape=(nt, nx), dtype=np.dtype("f4"), raw_dtype=np.dtype("f4"),
                    array=object(), src_dims=("time", "x"),
                    index=(np.arange(t0, t0 + nt, dtype=np.int64), np.arange(x0, x0 + nx, dtype=np.int64)),
                    chunk_shape=(ct, cx))
    plans = RegionPlans(lambda a: False)
    one = [plans.whole_chunk(src, {"time": (p, p + 1)}) for p in pos]
    got = plans.whole_chunks(src, {"time": np.array(pos, dtype=np.int64)})
    if any(c is None for c in one):
        assert got is None
    else:
        assert got is not None and got.dtype == np.int64
        assert list(map(tuple, got.tolist())) == one
