"""Layer 2: decoded chunks kept across epochs and runs.

``chunk_cache`` (``ChunkCache``: keys and versions, the memory tier, the disk tier and its trust checks),
``lookup`` (the reader's cache hits, put in place before any fetch), ``device_tier`` (chunks kept in GPU
memory).
"""

from xinsitu.cache.chunk_cache import ChunkCache

__all__ = ["ChunkCache"]
