"""What names a chunk in the cache: keys, object versions and store identities.

A key (``ChunkKey``) is a digest of the store's identity (``store_identity``: what locates the data,
never credentials), the array's path, a hash of its metadata (its shape only for the chunks the shape
cuts: ``ChunkKey.edges``), the Icechunk snapshot where there is one
and the chunk's coordinates; the disk tier's keys also name each chunk file's size, modification and
change times and inode, or each remote object's version (``object_versions``, ``fsspec_versions``): a
strong ETag and the size (``xinsitu.cache.versions``: ``trusted``), else a reason why none can be had
(``why_not``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from xinsitu.cache.versions import MISSING, UNKNOWN, fsspec_versions, no_answer, object_versions
from xinsitu.cache.virtual_refs import WHY as VIRTUAL_WHY
from xinsitu.cache.virtual_refs import holds_virtual_chunks, referenced_state
from xinsitu.index.snapshot import snapshot_of_store, writable_session
from xinsitu.io import loop as _loop


def _metadata_bytes(metadata: bytes | str | dict[str, Any]) -> bytes:
    if isinstance(metadata, bytes):
        return metadata
    if isinstance(metadata, str):
        return metadata.encode()
    if isinstance(metadata, dict):  # canonical: the same dict gives the same bytes in every process
        return json.dumps(metadata, sort_keys=True, default=str, separators=(",", ":")).encode()
    raise TypeError(f"metadata must be bytes, str or dict, not {type(metadata).__name__}")


#: how far behind the time of a write a file's change time may be: the kernel stamps files from its coarse clock,
#: up to a tick (1-10 ms) behind ``time.time_ns()`` (newer kernels stamp some writes from the fine clock)
FILE_CLOCK_SLACK_NS = 20_000_000


def file_clock_ns() -> int:
    """Now, as a file written from now on could be stamped at the earliest (``FILE_CLOCK_SLACK_NS`` ago): a chunk
    rewritten just as a reader began could look older than that beginning. A file written in the slack before
    counts as written after (read again, once)."""
    return time.time_ns() - FILE_CLOCK_SLACK_NS


def changed_since(path: str, since_ns: int, gone: bool = True) -> bool:
    """Whether the local file ``path`` was written (its change or modification time: a change time cannot be set
    back) at or after ``since_ns`` (``file_clock_ns``); ``gone``: what a file that is not there counts as."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return gone
    return max(st.st_ctime_ns, st.st_mtime_ns) >= since_ns


