"""``ds.insitu``: a thin front door. It keeps only the Dataset; every method validates
its arguments and calls a plain function or class that knows nothing of accessors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import xarray as xr

from xinsitu.batches.generator import BatchGenerator
from xinsitu.cache.chunk_cache import ChunkCache
from xinsitu.index.geometry import Geometry, dataset_geometry
from xinsitu.index.manifest import SplitManifest
from xinsitu.index.split import make_split
from xinsitu.stores.opening import lists_in_fixed_order

if TYPE_CHECKING:
    from distributed import Client

    from xinsitu.batches.mapstyle import InsituDataset


def listed_unordered(ds: xr.Dataset) -> bool:
    """Whether ``ds``'s data variables may be in the order a Zarr store listed its arrays without
    consolidated metadata (an order that changes from process to process; every Icechunk repository).

    A Dataset that still holds the xarray Zarr backend that opened it (``xr.open_zarr``,
    ``xr.open_dataset(engine="zarr")``, ``xinsitu.open_zarr``, and what ``isel``/``sel`` make of them)
    says so itself: whether that backend read the group without consolidated metadata. One that no
    longer holds it (``copy``, ``rename``, ``drop_vars``, ``assign_attrs``, ``ds[[...]]`` drop it, and
    keep the listed order) is asked of its variables' stored arrays: whether a group they are in lacks
    consolidated metadata (``lists_in_fixed_order``: one metadata read per group). In-memory variables,
    and files read through dask, have no listing: their order is the user's, kept.
    """
    backend = getattr(getattr(ds, "_close", None), "__self__", None)
    if type(backend).__name__ == "ZarrStore":
        meta = getattr(getattr(backend, "zarr_group", None), "metadata", None)
        return meta is not None and getattr(meta, "consolidated_metadata", False) is None
    try:
        sources, _ = dataset_geometry(ds)
    except (ValueError, TypeError):  # a Dataset the accessor refuses: its methods say why
        return False
    arrays = {id(s.array): s.array for s in sources.values() if s.array is not None}  # (one ask per array)
    return any(not lists_in_fixed_order(a) for a in arrays.values())


@xr.register_dataarray_accessor("insitu")
class _ArrayAccessor:
    """``da.insitu``: the accessor works on a Dataset; every attribute says so (not xarray's bare error)."""

    def __init__(self, da: xr.DataArray):
        self._name = da.name

    def __getattr__(self, attr: str) -> Any:
        name = "name" if self._name is None else repr(self._name)
        raise AttributeError(f"'.insitu.{attr}' works on a Dataset, not a DataArray: use ds[[{name}]].insitu, or "
                             f"ds.insitu with variables=[{name}]")


@xr.register_dataset_accessor("insitu")
class InsituAccessor:
    """Train in place from this Dataset: ``geometry``, ``chunks``, ``split``, ``batches``."""

    def __init__(self, ds: xr.Dataset):
        self._ds = ds

    @property
    def geometry(self) -> Geometry:
        """Chunk geometry of the data variables, from metadata alone.

        Computed once per Dataset, again only when its data variables change (added, replaced,
        loaded in place); ``batches``, ``stats`` and ``validity`` share it (``geometry.dataset_geometry``).
        """
        return dataset_geometry(self._ds)[1]

    def _variables(self, manifest: Any, variables: str | list[str] | None) -> str | list[str] | None:
        """``variables=``, or where it is not given and the Dataset's variable order is a store's listing
        without consolidated metadata (``listed_unordered``), the default variables sorted by name
        (SPEC §1: the channel order must not change from run to run)."""
        if variables is not None or not isinstance(manifest, SplitManifest) or not listed_unordered(self._ds):
            return variables
        dims = set(manifest.dims)
        names = [v for v in sorted(self._ds.data_vars, key=str) if dims & set(self._ds[v].dims)]
        return cast(list[str], names) or None

    @property
    def chunks(self) -> dict[str, int | tuple[int, ...]]:
        """``{dim: chunk size}`` over the data variables (a tuple where sizes differ)."""
        return dict(self.geometry.dims)

    def split(self, dim: str | list[str], *, fractions: dict[str, float] | None = None,
              ranges: dict[str, slice] | None = None, gap: int = 0, contiguous: bool | None = None,
              seed: int | None = 0, block: dict[str, int] | None = None) -> SplitManifest:
        """Split along ``dim`` (or several dims) on the chunk grid, or on blocks of positions (``block=``).

        Parameters
        ----------
        dim : str or list of str
            The dim(s) to split; every chunk (chunk block, for several dims) goes to exactly
            one split. A dim held in a single chunk needs ``block=`` (or, for files holding one
            step each, ``concat_dim=`` of ``xinsitu.virtual.open_netcdf``/``open_grib``), except
            for one split (``fractions={"train": 1.0}``); so does a selection that reorders it so
            that one stored chunk appears in two places (``sortby`` after re-centring longitudes,
            ``roll``), else ``ValueError`` naming the stored chunk.
        fractions : dict of str to float, optional
            ``{name: fraction}`` summing to 1 (any real numbers, numpy scalars included),
            applied to the whole chunks (blocks) left after gaps.
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
        block : dict of str to int, optional
            ``{dim: n}``: along ``dim`` the split blocks are runs of ``n`` positions instead of
            whole chunks (e.g. a spatial hold-out on GRIB or NetCDF files whose fields are one
            chunk each). Every block belongs to one split and every sample to the split of its
            blocks (a window or tile touching another split's block or a gap is left out), so a
            chunk may be read by several splits, a sample never. ``fractions``, ``gap``,
            ``contiguous``, ``seed`` and ``ranges`` then count blocks.

        Returns
        -------
        SplitManifest

        Examples
        --------
        >>> m = ds.insitu.split(["latitude", "longitude"], fractions={"train": .8, "val": .2},
        ...                     contiguous=False, block={"latitude": 8, "longitude": 8})  # doctest: +SKIP
        """
        if not (isinstance(dim, str) or (isinstance(dim, (list, tuple)) and dim
                                         and all(isinstance(d, str) for d in dim))):
            raise TypeError(f"dim must be a dim name or a list of names, got {type(dim).__name__} {dim!r}")
        if fractions is not None and not isinstance(fractions, dict):
            raise TypeError(f"fractions must be a dict of split name -> fraction, got {type(fractions).__name__}")
        if ranges is not None and not isinstance(ranges, dict):
            raise TypeError(f"ranges must be a dict of split name -> slice, got {type(ranges).__name__}")
        if not isinstance(gap, (int, np.integer)) or isinstance(gap, (bool, np.bool_)):
            raise TypeError(f"gap must be a whole number of chunks, got {type(gap).__name__} {gap!r}")
        if contiguous is not None and not isinstance(contiguous, (bool, np.bool_)):
            raise TypeError(f"contiguous must be True, False or None, got {type(contiguous).__name__} {contiguous!r}")
        if seed is not None:
            if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)):
                raise TypeError(f"seed must be an integer or None, got {type(seed).__name__} {seed!r}")
            if seed < 0:
                raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        return make_split(self._ds, self.geometry, dim, fractions=fractions, ranges=ranges, gap=gap,
                          contiguous=contiguous, seed=seed, block=block)

    def batches(self, manifest: SplitManifest, split: str | None = None, *, batch_size: int = 32, shuffle: bool = True,
                seed: int = 0, window: dict[str, int] | None = None, patch: dict[str, int] | None = None,
                stride: dict[str, int] | None = None, over: str | list[str] | None = None,
                variables: str | list[str] | None = None, output: str = "xarray", stack: bool | list[str] = False,
                dtype: Any = None, normalize: dict[str, Any] | None = None, device: Any = None,
                block_chunks: int | None = None, max_inflight: int | None = None, drop_last: bool = False,
                rank: int | None = None, world_size: int | None = None, progress: bool = False,
                missing: str = "fill", cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
                transform: Callable[[Any], Any] | None = None, decode: str = "auto") -> BatchGenerator:
        """Batches of one split, read in place.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split` (or ``SplitManifest.from_json``).
        split : str
            Name of the split to draw from.
        batch_size : int, default 32
            Samples per batch.
        shuffle : bool, default True
            Permute the chunk blocks per ``(seed, epoch)`` and draw from a buffer of ``block_chunks``
            blocks at random; False walks in split order.
        seed : int, default 0
            Seed of the shuffle (a non-negative integer).
        window : dict of str to int, optional
            ``{dim: k}``: each sample carries ``k`` consecutive positions.
        patch : dict of str to int, optional
            ``{dim: size}``: tiles (xbatcher's ``input_dims``).
        stride : dict of str to int, optional
            Tile stride per patch dim (default: the patch size).
        over : str or list of str, optional
            More dims whose positions are samples.
        variables : str or list of str, optional
            Default: the data variables on the split dim(s); their order is the channel order.
        output : {"xarray", "dataarray", "numpy", "torch", "cupy", "jax"}, default "xarray"
        stack : bool or list of str, default False
            One array per batch with the variables as channels (see ``BatchGenerator.channels``);
            a dim the other variables lack becomes one channel per label, ``{var}_{label}``: with
            ``variables=["z", "t2m", "u", "v"]`` (levels beside a surface field) ``stack=True``
            gives the usual weather-model input ``(B, C, H, W)``. A list of dims (e.g.
            ``["level"]``) folds those dims into channels even where every variable has them; a
            selected variable lacking them is one channel ``{var}``. Variable then label order.
        dtype : str or numpy dtype, optional
            The dtype of every output array, e.g. ``"float32"`` (what a model takes): values are
            xarray's decoded (and normalised) values cast to it (``.astype(dtype)``), in the one copy
            that builds the batch. Default: each variable's own (stacked: their common result dtype,
            so one float64 variable makes every channel float64).
        normalize : dict, optional
            Statistics from :meth:`stats` (``manifest.stats``): ``(x - mean) / std`` per channel,
            applied by channel name whatever the order of ``variables=`` (a channel the statistics
            lack raises, naming it; values must be numbers).
        device : str, torch.device or jax.Device, optional
            Where torch tensors go (e.g. ``"cuda:0"``); for ``output="jax"`` a jax device
            (default: jax's default device).
        block_chunks : int, optional
            Chunk blocks per shuffle buffer. Default: what a byte budget allows (about 1 GiB for
            the buffers read ahead and held; 2 to 16 blocks). Where each chunk block is one sample
            (one time step per chunk) no buffer is held: chunks decode straight into the batch.
        max_inflight : int, optional
            Chunk requests in flight at most (default: sized from the store's latency).
        drop_last : bool, default False
            Drop the last, short batch.
        rank, world_size : int, optional
            This process's share (default: torch.distributed's when it is initialised, else 0 of 1).
        progress : bool, default False
            Show a tqdm progress bar.
        missing : {"fill", "raise"}, default "fill"
            A chunk with no object in the store reads as the fill value, as in zarr (counted in
            ``io_stats["missing"]``, warned once per epoch), or raises ``ChunkReadError``.
        cache : bool, str, os.PathLike or ChunkCache, optional
            Keep decoded chunks across epochs: ``True`` or ``"memory"`` (in memory, a default
            budget), a directory (plus a disk tier there, kept across runs), or an
            ``xinsitu.ChunkCache(memory=, disk=, disk_size=)``. Same batches, same order.
        transform : callable, optional
            ``fn(batch) -> anything`` applied to every finished batch in the background thread,
            on host values before the ``device=`` copy (which then moves every array in what it
            returned); its exceptions are raised from the iterator.
        decode : {"auto", "cpu", "gpu"}, default "auto"
            Where chunks are decoded: ``"gpu"`` on the CUDA device the batches go to (nvCOMP),
            raising, with the reason, where it cannot; ``"cpu"`` never there; ``"auto"`` there where
            it can. The generator's repr says which path each variable takes.

        Returns
        -------
        BatchGenerator
        """
        if not isinstance(manifest, SplitManifest):  # (``batches("train")``: Python named the split missing)
            raise TypeError(f"manifest must be a SplitManifest, got {type(manifest).__name__} {str(manifest)[:40]!r}: "
                            "make one first, m = ds.insitu.split('time', fractions={...}), then "
                            "ds.insitu.batches(m, 'train')")
        if split is None:
            raise TypeError(f"split: name the split to read, one of {list(manifest.splits)}: "
                            "ds.insitu.batches(m, 'train')")
        return BatchGenerator(self._ds, manifest, split, batch_size=batch_size, shuffle=shuffle, seed=seed,
                              window=window, patch=patch, stride=stride, over=over,
                              variables=self._variables(manifest, variables), output=output, stack=stack,
                              dtype=dtype, normalize=normalize, device=device,
                              block_chunks=block_chunks, max_inflight=max_inflight, drop_last=drop_last,
                              rank=rank, world_size=world_size, progress=progress, missing=missing, cache=cache,
                              transform=transform, decode=decode)

    def stats(self, manifest: SplitManifest, split: str = "train", *, variables: str | list[str] | None = None,
              block_chunks: int = 16, max_inflight: int | None = None,
              cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
              stack: list[str] | None = None, diffs: str | None = None, client: Client | None = None,
              progress: bool = False) -> dict[str, Any]:
        """Normalisation statistics of ``split``, from one streaming pass over its chunks.

        Per channel (as ``gen.channels`` names them for the same variables): mean, std (ddof=0),
        min, max, nan_count (and count) of the CF-decoded values, in float64; a list in label order
        for a variable with an extra dim. Only ``split``'s chunks are read, each once. The result is
        plain JSON-able data, also stored as ``manifest.stats`` (``manifest.set_stats``; saved by ``manifest.to_json``);
        pass it as ``normalize=`` to ``batches`` for ``(x - mean) / std`` per channel.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split`.
        split : str, default "train"
            The split to reduce.
        variables : str or list of str, optional
            Variables to reduce (default: the data variables on the split dims, as for batches).
        block_chunks : int, default 16
            Units (chunk blocks) read ahead: at least 3 × ``block_chunks``.
        max_inflight : int, optional
            Chunk reads in flight at once.
        cache : bool, str, os.PathLike or ChunkCache, optional
            As for :meth:`batches`; pass the ``ChunkCache`` the training epochs use, and this pass fills
            it (not with ``client``: the chunks are read on the workers).
        stack : list of str, optional
            Dims to make channels of, as ``stack=["level"]`` of :meth:`batches`: statistics per
            label (per-level mean/std, a list in label order) rather than pooled over the dim; a
            variable lacking the dim (a surface field) keeps one number per key.
        diffs : str, optional
            A split dim, e.g. ``"time"``: also ``diff_mean``, ``diff_std`` and ``diff_count`` per channel,
            of the one-step differences ``x[t + 1] - x[t]`` along it (what models that predict tendencies
            normalise their outputs by), over pairs of positions both in the split: never across a gap
            or another split's blocks.
        client : distributed.Client, optional
            Read the split on a Dask cluster: its chunk blocks are dealt into tasks, each worker opens the
            archive itself (from the path, URL and store options, Icechunk session or virtual references the
            Dataset was opened from; a Dataset held in memory is refused, ``ValueError``), and the tasks'
            partial results are merged here: the same result as without ``client``, bit for bit, whatever
            the number of workers. A chunk that cannot be read raises ``ChunkReadError`` here.
        progress : bool, default False
            Show a tqdm bar (units read; with ``client``, tasks done).

        Returns
        -------
        dict
            ``{"split": ..., "channels": [...], "variables": [...], var: {"mean", "std", "min", "max",
            "nan_count", "count", ...}}``; see ``xinsitu.batches.stats.compute_stats``.

        See Also
        --------
        stats_part, xinsitu.merge_stats : the same pass in parts, for any engine (a Slurm job array).
        """
        from xinsitu.batches.stats import compute_stats

        st = compute_stats(self._ds, manifest, split, self._variables(manifest, variables),
                           block_chunks=block_chunks, max_inflight=max_inflight, cache=cache, stack=stack,
                           diffs=diffs, client=client, progress=progress)
        manifest.set_stats(st)
        return st

    def stats_part(self, manifest: SplitManifest, split: str = "train", *, part: tuple[int, int],
                   variables: str | list[str] | None = None, block_chunks: int = 16, max_inflight: int | None = None,
                   cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
                   stack: list[str] | None = None, diffs: str | None = None, progress: bool = False) -> dict[str, Any]:
        """Share ``i`` of ``n`` of :meth:`stats`: a small JSON-able partial result; ``xinsitu.merge_stats``
        merges the ``n`` parts, in any order, into what :meth:`stats` gives.

        For an engine of your own: a Slurm job array (task ``i`` of ``n`` writes
        ``json.dumps(ds.insitu.stats_part(m, "train", part=(i, n)))``, one last job merges), Beam, a loop.
        Share ``i`` is units (chunk blocks) ``i*U//n`` to ``(i+1)*U//n - 1`` of the split's ``U``, in split
        order. A part names its job (split, manifest, variables, channels, ``stack``, ``diffs``): parts of
        different jobs, a missing or a repeated part are refused by the merge.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split`.
        split : str, default "train"
            The split to reduce.
        part : tuple of int
            ``(i, n)``: share ``i`` of ``n`` (``0 <= i < n``).
        variables, block_chunks, max_inflight, cache, stack, diffs
            As for :meth:`stats` (the same in every part).
        progress : bool, default False
            Show a tqdm bar of this part's units.

        Returns
        -------
        dict
            ``{"xinsitu": "stats_part", "job_id", "job", "part": [i, n], "units": [a, b], "stats": ...}``:
            exact sums per channel, plain JSON (no NaN or infinity).
        """
        from xinsitu.batches.stats import stats_part

        return stats_part(self._ds, manifest, split, self._variables(manifest, variables), part=part,
                          block_chunks=block_chunks, max_inflight=max_inflight, cache=cache, stack=stack,
                          diffs=diffs, progress=progress)

    def validity(self, manifest: SplitManifest, split: str, where: str | Callable[[xr.Dataset], Any] = "finite",
                 variables: str | list[str] | None = None, *, window: dict[str, int] | None = None,
                 patch: dict[str, int] | None = None, stride: dict[str, int] | None = None,
                 over: str | list[str] | None = None, block_chunks: int = 16, max_inflight: int | None = None,
                 cache: bool | str | os.PathLike[str] | ChunkCache | None = None, client: Client | None = None,
                 progress: bool = False) -> dict[str, Any]:
        """Mark which samples of ``split`` are valid, from one streaming pass; batches then draw only those.

        The samples are read once, unshuffled, through the batches' own reader (each chunk once,
        memory bounded by ``block_chunks``). The mask -- a bitmap, compressed, JSON-able -- is stored
        as ``manifest.validity[split]`` with the sampling options it was made for, and saved by
        ``manifest.to_json``. ``batches``/``dataset`` of that split with the same ``window``,
        ``patch``, ``stride`` and ``over`` then hold only valid samples (exactly once, shuffled,
        equal batch counts across ranks, resumable); other options raise ``ValueError``.
        ``manifest.set_validity(split, None)`` removes the mask.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split`; the mask is stored in it.
        split : str
            The split whose samples are tested.
        where : "finite" or callable, default "finite"
            ``"finite"``: a sample is valid when no value of the chosen variables in it (every
            position of its window/patch and other dims) is NaN or infinite. A callable gets a batch
            of samples (an ``xr.Dataset`` with a ``sample`` dim, as ``output="xarray"`` gives) and
            returns one bool per sample (with ``client``, it must pickle: cloudpickle sends it).
        variables : str or list of str, optional
            Variables tested (default: the data variables on the split dims). Batches may read others.
        window, patch, stride, over : optional
            The sampling, as for :meth:`batches`.
        block_chunks, max_inflight, cache : optional
            As for :meth:`batches` (not ``cache`` with ``client``).
        client : distributed.Client, optional
            Test the split on a Dask cluster, as :meth:`stats` reads it: the same mask as without.
        progress : bool, default False
            Show a tqdm bar.

        Returns
        -------
        dict
            ``{"split", "valid", "total", "where", "sampling", "record"}``: how many samples are valid of how
            many, and the mask record now in ``manifest.validity[split]``.

        See Also
        --------
        validity_part, xinsitu.merge_validity : the same pass in parts, for any engine.
        """
        from xinsitu.batches.validity import compute_validity

        return compute_validity(self._ds, manifest, split, where, self._variables(manifest, variables),
                                window=window, patch=patch, stride=stride, over=over, block_chunks=block_chunks,
                                max_inflight=max_inflight, cache=cache, client=client, progress=progress)

    def validity_part(self, manifest: SplitManifest, split: str, where: str | Callable[[xr.Dataset], Any] = "finite",
                      variables: str | list[str] | None = None, *, part: tuple[int, int],
                      window: dict[str, int] | None = None, patch: dict[str, int] | None = None,
                      stride: dict[str, int] | None = None, over: str | list[str] | None = None,
                      block_chunks: int = 16, max_inflight: int | None = None,
                      cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
                      progress: bool = False) -> dict[str, Any]:
        """Share ``i`` of ``n`` of :meth:`validity`: the bitmap of the samples of units ``i*U//n`` to
        ``(i+1)*U//n - 1`` of the split's ``U``; ``xinsitu.merge_validity(parts, manifest)`` puts the ``n``
        parts together (in any order) and stores the mask in the manifest, as :meth:`validity` does.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split` (not changed here).
        split : str
            The split whose samples are tested.
        where : "finite" or callable, default "finite"
            As for :meth:`validity`.
        variables : str or list of str, optional
            As for :meth:`validity`.
        part : tuple of int
            ``(i, n)``: share ``i`` of ``n`` (``0 <= i < n``).
        window, patch, stride, over, block_chunks, max_inflight, cache : optional
            As for :meth:`validity` (the same in every part).
        progress : bool, default False
            Show a tqdm bar of this part's samples.

        Returns
        -------
        dict
            ``{"xinsitu": "validity_part", "job_id", "job", "part": [i, n], "samples": [a, b], "mask": ...}``,
            plain JSON.
        """
        from xinsitu.batches.validity import validity_part

        return validity_part(self._ds, manifest, split, where, self._variables(manifest, variables), part=part,
                             window=window, patch=patch, stride=stride, over=over, block_chunks=block_chunks,
                             max_inflight=max_inflight, cache=cache, progress=progress)

    def dataset(self, manifest: SplitManifest, split: str, *, window: dict[str, int] | None = None,
                patch: dict[str, int] | None = None, stride: dict[str, int] | None = None,
                over: str | list[str] | None = None, variables: str | list[str] | None = None,
                output: str = "numpy", stack: bool | list[str] = False, normalize: dict[str, Any] | None = None,
                cache: bool | str | os.PathLike[str] | ChunkCache | None = None,
                max_inflight: int | None = None, missing: str = "fill", dtype: Any = None) -> InsituDataset:
        """A map-style dataset over the samples of ``split``, for a DataLoader with your own sampler.

        ``len(d)`` is the number of samples of the whole split, numbered in unshuffled order (as
        :meth:`sample` numbers them); ``d[i]`` is one sample (no batch axis; negative ``i`` counts
        from the end); ``d.__getitems__(indices)`` -- what ``DataLoader(d, batch_size=B,
        sampler=...)`` calls -- reads a whole batch in one pass, each chunk once per call, and the
        default ``collate_fn`` stacks it into the batch :meth:`batches` would give for the same
        samples (``collate_fn=xinsitu.batches.mapstyle.collate`` hands that batch on as it is). Values are
        bit-identical to ``ds.isel(...)``. A torch ``Dataset`` where torch is installed; workers
        work under spawn/forkserver, and under fork for a local archive.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split`.
        split : str
            Name of the split whose samples are numbered ``0 .. len(d) - 1``.
        window, patch, stride, over, variables
            What a sample is, as for :meth:`batches` (``variables`` also gives the channel order).
        output : {"numpy", "torch", "xarray", "dataarray", "cupy"}, default "numpy"
            The kind of ``d[i]`` and of a batch; "numpy" or "torch" for the default ``collate_fn``
            (xarray outputs need ``collate_fn=xinsitu.batches.mapstyle.collate``).
        stack : bool or list of str, default False
            One array per sample with the variables as channels (``d.channels``), as for
            :meth:`batches` (``["level"]`` folds that dim into ``{var}_{label}`` channels).
        normalize : dict, optional
            Statistics from :meth:`stats` (``manifest.stats``): ``(x - mean) / std`` per channel.
        dtype : numpy dtype or str, optional
            The dtype of every array of a sample, as for :meth:`batches` (e.g. ``"float32"`` for a
            float64 archive, without a cast per sample in the training loop).
        cache : bool, str, os.PathLike or xinsitu.ChunkCache, optional
            Keep decoded chunks across calls (a directory: also across runs), as for :meth:`batches`;
            a random sampler then decodes each chunk once per run instead of once per sample.
        max_inflight : int, optional
            Chunk requests in flight at most (default: sized from the store's latency).
        missing : {"fill", "raise"}, default "fill"
            A chunk with no object in the store reads as the fill value, as in zarr, or raises
            ``ChunkReadError``.

        Returns
        -------
        xinsitu.batches.mapstyle.InsituDataset
        """
        from xinsitu.batches.mapstyle import InsituDataset

        return InsituDataset(self._ds, manifest, split, window=window, patch=patch, stride=stride, over=over,
                             variables=self._variables(manifest, variables), output=output, stack=stack,
                             normalize=normalize, cache=cache,
                             max_inflight=max_inflight, missing=missing, dtype=dtype)

    def sample(self, manifest: SplitManifest, split: str, i: int, *, window: dict[str, int] | None = None,
               patch: dict[str, int] | None = None, stride: dict[str, int] | None = None,
               over: str | list[str] | None = None, variables: str | list[str] | None = None,
               normalize: dict[str, Any] | None = None) -> xr.Dataset:
        """Sample ``i`` of ``split`` (unshuffled order) as a labeled Dataset.

        Parameters
        ----------
        manifest : SplitManifest
            From :meth:`split`.
        split : str
            Name of the split.
        i : int
            Index of the sample in the whole split, ``0 <= i < n_samples``.
        window, patch, stride, over, variables, normalize
            As for :meth:`batches`.

        Returns
        -------
        xr.Dataset
        """
        gen = BatchGenerator(self._ds, manifest, split, shuffle=False, batch_size=1, window=window, patch=patch,
                             stride=stride, over=over, variables=self._variables(manifest, variables),
                             normalize=normalize, rank=0, world_size=1)
        return gen.sample(i)
