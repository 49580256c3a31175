"""The one place xinsitu touches VirtualiZarr's private API.

Supported: VirtualiZarr 2.5 to 2.8 (and newer 2.x while the contract test holds). Where releases
differ, the path is chosen by feature, never by version string; ``tests/compat/test_compat.py``
exercises every symbol named here.

Private symbols still used, and why:

- ``ManifestStore._group`` / ``ManifestStore._registry``: the manifests and the URL -> store
  registry of a store VirtualiZarr built; ``ManifestStore`` exposes neither (it is a zarr
  store: its public face is ``get``/``list``, which fetch through the registry and would give
  xinsitu no byte ranges to batch).
- ``ChunkManifest._paths`` / ``_offsets`` / ``_lengths`` (and ``_inlined``, VirtualiZarr >= 2.8):
  the manifest's own arrays, joined along the files' dimension (or given one of length 1) without
  building a dict per chunk (``ChunkManifest.dict()`` is the public, per-chunk, much slower way).
- ``virtualizarr.parsers.hdf.hdf._construct_manifest_array``: one variable of an HDF5 file
  parsed alone, to name the variable whose filter has no decoder when a whole file fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def manifest_group(store: Any) -> Any:
    """The ``ManifestGroup`` a ``ManifestStore`` serves."""
    return store._group


def manifest_registry(store: Any) -> Any:
    """The ``ObjectStoreRegistry`` a ``ManifestStore`` resolves URLs with."""
    return store._registry


def is_manifest_store(store: Any) -> bool:
    return type(store).__name__ == "ManifestStore" and hasattr(store, "_group") and hasattr(store, "_registry")


def manifest_files(store: Any, apath: str) -> list[str]:
    """The file URLs the array at ``apath`` of a ``ManifestStore`` references, sorted ([] where none)."""
    node = manifest_group(store)
    for part in [p for p in apath.split("/") if p]:
        node = node[part]
    paths = np.asarray(getattr(getattr(node, "manifest", None), "_paths", np.array([], dtype=str)))
    return sorted({str(p) for p in paths.ravel().tolist() if p})


def inlined_chunk(manifest: Any, coords: tuple[int, ...]) -> bytes | None:
    """The bytes of chunk ``coords`` where the ``ChunkManifest`` holds them itself (VirtualiZarr >= 2.8 keeps
    small chunks inline: a variable-length string variable, an HDF5 compact dataset), else None."""
    held = getattr(manifest, "_inlined", None)
    got = None if not held else held.get(tuple(coords))
    return None if got is None else bytes(got)  # (a bytearray)


def keeps_chunks_inline() -> bool:
    """Whether this VirtualiZarr keeps small chunks in its manifests (>= 2.8), so reads variable-length strings."""
    import inspect

    from virtualizarr.manifests import ChunkManifest

    return "inlined" in inspect.signature(ChunkManifest.from_arrays).parameters


def chunk_shape(arr: Any) -> tuple[int, ...]:
    """The chunk shape of a ``ManifestArray`` (VirtualiZarr >= 2.8 has no ``.chunks``: zarr's metadata has)."""
    return tuple(arr.metadata.chunks)


def concat_manifests(manifests: list[Any], axis: int) -> Any:
    """One ``ChunkManifest`` of ``manifests`` joined along chunk-grid ``axis`` (as ``np.concatenate``)."""
    from virtualizarr.manifests import ChunkManifest

    kwargs: dict[str, Any] = {}
    if any(getattr(m, "_inlined", None) for m in manifests):  # VirtualiZarr >= 2.8: chunks held in memory
        inlined: dict[tuple[int, ...], bytes] = {}
        shift = 0
        for m in manifests:
            for idx, data in m._inlined.items():
                moved = list(idx)
                moved[axis] += shift
                inlined[tuple(moved)] = data
            shift += m._paths.shape[axis]
        kwargs["inlined"] = inlined
    return ChunkManifest.from_arrays(
        paths=np.concatenate([m._paths for m in manifests], axis=axis),  # type: ignore[arg-type]  # StringDType
        offsets=np.concatenate([m._offsets for m in manifests], axis=axis),
        lengths=np.concatenate([m._lengths for m in manifests], axis=axis),
        validate_paths=False,
        **kwargs,
    )


def expand_manifest(manifest: Any, axis: int) -> Any:
    """``manifest`` with a chunk-grid axis of length 1 inserted at ``axis`` (as ``np.expand_dims``; VirtualiZarr's
    own ``np.expand_dims`` of a ``ManifestArray`` fails where it has dimension names)."""
    from virtualizarr.manifests import ChunkManifest

    kwargs: dict[str, Any] = {}
    if getattr(manifest, "_inlined", None):  # VirtualiZarr >= 2.8: chunks held in memory
        kwargs["inlined"] = {(*idx[:axis], 0, *idx[axis:]): data for idx, data in manifest._inlined.items()}
    return ChunkManifest.from_arrays(
        paths=np.expand_dims(manifest._paths, axis),  # type: ignore[arg-type]  # StringDType
        offsets=np.expand_dims(manifest._offsets, axis),
        lengths=np.expand_dims(manifest._lengths, axis),
        validate_paths=False,
        **kwargs,
    )


def hdf5_variable_manifest(url: str, dataset: Any, group: str) -> Any:
    """One HDF5 dataset as a ``ManifestArray`` (raises where VirtualiZarr cannot reference it)."""
    from virtualizarr.parsers.hdf.hdf import _construct_manifest_array

    return _construct_manifest_array(url, dataset, group)
