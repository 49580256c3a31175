"""Layer 2: a chunk's stored bytes to values.

``cpu`` (``ChunkDecoder``: zarr's codec chain decoded in one synchronous call where it can, straight into
a destination where the chain allows) and the GPU path: ``gpu_chain`` (which chains nvCOMP decodes bit for
bit, and the payload it decodes of a chunk), ``staging`` (page-locked staging of a buffer's chunks),
``nvcomp`` (the batched device decoder, its CPU stand-in, and the lifetimes of their streams and codecs),
``gpu_batch`` (a buffer's chunks decoded together, and ``decode="auto"``'s measurement) and ``gpu`` (the
device sides and which path each variable takes).
"""
