"""Layer 2: decoded chunks kept across epochs and runs.

``chunk_cache`` (``ChunkCache``: the memory tier, and what a tier could not keep), ``disk_tier`` (the disk
tier: entry files, eviction, and its trust checks), ``keys`` (what names a chunk: ``ChunkKey``, object
versions, store identities), ``budget`` (sizes and the memory tier's default budget), ``lookup`` (the reader's
cache hits, put in place before any fetch), ``device_tier`` (chunks kept in GPU memory), ``virtual_refs``
(Icechunk repositories whose virtual chunks are files a snapshot does not name).
"""

from xinsitu.cache.chunk_cache import ChunkCache

__all__ = ["ChunkCache"]
