"""How the chunks of a VirtualiZarr ``ManifestStore`` are fetched: byte ranges of the original
NetCDF/HDF5/GRIB files (``ManifestBackend``), ranges of one file asked for in one loop turn coalesced
into one request. ``xinsitu.stores.backend.backend_for`` picks it for such a store."""

from __future__ import annotations

import asyncio
import os
from typing import Any, NamedTuple
from urllib.parse import unquote, urlparse

from xinsitu.compat import virtualizarr_api as compat_virtualizarr
from xinsitu.io import loop as _loop
from xinsitu.stores.redact import redact_url, scrubbed, secrets_of

#: Bytes of one file fetched in one request at most, where ranges are coalesced (remote stores).
COALESCE_BYTES = 8 * 2**20

class VirtualReferenceError(ValueError):
    """Files that cannot be read in place as one virtual Zarr store; names the file and the variable."""


def named(url: str) -> str:
    """How a file is named in messages: a local path as a path, a URL without credentials."""
    return url[len("file://"):] if url.startswith("file://") else redact_url(url)


def is_manifest_store(zstore: Any) -> bool:
    """Whether ``zstore`` is a VirtualiZarr ``ManifestStore`` (chunks are byte ranges of other files)."""
    return compat_virtualizarr.is_manifest_store(zstore)


def _chunk_coords(ckey: str, encoding: Any, ndim: int) -> tuple[int, ...]:
    """Chunk grid coordinates from a chunk key ("c/0/1/2", "c.0.1.2" or v2's "0.1.2")."""
    sep = getattr(encoding, "separator", "/")
    if getattr(encoding, "name", "default") == "default":
        if not ckey.startswith("c"):
            raise KeyError(f"chunk key {ckey!r} does not start with 'c'")
        ckey = ckey[1:].lstrip(sep)
    parts = [p for p in ckey.split(sep) if p != ""]
    if len(parts) != ndim:
        raise KeyError(f"chunk key {ckey!r} does not have {ndim} coordinates")
    return tuple(int(p) for p in parts)


def path_in_store(url: str, store: Any) -> str:
    """The path of ``url`` inside ``store``, exactly as VirtualiZarr's ``ManifestStore.get`` computes it."""
    path = urlparse(url).path
    prefix = getattr(store, "prefix", None)
    if prefix:
        pre = str(prefix).lstrip("/")
    elif isinstance(getattr(store, "url", None), str):
        pre = urlparse(store.url).path.lstrip("/")
    else:
        pre = ""
    return path.lstrip("/").removeprefix(pre).lstrip("/")


def _is_obstore(store: Any) -> bool:
    return type(store).__module__.startswith("obstore")


#: the attribute of a virtual store that holds the local files it references, as they were when it was made
#: (``note_opened``): {URL: (size, modification time)}; kept with the store, so that a copy pickled to a
#: DataLoader worker or a cluster's worker checks them too
_OPENED = "_xinsitu_opened"


def note_opened(mstore: Any) -> Any:
    """Remember the size and modification time of each local file ``mstore`` (a ``ManifestStore``) references,
    so that a read refuses a file changed since (``ManifestBackend``); ``mstore`` itself."""
    files = {u for name in compat_virtualizarr.manifest_group(mstore).arrays
             for u in compat_virtualizarr.manifest_files(mstore, name) if u.startswith("file://")}
    seen = {}
    for url in files:
        try:
            st = os.stat(_local_path(url))
        except OSError:
            continue
        seen[url] = (st.st_size, st.st_mtime_ns)
    try:
        setattr(mstore, _OPENED, seen)
    except AttributeError:  # (a store that takes no attribute: not checked)
        pass
    return mstore


def _local_path(url: str) -> str:
    return unquote(urlparse(url).path)


class ChunkRange(NamedTuple):
    """Where a virtual chunk's bytes lie: ``url``, bytes ``start:end``."""

    url: str
    start: int
    end: int


class _FileStore(NamedTuple):
    """How a referenced file is read: the store its URL resolves to, its path there, the store's secrets."""

    store: Any
    path: str
    secrets: list[str]