class ChunkKey:
    """Cache keys for the chunks of one array: computed once per array, then one short hash per chunk.

    A key is a 32-character hex digest (BLAKE2b) of the store's identity, the array's path,
    a hash of its metadata, the Icechunk snapshot (where there is one), the chunk's grid
    coordinates and, for a chunk file of a local directory, its size, modification time, change
    time and inode (for an object of a remote store, its version: ``versions``). It is the same in
    every process (no Python ``hash``) and never contains
    credentials (only a digest of the identity is kept).

    Parameters
    ----------
    store_id
        What names the store: a URL or a directory, without credentials or query strings.
    array_path
        The array's path inside the store.
    metadata
        The array's metadata (dtype, shape, chunks, codecs, fill value), as a dict (e.g.
        ``zarr_array.metadata.to_dict()`` without ``attributes``), a string or bytes.
    snapshot
        The Icechunk snapshot id, or None.
    local_root
        For a store that is a local directory: its path, so that ``key`` can stat chunk files.
    remote
        For a remote store: what its objects' versions are asked of (``versions``): an obstore
        store, or a zarr ``FsspecStore`` (its filesystem's ``info``).
    needs_version
        Whether disk keys must name each object's version (a remote store without snapshots).
    store_name
        The store as messages name it (a URL without credentials); default ``store_id``.
    state
        What else names the data for the memory tier only (``ident``): the state of the files an
        Icechunk snapshot references (``virtual_refs.referenced_state``).
    unversioned
        Why the objects have no version to ask, where ``needs_version`` and no ``remote``: said where the
        disk tier keeps nothing of them.
    """

    __slots__ = ("store_id", "array_path", "metadata_hash", "snapshot", "local_root", "ident", "_prefix",
                 "remote", "needs_version", "_versions", "_listed", "_vlock", "store_name", "_silent",
                 "since_ns", "unversioned", "_cut", "_shape")

    def __init__(self, store_id: str, array_path: str, metadata: bytes | str | dict[str, Any],
                 snapshot: str | None = None, local_root: str | os.PathLike[str] | None = None, *,
                 remote: Any = None, needs_version: bool = False, store_name: str | None = None,
                 state: str = "", unversioned: str | None = None):
        self.store_id = str(store_id)
        self.store_name = self.store_id if store_name is None else str(store_name)
        self.array_path = str(array_path)
        self.metadata_hash = hashlib.blake2b(_metadata_bytes(metadata), digest_size=16).hexdigest()
        self.snapshot = snapshot
        self.local_root = None if local_root is None else os.fspath(local_root)
        parts = ("xinsitu-chunk-v1", self.store_id, self.array_path, self.metadata_hash, snapshot or "")
        self._prefix = hashlib.blake2b("\0".join(parts).encode(), digest_size=16)
        #: names the array's data: what the memory tier's keys start with. For a local directory, also which
        #: directory it is (``_directory_identity``): one swapped in by a rename, or a link repointed, is
        #: another archive, whose files may be older than what the memory tier kept (their change times
        #: tell nothing then); the disk tier's keys name each file's inode already
        ident = self._prefix.hexdigest()
        if self.local_root is not None:
            state += _directory_identity(self.local_root, self.array_path)
        if state:
            ident = hashlib.blake2b((ident + state).encode(), digest_size=16).hexdigest()
        self.ident = ident
        #: why the store's objects have no version to ask (the disk tier keeps nothing unless immutable)
        self.unversioned = unversioned
        #: an archive whose objects may be rewritten in place (object storage, HTTP): its disk keys name
        #: each object's version (``versions``), asked of ``remote`` (None: cannot be asked)
        self.remote, self.needs_version = remote, bool(needs_version)
        self._versions: dict[str, str] = {}  # object key -> its version, as this process found it
        self._listed = False
        self._silent: str | None = None  # the store got no answer in time: not asked again (its version)
        self._vlock = threading.Lock()
        #: made before its reader read any chunk: what the memory tier keeps through these keys matches
        #: the source since then (a local file changed later is read again by a later reader)
        self.since_ns = file_clock_ns()
        #: the chunks the array's shape cuts, ``(axis, last chunk along it)``, and that shape (``edges``)
        self._cut: tuple[tuple[int, int], ...] = ()
        self._shape = ""

    def memory_key(self, chunk: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """The memory tier's key of chunk ``chunk``: ``(ident, chunk)``, a dict lookup without hashing
        or ``stat`` (0.2 against 5-6 us for ``key`` of a local chunk file); for a local directory
        ``ident`` names which directories the root and the array are, so an archive swapped in by a
        rename or a repointed link has other keys. A reader takes what the
        memory tier kept as it found it, and a later reader (a new generator given the same
        ``ChunkCache``) checks once each entry kept before it started: a local file's by its change
        time, a remote object's by its version where one was known (``cache.lookup``); the disk tier
        keys each local file by its size, modification and change times and inode.
        """
        if self._cut and self._is_cut(chunk):
            return (self.ident + self._shape, chunk)
        return (self.ident, chunk)

    def key(self, chunk: tuple[int, ...], local_file: str | os.PathLike[str] | None = None,
            version: str | None = None) -> str:
        """The key of chunk ``chunk`` (grid coordinates; for sharded arrays, the inner chunk's).

        Parameters
        ----------
        chunk
            The chunk's coordinates in the array's chunk grid.
        local_file
            The chunk's file, for a store that is a local directory: its size, modification time,
            change time and inode become part of the key (a missing file too), so a rewritten file
            is a miss, whatever the rewrite kept (the change time cannot be set back).
        version
            The version of the chunk's object in a remote store (``versions``): part of the key, so
            a rewritten object is a miss.

        Returns
        -------
        str
            32 hex characters.
        """
        h = self._prefix.copy()
        h.update(("\0" + ",".join(str(int(c)) for c in chunk)).encode())
        if self._cut and self._is_cut(chunk):
            h.update(self._shape.encode())
        if local_file is not None:
            try:
                st = os.stat(local_file)
                h.update(f"\0{st.st_size},{st.st_mtime_ns},{st.st_ctime_ns},{st.st_ino}".encode())
            except FileNotFoundError:
                h.update(b"\0missing")
        if version is not None:
            h.update(("\0version " + version).encode())
        return h.hexdigest()

    def versions(self, object_keys: list[str]) -> tuple[list[str | None], int]:
        """The current versions of objects ``object_keys`` of the remote store (see ``object_versions``
        and ``fsspec_versions``), each asked once per ``ChunkKey`` (the archive as this process found it,
        like the memory tier): (versions, None where the store could not tell; requests made). Only a
        version that ``trusted`` accepts may key a disk entry; the others say why not.

        The first call lists the array's prefix, one request per 1000 objects (stores that cannot
        list, such as HTTP, and fsspec's are asked one ``HEAD``, or ``info``, per object instead).
        Every request is bounded by ``XINSITU_REQUEST_TIMEOUT``: what got no answer in time is unknown
        (``why_not``), and a store that did not answer is not asked again through this ``ChunkKey``."""
        n = 0
        memo = self._versions
        fsspec = type(self.remote).__name__ == "FsspecStore"
        if self._silent is not None:  # one wait per array and process for a store that does not answer
            return [memo.get(k, self._silent) for k in object_keys], 0
        with self._vlock:  # one listing per array: the other threads wait for it (bounded by its requests)
            if (not self._listed and self.remote is not None and not fsspec
                    and type(self.remote).__name__ != "HTTPStore"):
                self._listed = True  # once, whatever comes of it
                try:
                    listed, n = object_versions(self.remote, prefix=self.array_path)
                except TimeoutError:  # a silent store: its objects are not asked one by one either
                    self._silent = no_answer(_loop.request_timeout())
                    return [memo.get(k, self._silent) for k in object_keys], 1
                except Exception:  # noqa: BLE001 - a store that cannot list (no permission): asked per object below
                    n = 1
                else:  # what the listing lacks has no object (it reads as the fill value)
                    memo.update(listed)
                    for k in object_keys:
                        memo.setdefault(k, MISSING)
            need = [k for k in dict.fromkeys(object_keys) if k not in memo]
        if need and self.remote is not None:
            got, asked = (fsspec_versions if fsspec else object_versions)(self.remote, need)
            n += asked
            memo.update(got)
            self._silent = next((v for v in got.values() if v.startswith(UNKNOWN)), None)
        return [memo.get(k) for k in object_keys], n

    def known_version(self, object_key: str) -> str | None:
        """The version ``versions`` found of ``object_key``, if it asked (else None: nothing is asked here)."""
        return self._versions.get(object_key)

    def file_of(self, object_key: str) -> str | None:
        """The local file of store object ``object_key`` (e.g. ``"t2m/c/3/0/0"``), None for a remote store."""
        return None if self.local_root is None else os.path.join(self.local_root, object_key)

    @classmethod
    def for_array(cls, array: Any, snapshot: str | None = None,
                  states: dict[str, str] | None = None) -> ChunkKey | None:
        """Keys for the chunks of a zarr array, or None where its store has no stable identity
        (a ``MemoryStore``, an Icechunk session with uncommitted changes, a store kind not
        known here): such an array is not cached.

        Parameters
        ----------
        array
            A ``zarr.Array`` (or ``AsyncArray``).
        snapshot
            The Icechunk snapshot id, where the caller knows it already (else read from the store).
        states
            Where given, the state of the files each snapshot references, kept by snapshot id: the arrays
            of one reader ``stat`` them once, not once each.
        """
        aa = getattr(array, "async_array", array)
        store = array_store(array)
        ident = store_identity(store)
        if ident is None:
            return None
        store_id, root = ident
        remote, state, why = None, "", None
        if type(store).__name__ == "IcechunkStore":
            snapshot = snapshot or snapshot_of_store(store)
            if snapshot is None or writable_session(store):
                return None  # a writable session: a write before its commit keeps the snapshot id
            if holds_virtual_chunks(store):  # its files are named by their state, not by the snapshot
                memo = {} if states is None else states
                if snapshot not in memo:
                    memo[snapshot] = referenced_state(store, snapshot)
                state, why = memo[snapshot], VIRTUAL_WHY
        elif root is None and type(store).__name__ == "ObjectStore":
            remote = store.store
        elif root is None and type(store).__name__ == "FsspecStore":
            remote = store  # versions from its filesystem's ``info`` (on the loop its session belongs to)
        meta = aa.metadata.to_dict()
        meta.pop("attributes", None)  # attributes do not change the stored bytes (CF decoding comes later)
        # the shape names only the chunks it cuts (``edges``): an archive appended to keeps the keys of
        # every whole chunk it had, and the edge chunk an append writes into is another key
        shape = meta.pop("shape", None)
        path = getattr(array, "path", "") or ""
        keys = cls(store_id, path, meta, snapshot=snapshot, local_root=root, remote=remote,
                   needs_version=root is None and (snapshot is None or why is not None),
                   store_name=store_label(store), state=state, unversioned=why)
        keys.edges(shape, tuple(aa.chunks))
        return keys

    def edges(self, shape: Any, chunks: tuple[int, ...]) -> None:
        """Name the array's ``shape`` in the keys of the chunks it cuts (of grid ``chunks``), and only
        theirs: where an array grows along a dim (an append), its whole chunks keep their keys and the
        last chunk along that dim, cut before and written into by the append, gets another (both tiers,
        whatever the store tells of versions: also ``immutable`` and the memory tier). The metadata
        hash leaves the shape out then. A chunk cut by a shrink is also named; one that a later growth
        makes whole again is named by its file's stat or its object's version, as every rewrite is."""
        shape = tuple(int(n) for n in shape)
        if len(shape) != len(chunks):
            raise ValueError(f"shape {shape} and chunks {chunks} differ in length")
        self._cut = tuple((ax, n // c) for ax, (n, c) in enumerate(zip(shape, chunks, strict=True)) if n % c)
        self._shape = "\0shape " + ",".join(map(str, shape))

    def _is_cut(self, chunk: tuple[int, ...]) -> bool:
        return any(chunk[ax] == last for ax, last in self._cut)

    def __repr__(self) -> str:
        return f"ChunkKey(array_path={self.array_path!r}, metadata={self.metadata_hash[:8]}, snapshot={self.snapshot})"


def _directory_identity(root: str, array_path: str) -> str:
    """Which directories the store's root and the array's are (device and inode, links followed): two
    ``stat`` per array and reader. ``"missing"`` for one that is not there."""
    out = []
    for path in (root, os.path.join(root, array_path)):
        try:
            st = os.stat(path)
            out.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            out.append("missing")
    return "\0dir " + " ".join(out)


def chunk_key(store_id: str, array_path: str, chunk: tuple[int, ...], metadata: bytes | str | dict[str, Any],
              snapshot: str | None = None, local_file: str | os.PathLike[str] | None = None) -> str:
    """The cache key of one chunk (``ChunkKey(store_id, array_path, metadata, snapshot).key(chunk, local_file)``).

    Parameters
    ----------
    store_id, array_path, metadata, snapshot
        As for ``ChunkKey``.
    chunk
        The chunk's grid coordinates.
    local_file
        The chunk's file, for a store that is a local directory.

    Returns
    -------
    str
        32 hex characters, the same in every process.
    """
    return ChunkKey(store_id, array_path, metadata, snapshot).key(chunk, local_file)



def _strip_url(url: str) -> str:
    """A URL without user info, query string or fragment (signatures and tokens live there)."""
    p = urlsplit(url)
    netloc = p.netloc.rsplit("@", 1)[-1]
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


def array_store(array: Any) -> Any:
    """The zarr store a ``zarr.Array`` (or ``AsyncArray``) reads from (None where it has none)."""
    aa = getattr(array, "async_array", array)
    return aa.store_path.store if hasattr(aa, "store_path") else getattr(array, "store", None)


def store_identity(store: Any) -> tuple[str, str | None] | None:
    """``(identity, local root or None)`` of a zarr store, or None where it has none that lasts.

    Only what locates the data goes in (scheme, bucket, endpoint, prefix, URL path), never
    credentials: obstore's ``config`` is read through an allow-list.
    """
    name = type(store).__name__
    if name == "IcechunkStore":
        return "icechunk:", None  # the snapshot id (random, unique) names the data
    if name == "LocalStore" and getattr(store, "root", None) is not None:
        root = os.path.abspath(os.fspath(store.root))
        return "file://" + root, root
    if name == "ObjectStore" and getattr(store, "store", None) is not None:
        obs = store.store
        oname = type(obs).__name__
        prefix = getattr(obs, "prefix", None)
        if oname == "LocalStore":
            root = os.path.abspath(os.fspath(prefix)) if prefix is not None else os.sep
            return "file://" + root, root
        if oname == "MemoryStore":
            return None
        located = _obstore_location(obs)
        if not located:
            return None
        located["prefix"] = "" if prefix is None else str(prefix)
        return f"{oname}:" + json.dumps(located, sort_keys=True), None
    if name == "FsspecStore" and getattr(store, "fs", None) is not None:
        protocol = store.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        path = str(getattr(store, "path", ""))
        if protocol in ("file", "local"):
            root = os.path.abspath(path)
            return "file://" + root, root
        url = _strip_url(path if "://" in path else f"{protocol}://{path}")
        located = _fsspec_location(store.fs)  # the endpoint: two servers may hold the same bucket and key
        if protocol in ("s3", "s3a") and not ({"endpoint_url", "endpoint"} & located.keys()):
            located.update(_from_env(_S3_ENDPOINT_ENV))  # botocore takes it from there
        return url + (" " + json.dumps(located, sort_keys=True) if located else ""), None
    return None


#: obstore's settings that say where the data is (never credentials), by store kind: each setting and the
#: environment variables obstore takes it from where it was not given (its ``config`` shows only what was)
_OBSTORE_LOCATED: dict[str, dict[str, tuple[str, ...]]] = {
    "S3Store": {"bucket": ("AWS_BUCKET", "AWS_BUCKET_NAME"), "endpoint": ("AWS_ENDPOINT", "AWS_ENDPOINT_URL"),
                "aws_endpoint_url_s3": ("AWS_ENDPOINT_URL_S3",)},
    "GCSStore": {"bucket": ("GOOGLE_BUCKET", "GOOGLE_BUCKET_NAME"), "base_url": ("GOOGLE_BASE_URL",)},
    "AzureStore": {"container_name": ("AZURE_CONTAINER_NAME",), "account_name": ("AZURE_STORAGE_ACCOUNT_NAME",),
                   "endpoint": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
                   "use_emulator": ("AZURE_STORAGE_USE_EMULATOR",)},
}
#: where there is no endpoint, the region names it (another partition: aws-cn, aws-us-gov)
_S3_REGION: dict[str, tuple[str, ...]] = {"region": ("AWS_REGION",), "default_region": ("AWS_DEFAULT_REGION",)}
#: the environment variables that give an S3 client (obstore's, botocore's) its endpoint
_S3_ENDPOINT_ENV = {k: v for k, v in _OBSTORE_LOCATED["S3Store"].items() if k != "bucket"}


def _from_env(names: dict[str, tuple[str, ...]], but: Any = ()) -> dict[str, str]:
    """``{setting: value}`` of the settings of ``names`` not in ``but`` that the environment gives (several
    variables of one setting that disagree: all of them, as the store's choice is not known here); URLs
    without user info or query."""
    out = {}
    for key, env in names.items():
        if key in but:
            continue
        got = list(dict.fromkeys(v for n in env if (v := os.environ.get(n, "").strip())))
        if got:
            out[key] = " ".join(_strip_url(v) if "://" in v else v for v in got)
    return out


def _obstore_location(obs: Any) -> dict[str, str]:
    """Where an obstore store's data is: the settings of ``_OBSTORE_LOCATED`` from its ``config``, else from
    the environment as obstore reads it (an endpoint set by ``AWS_ENDPOINT_URL`` is in no ``config``), an
    S3 store's region where no endpoint is given, and an ``HTTPStore``'s URL; never credentials."""
    config = getattr(obs, "config", None) or {}
    names = _OBSTORE_LOCATED.get(type(obs).__name__, {})
    allowed = ("bucket", "container_name", "account_name", "endpoint", "url", *names)
    located = {k: str(v) for k, v in config.items() if k in allowed}
    located.update(_from_env(names, but=located))
    if type(obs).__name__ == "S3Store" and not ({"endpoint", "aws_endpoint_url_s3"} & located.keys()):
        located.update({k: str(config[k]) for k in _S3_REGION if config.get(k)})
        located.update(_from_env(_S3_REGION, but=located))
    url = getattr(obs, "url", None)
    if url is not None:
        located["url"] = _strip_url(str(url))
    for k in ("endpoint", "aws_endpoint_url_s3", "base_url"):
        if k in located and "://" in located[k]:
            located[k] = _strip_url(located[k])
    return located


#: fsspec filesystem options that say where the data is (never credentials): read through this allow-list
_FSSPEC_LOCATED = ("endpoint_url", "endpoint", "host", "port", "account_name", "account_url", "project",
                   "base_url", "url")


def _fsspec_location(fs: Any) -> dict[str, str]:
    """Where an fsspec filesystem's data is, beyond its paths: its endpoint, host, account... from its
    ``storage_options`` (and their ``client_kwargs``) through an allow-list; URLs without user info
    or query."""
    opts = dict(getattr(fs, "storage_options", None) or {})
    client = opts.get("client_kwargs")
    if isinstance(client, dict):
        opts = {**{k: v for k, v in client.items() if k in _FSSPEC_LOCATED}, **opts}
    endpoint = getattr(fs, "endpoint_url", None)
    if endpoint:
        opts.setdefault("endpoint_url", endpoint)
    located = {}
    for k in _FSSPEC_LOCATED:
        v = opts.get(k)
        if v not in (None, ""):
            located[k] = _strip_url(str(v)) if "://" in str(v) else str(v)
    return located


def store_label(store: Any) -> str:
    """A zarr store as messages name it: its URL, or scheme, bucket and prefix, and the endpoint where one
    was given; never credentials or query strings."""
    name = type(store).__name__
    if name == "ObjectStore" and getattr(store, "store", None) is not None:
        obs = store.store
        url = getattr(obs, "url", None)
        if url:
            return _strip_url(str(url))
        config = _obstore_location(obs)
        scheme = {"S3Store": "s3", "GCSStore": "gs", "AzureStore": "az"}.get(type(obs).__name__, type(obs).__name__)
        prefix = getattr(obs, "prefix", None)
        label = f"{scheme}://{config.get('bucket') or config.get('container_name') or ''}"
        label += f"/{prefix}" if prefix else ""
        endpoint = config.get("aws_endpoint_url_s3") or config.get("endpoint") or config.get("base_url")
        return label + (f" at {endpoint}" if endpoint else "")
    if name == "FsspecStore" and getattr(store, "fs", None) is not None:
        protocol = store.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        path = str(getattr(store, "path", ""))
        label = _strip_url(path if "://" in path else f"{protocol}://{path}")
        endpoint = _fsspec_location(store.fs).get("endpoint_url")
        return label + (f" at {endpoint}" if endpoint and endpoint not in label else "")
    ident = store_identity(store)
    return ident[0] if ident is not None else name
