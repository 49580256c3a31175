"""Layer 2: a chunk's stored bytes to values.

``cpu`` (``ChunkDecoder``: zarr's codec chain decoded in one synchronous call where it can, straight into
a destination where the chain allows) and ``gpu`` (which chains nvCOMP decodes bit for bit, the batched
device decoder, its CPU stand-in, and ``decode="auto"``'s measurement).
"""
