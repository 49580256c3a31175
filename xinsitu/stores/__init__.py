"""Layer 2: from a URL or a store object to bytes, bounded and retried.

``opening`` (``xinsitu.open_zarr``: a URL, a path or a store object to a lazy Dataset), ``backend``
(one backend per store kind: local files, obstore, zarr stores, virtual references; their errors),
``reads`` (deadlines and retries of every request), ``zarr_store`` and ``virtual_store`` (the zarr and
VirtualiZarr sides), ``redact`` (no credential in a message, a repr or a log).
"""
