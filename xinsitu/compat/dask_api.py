"""The one place xinsitu touches dask's private API: its task spec (``dask._task_spec``, dask 2024.12 and
newer), with which ``xinsitu.index.dask_trace`` runs a variable's graph over stored positions, each task once,
in this thread (4x quicker than dask's public synchronous scheduler, ``dask.get``, which orders and tracks far
more than a graph of selections needs).

- ``DataNode``: a literal value in the graph (the positions a wrapper of the zarr array covers);
- ``GraphNode``: a task of the spec, which names its own dependencies and is called with their values;
- ``convert_legacy_graph``: a graph of tuples (the legacy spec) as tasks of the new one.

Feature-detected, never by version: ``task_spec()`` is None where they are missing, and the tracing falls
back to ``dask.get``. ``tests/compat/test_compat.py`` holds each symbol named here.
"""

from __future__ import annotations

from typing import Any


def task_spec() -> tuple[Any, Any, Any] | None:
    """``(DataNode, GraphNode, convert_legacy_graph)`` of dask's task spec; None where this dask has none."""
    try:
        from dask._task_spec import DataNode, GraphNode, convert_legacy_graph
    except ImportError:  # a dask before its task spec (2024.12)
        return None
    return DataNode, GraphNode, convert_legacy_graph
