"""A zarr ``LocalStore`` that logs every key it serves (with the reading process id), to
see which process read which chunk. Its type name is not ``LocalStore``, so xinsitu reads
it through the store's own ``get``, in every process (DataLoader workers included)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import zarr.storage

ENV = "XINSITU_TEST_KEYLOG"


class KeyLogStore(zarr.storage.LocalStore):
    """Appends ``pid key`` to the file named by ``$XINSITU_TEST_KEYLOG`` on every ``get``."""

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        path = os.environ.get(ENV)
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{os.getpid()} {key}\n".encode())  # one small O_APPEND write: atomic
            finally:
                os.close(fd)
        return await super().get(key, prototype, byte_range)


def chunk_reads(path: str, variables: list[str]) -> dict[int, list[str]]:
    """``{pid: [chunk keys of these variables, in read order]}`` from a log file."""
    out: dict[int, list[str]] = defaultdict(list)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        for line in f:
            pid, key = line.split()
            if key.split("/")[0] in variables and "/c/" in key:
                out[int(pid)].append(key)
    return dict(out)
