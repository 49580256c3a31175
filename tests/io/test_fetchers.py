"""``xinsitu.io.fetchers``: the read strategies. A shard's index is fetched once per reader (kept, a few
bytes per inner chunk), however many of its inner chunks the epochs read."""

from __future__ import annotations

import collections

import numpy as np

import xinsitu
from xinsitu.codecs.cpu import ShardLayout
from xinsitu.synthetic import write_era5_like


def test_a_shards_index_is_fetched_once(tmp_path, monkeypatch):
    path = str(tmp_path / "sharded.zarr")
    src = write_era5_like(path, nt=64, ny=4, nx=6, chunk_time=4, shard_time=16)  # 4 inner chunks a shard
    decoded: collections.Counter[int] = collections.Counter()
    real = ShardLayout.index

    async def counting(self, raw):
        decoded[id(self)] += 1
        return await real(self, raw)

    monkeypatch.setattr(ShardLayout, "index", counting)
    ds = xinsitu.open_zarr(path)
    m = ds.insitu.split("time", fractions={"train": 0.75, "val": 0.25})
    gen = ds.insitu.batches(m, "train", batch_size=5, block_chunks=2, output="numpy", variables=["t2m", "u10"])
    for epoch in range(2):
        gen.set_epoch(epoch)
        n = 0
        for b, ids in zip(gen, gen.batch_ids(), strict=True):
            assert np.array_equal(b["t2m"], src.t2m.values[ids])
            n += len(ids)
        assert n == 48
    # 48 train steps = 3 shards of each of 2 variables, read as 12 inner chunks each over two epochs
    assert sum(decoded.values()) == 3 * 2


def test_all_or_none_stops_the_others_before_it_raises():
    """One read fails: the others are cancelled, and have stopped, when the error reaches the caller (a
    sibling cannot write into a destination after its read has been given up)."""
    import asyncio

    import pytest

    from xinsitu.io.fetchers import all_or_none

    stopped: list[str] = []

    async def slow(name: str) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.05)  # cleaning up takes a while
            stopped.append(name)

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise OSError("boom")

    async def main() -> list[str]:
        with pytest.raises(OSError, match="boom"):
            await all_or_none([slow("a"), fails(), slow("b")])
        return list(stopped)

    assert sorted(asyncio.run(main())) == ["a", "b"]