class ManifestBackend:
    """Fetch chunks of a ``ManifestStore`` as byte ranges of the original files.

    ``get(key)`` takes the zarr key of a chunk (``"t2m/c/0/0/0"``) and returns its bytes,
    None where the manifest has no entry (zarr's fill value). On object storage, ranges of one
    file requested in the same turn of the event loop go out as one ``get_ranges`` call (see
    ``_groups``). The reader's semaphore bounds the ranges in flight (``max_inflight``).
    """

    def __init__(self, mstore: Any):
        if not is_manifest_store(mstore):
            raise TypeError(f"expected a VirtualiZarr ManifestStore, got {type(mstore).__name__}")
        self.mstore = mstore
        self._group = compat_virtualizarr.manifest_group(mstore)
        self._registry = compat_virtualizarr.manifest_registry(mstore)
        self._arrays: dict[str, tuple[Any, Any]] = {}
        self._stores: dict[str, _FileStore] = {}
        self._turn = _loop.OneTurn(self._flush)  # ranges asked for in one loop turn, grouped per file
        self._tasks: set[asyncio.Future] = set()
        self.requests = 0  # get/get_ranges calls made to the file stores

    # -- key -> (url, start, end)
    def _array(self, apath: str) -> tuple[Any, Any]:
        got = self._arrays.get(apath)
        if got is None:
            node = self._group
            for part in apath.split("/"):
                node = node[part]
            if not hasattr(node, "manifest"):
                raise KeyError(f"{apath!r} is a group, not an array")
            got = self._arrays[apath] = (node.manifest, node.metadata.chunk_key_encoding)
        return got

    def locate(self, key: str) -> ChunkRange | bytes | None:
        """(file URL, start, end) of the chunk stored under ``key``; its bytes where the manifest holds them
        (``inlined_chunk``); None where it has no entry."""
        apath, ckey = self._split_key(key)
        manifest, encoding = self._array(apath)
        coords = _chunk_coords(ckey, encoding, manifest.ndim_chunk_grid)
        inline = compat_virtualizarr.inlined_chunk(manifest, coords)
        if inline is not None:
            return inline
        entry = manifest.get_entry(coords)
        if entry is None:
            return None
        start = int(entry["offset"])
        return ChunkRange(str(entry["path"]), start, start + int(entry["length"]))

    def _split_key(self, key: str) -> tuple[str, str]:
        """'grp/t2m/c/0/0' -> ('grp/t2m', 'c/0/0'): the longest prefix that names an array."""
        parts = key.split("/")
        node = self._group
        for i, part in enumerate(parts):
            arrays = getattr(node, "arrays", {})
            if part in arrays:
                return "/".join(parts[: i + 1]), "/".join(parts[i + 1:])
            groups = getattr(node, "groups", {})
            if part not in groups:
                break
            node = groups[part]
        raise KeyError(f"no array of the virtual store holds key {key!r}")

    def _store_of(self, url: str) -> _FileStore:
        got = self._stores.get(url)
        if got is None:
            store, _ = self._registry.resolve(url)
            if store is None:
                raise VirtualReferenceError(f"no store registered for {named(url)}")
            got = self._stores[url] = _FileStore(store, path_in_store(url, store), secrets_of(store))
        return got

    def _check_unchanged(self, url: str) -> None:
        """Refuse a local file changed since the store was made (``_changed``): its references are byte offsets into
        the file as it was (a GRIB file of the same messages in another order read one field as another); checked
        after each read (a ``stat``), so a file written again during a run is caught too."""
        if self._changed(url):
            raise VirtualReferenceError(f"{named(url)} changed after it was opened (its size or modification "
                                        "time): the references are byte offsets into the file as it was; open "
                                        "it again")

    def _changed(self, url: str) -> bool:
        """Whether the local file ``url`` is of another size or modification time than when the store was made
        (``note_opened``); False where it is not known then, or cannot be looked at now (the read says why)."""
        was = (getattr(self.mstore, _OPENED, None) or {}).get(url)
        if was is None:
            return False
        try:
            st = os.stat(_local_path(url))
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns) != was

    def changed(self, key: str) -> bool:
        """Whether the file chunk ``key`` lies in changed since the store was made: what a read ahead read of it is
        then not what a read gives (``io.fetchers.reads_changed``)."""
        where = self.locate(key)
        return isinstance(where, ChunkRange) and self._changed(where.url)

    # -- fetching
    async def get(self, key: str) -> Any:
        where = self.locate(key)
        if where is None or isinstance(where, bytes):
            return where
        url, start, end = where
        fs = self._store_of(url)
        store, path = fs.store, fs.path
        loop = asyncio.get_running_loop()
        if _is_obstore(store) and _loop.in_forked_child():
            if not url.startswith("file://"):
                _loop.refuse_after_fork(f"{named(url)}, referenced by the virtual store,")
            # obstore would hang here; a local file is read with plain file I/O instead (fork-safe)
            data = await loop.run_in_executor(None, _read_local, url, start, end)
            self.requests += 1
            self._check_unchanged(url)
            return _checked(data, url, start, end, key)
        fut: asyncio.Future = loop.create_future()
        self._turn.add((store, path, url, start, end, fut))
        return _checked(await fut, url, start, end, key)

    def _flush(self, asked: list[tuple[Any, str, str, int, int, asyncio.Future]]) -> None:
        pending: dict[tuple[int, str], tuple[Any, str, list[tuple[int, int, asyncio.Future]]]] = {}
        for store, path, url, start, end, fut in asked:
            pending.setdefault((id(store), path), (store, url, []))[2].append((start, end, fut))
        for store, url, items in pending.values():
            for group in _groups(store, items):
                task = asyncio.ensure_future(self._fetch_file(store, url, group))
                self._tasks.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._tasks.discard)

    async def _fetch_file(self, store: Any, url: str, items: list[tuple[int, int, asyncio.Future]]) -> None:
        fs = self._store_of(url)
        path, secrets = fs.path, fs.secrets
        try:
            self.requests += 1
            if len(items) == 1:
                s, e, _ = items[0]
                got = [await _loop.native(store.get_range_async(path, start=s, end=e))]
            else:
                got = list(await _loop.native(store.get_ranges_async(path, starts=[s for s, _, _ in items],
                                                                     ends=[e for _, e, _ in items])))
        except asyncio.CancelledError:
            for _, _, f in items:
                f.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - every waiting chunk gets the error, naming the file
            err = file_error(e, url, secrets)
            for _, _, f in items:
                if not f.done():
                    f.set_exception(err)
            return
        try:
            self._check_unchanged(url)  # (after the read: bytes of a file written again meanwhile are refused)
        except VirtualReferenceError as changed:
            for _, _, f in items:
                if not f.done():
                    f.set_exception(changed)
            return
        for (_, _, f), data in zip(items, got, strict=True):
            if not f.done():
                f.set_result(data)


