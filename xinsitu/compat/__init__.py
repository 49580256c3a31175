"""Layer 1: every use of zarr's and VirtualiZarr's private API, in one place each, feature-detected.

``zarr_api`` (codec pipelines, chunk specs, the prototype buffer) and ``virtualizarr_api`` (manifest
stores and their registries): metadata only, no I/O of their own. A new zarr or VirtualiZarr release
that moves something is mended here and nowhere else.
"""
