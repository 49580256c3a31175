"""Icechunk repositories that can hold virtual chunks: references to byte ranges of files outside the
repository (NetCDF, GRIB, raw files), which a snapshot id does not name. Such a file may be rewritten
while the snapshot stays the same, so the cache cannot trust the snapshot alone for them.

``holds_virtual_chunks`` tells such a repository by its virtual chunk containers (icechunk 1.x and 2.x:
``session.config.virtual_chunk_containers``). ``referenced_state`` names, for the memory tier, the
state of the local files a snapshot references (size, modification and change times, device and
inode: one ``stat`` per file, once per snapshot and reader); a remote reference is named by its URL only.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any
from urllib.parse import unquote, urlsplit

#: why the disk tier keeps nothing of such a repository (``ChunkCache`` says it once)
WHY = ("its Icechunk repository has virtual chunk containers: a virtual chunk is a file outside the "
       "snapshots, which may be rewritten while the snapshot id stays the same")

_locations: dict[str, list[str]] = {}  # snapshot id -> the locations its virtual chunks reference (it never changes)
_lock = threading.Lock()
_KEEP = 64  # snapshots whose locations are remembered


def holds_virtual_chunks(store: Any) -> bool:
    """Whether the Icechunk store's repository can hold virtual chunks (it has virtual chunk containers);
    True where that cannot be told (a session or config unlike icechunk 1.x's and 2.x's)."""
    try:
        containers = store.session.config.virtual_chunk_containers
    except Exception:  # noqa: BLE001 - cannot tell: taken as holding some
        return True
    return bool(containers)


def referenced_state(store: Any, snapshot: str) -> str:
    """A digest of what snapshot ``snapshot`` of the Icechunk store references: each local file
    (``file://``) by its size, modification and change times, device and inode (a missing one as missing),
    each remote location by its URL. Raises where the locations cannot be listed."""
    with _lock:
        locations = _locations.get(snapshot)
    if locations is None:
        locations = sorted(set(store.session.all_virtual_chunk_locations()))
        with _lock:
            if len(_locations) >= _KEEP:
                _locations.clear()
            _locations[snapshot] = locations
    h = hashlib.blake2b(digest_size=16)
    for url in locations:
        part = url
        if url.startswith("file://"):
            try:
                st = os.stat(unquote(urlsplit(url).path))
                part += f" {st.st_size},{st.st_mtime_ns},{st.st_ctime_ns},{st.st_dev}:{st.st_ino}"
            except OSError:
                part += " missing"
        h.update(part.encode() + b"\0")
    return h.hexdigest()
