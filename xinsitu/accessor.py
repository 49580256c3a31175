"""``ds.insitu``: a thin front door. It keeps only the Dataset; every method validates
its arguments and calls a plain function or class that knows nothing of accessors."""

from __future__ import annotations

from typing import Any

import xarray as xr

from xinsitu.geometry import Geometry, geometry_of
from xinsitu.source import resolve
from xinsitu.split import SplitManifest, make_split


@xr.register_dataset_accessor("insitu")
class InsituAccessor:
    """Train in place from this Dataset: ``geometry``, ``chunks``, ``split``, ``batches``."""

    def __init__(self, ds: xr.Dataset):
        self._ds = ds
        self._geometry: tuple[list[Any], Geometry] | None = None

    @property
    def geometry(self) -> Geometry:
        """Chunk geometry of the data variables, from metadata alone.

        Computed once per Dataset (xarray keeps one accessor per Dataset object), again only
        when its data variables change (added, replaced, loaded in place).
        """
        key = [(k, v, v._data) for k, v in ((k, self._ds.variables[k]) for k in self._ds.data_vars)]
        cached = self._geometry
        if cached is None or len(cached[0]) != len(key) or any(
                a[0] != b[0] or a[1] is not b[1] or a[2] is not b[2] for a, b in zip(cached[0], key, strict=True)):
            self._geometry = cached = (key, geometry_of(resolve(self._ds)))
        return cached[1]

    @property
    def chunks(self) -> dict[str, int | tuple[int, ...]]:
        """``{dim: chunk size}`` over the data variables (a tuple where sizes differ)."""
        return dict(self.geometry.dims)

    def split(self, dim: str | list[str], *, fractions: dict[str, float] | None = None,
              ranges: dict[str, slice] | None = None, gap: int = 0, contiguous: bool | None = None,
              seed: int | None = 0) -> SplitManifest:
        """Split along ``dim`` (or several dims) on the chunk grid.

        Parameters
        ----------
        dim : str or list of str
            The dim(s) to split; every chunk (chunk block, for several dims) goes to exactly
            one split.
        fractions : dict of str to float, optional
            ``{name: fraction}`` summing to 1, applied to the whole chunks left after gaps.
        ranges : dict of str to slice, optional
            ``{name: slice(start_label, stop_label)}`` (``.sel`` semantics), rounded inward to
            chunk edges. Give exactly one of ``fractions`` and ``ranges``.
        gap : int, default 0
            Chunks left out between splits (embargo).
        contiguous : bool, optional
            One run per split in split order (default for one dim), or chunks assigned at
            random by fraction (default for several dims).
        seed : int, default 0
            Seed of the random assignment.

        Returns
        -------
        SplitManifest
        """
        return make_split(self._ds, self.geometry, dim, fractions=fractions, ranges=ranges, gap=gap,
                          contiguous=contiguous, seed=seed)

    def batches(self, manifest: SplitManifest, split: str, **kwargs: Any) -> Any:
        """Batches of one split, read in place.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split` (or ``SplitManifest.from_json``).
        split : str
            Name of the split to draw from.
        **kwargs
            ``batch_size=32, shuffle=True, seed=0, window=None, patch=None, stride=None,
            over=None, variables=None, output="xarray", stack=False, normalize=None,
            device=None, block_chunks=16, max_inflight=None, drop_last=False, rank=None,
            world_size=None, progress=False``; see :class:`xinsitu.BatchGenerator`.

        Returns
        -------
        BatchGenerator
        """
        from xinsitu.loader import BatchGenerator

        return BatchGenerator(self._ds, manifest, split, **kwargs)

    def stats(self, manifest: SplitManifest, split: str = "train", *, variables: list[str] | None = None,
              block_chunks: int = 16, max_inflight: int | None = None) -> dict[str, Any]:
        """Normalisation statistics of ``split``, from one streaming pass over its chunks.

        Per channel (as ``gen.channels`` names them for the same variables): mean, std (ddof=0),
        min, max, nan_count (and count) of the CF-decoded values, in float64; a list in label order
        for a variable with an extra dim. Only ``split``'s chunks are read, each once. The result is
        plain JSON-able data, also stored as ``manifest.stats`` (saved by ``manifest.to_json``);
        pass it as ``normalize=`` to ``batches`` for ``(x - mean) / std`` per channel.

        Parameters
        ----------
        manifest : a ``SplitManifest`` from ``ds.insitu.split``.
        split : the split to reduce (default ``"train"``).
        variables : variables to reduce (default: the data variables on the split dims, as for batches).
        block_chunks : units (chunk blocks) read ahead: at least 3 × ``block_chunks``.
        max_inflight : chunk reads in flight at once.
        """
        from xinsitu.stats import compute_stats

        st = compute_stats(self._ds, manifest, split, variables, block_chunks=block_chunks,
                           max_inflight=max_inflight)
        manifest.stats = st
        return st

    def sample(self, manifest: SplitManifest, split: str, i: int, **kwargs: Any) -> xr.Dataset:
        """Sample ``i`` of ``split`` (unshuffled order) as a labeled Dataset; ``kwargs`` as for
        ``batches`` (``window=``, ``patch=``, ``variables=``...)."""
        from xinsitu.loader import BatchGenerator

        return BatchGenerator(self._ds, manifest, split, **kwargs).sample(i)
