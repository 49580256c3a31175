"""Which Icechunk snapshot a Dataset was read from, so that a split can say what it was made on.

An Icechunk session's store knows its snapshot (``store.session.snapshot_id``). A split
records it (``SplitManifest.snapshot``) and a generator built on a Dataset of another
snapshot warns: the chunks are the same, the data behind them may not be. Stores without
snapshots (plain Zarr, VirtualiZarr manifests) have none, and neither has a writable
session with uncommitted changes (its data is no snapshot yet).
"""

from __future__ import annotations

from typing import Any

import xarray as xr


def writable_session(zstore: Any) -> bool:
    """Whether ``zstore`` is the store of a writable Icechunk session (what is in it may change in this process)."""
    return type(zstore).__name__ == "IcechunkStore" and not getattr(getattr(zstore, "session", None), "read_only",
                                                                    False)


def snapshot_of_store(zstore: Any) -> str | None:
    """The snapshot id of an Icechunk session's store; None for any other store."""
    if type(zstore).__name__ != "IcechunkStore":
        return None
    session = getattr(zstore, "session", None)
    if session is None:
        return None
    try:
        if not session.read_only and session.has_uncommitted_changes:
            return None
        return str(session.snapshot_id)
    except Exception:  # noqa: BLE001 - a closed or foreign session: no snapshot to speak of
        return None


def snapshot_of_sources(sources: dict[str, Any]) -> str | None:
    """The snapshot the stored variables (``xinsitu.index.source.VarSource``) were read from.

    None when none of them comes from an Icechunk snapshot; where variables come from several
    snapshots (a Dataset merged from two sessions), their ids joined by ``+`` in sorted order.
    """
    ids = set()
    for src in sources.values():
        if getattr(src, "array", None) is not None:
            sid = snapshot_of_store(src.array.store)
            if sid is not None:
                ids.add(sid)
    return "+".join(sorted(ids)) if ids else None


def snapshot_of(ds: xr.Dataset) -> str | None:
    """The Icechunk snapshot id ``ds`` was read from, or None (see ``snapshot_of_sources``)."""
    from xinsitu.index.source import resolve

    try:
        sources = resolve(ds)
    except ValueError:  # no data variables, or a Dataset that maps back to no store: no snapshot
        return None
    return snapshot_of_sources(sources)
