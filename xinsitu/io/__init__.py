"""Layer 2: the reader and the machinery under it.

``loop`` (the one I/O event loop and its decode threads: lazy, fork-aware, every wait bounded),
``reader`` (``Reader``: regions and whole chunks read once each, the route of an array chosen once),
``fetchers`` (the read strategies: local files in the decode threads, callbacks, shards by byte range),
``place`` (the one completion step a chunk lands through, and its destinations), ``inflight`` (the
in-flight limit and its policy), ``mempool`` (reused memory).
"""
