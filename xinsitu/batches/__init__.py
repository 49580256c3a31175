"""Layer 3: batches, and the one-pass jobs that read like them.

``generator`` (``BatchGenerator``: configuration, epochs, state), ``pipeline`` (one epoch: the I/O loop
reading ahead, the prefetch thread, the caller), ``buffer`` (shuffle buffers of chunk blocks and the
gather), ``direct`` (batches filled in place where a chunk block is one sample), ``output`` (values to the
output's kind, channels, ``dtype=``), ``device_copy`` (pinned copies to a GPU), ``mapstyle`` (the
map-style dataset), ``torch_dataset``, ``stats`` and ``validity`` (one pass over a split), ``moments``
(the per-channel moments ``stats`` reduces chunks to, summed exactly), ``describe`` (a generator's repr).
"""