def _checked(data: Any, url: str, start: int, end: int, key: str) -> Any:
    if len(data) != end - start:
        raise OSError(f"{named(url)}: bytes {start}..{end} of chunk {key!r} came back as {len(data)} "
                      "bytes; the file is shorter than its references say (changed since they were made?)")
    return data


def _read_local(url: str, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of a local file (``file://`` URL), by plain file I/O."""
    path = _local_path(url)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}, referenced by the virtual store, does not exist "
                                "(moved or deleted since the references were made?)") from None


def _groups(store: Any, items: list[tuple[int, int, asyncio.Future]]) -> list[list[tuple[int, int, asyncio.Future]]]:
    """The requests that ``items`` (ranges of one file) go out as.

    Remote: ranges together, in file order, up to ``COALESCE_BYTES`` a request (obstore then
    merges those that lie close): fewer round trips. Local files: one read per range, so that
    reads and decodes overlap (a local ``get_ranges`` reads its ranges one after the other).
    """
    if _is_obstore(store) and type(store).__name__ == "LocalStore":
        return [[it] for it in items]
    out: list[list[tuple[int, int, asyncio.Future]]] = []
    size = COALESCE_BYTES
    for it in sorted(items, key=lambda x: x[0]):
        n = it[1] - it[0]
        if size + n > COALESCE_BYTES:
            out.append([])
            size = 0
        out[-1].append(it)
        size += n
    return out


def file_error(e: BaseException, url: str, secrets: list[str]) -> BaseException:
    where = named(url)
    from obstore.exceptions import NotFoundError

    if isinstance(e, (FileNotFoundError, NotFoundError)):
        return FileNotFoundError(f"{where}, referenced by the virtual store, does not exist "
                                 "(moved or deleted since the references were made?)")
    err = scrubbed(e, secrets)
    return type(err)(f"{where}: {err}")
