"""Sizes and memory budgets of the chunk cache: ``"4GB"`` to bytes, the memory this process may
still use (cgroup limits included), the memory tier's default budget."""

from __future__ import annotations

import math
import os
import re

import numpy as np

#: ``memory="auto"``: this share of the memory available when the cache is made ...
AUTO_MEMORY_SHARE = 0.25
#: ... capped at this many bytes
AUTO_MEMORY_CAP = 32 * 2**30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Bytes from an int or a string such as ``"4GB"``, ``"500MiB"``, ``"1.5 GiB"`` (decimal kB/MB/GB,
    binary KiB/MiB/GiB).

    Parameters
    ----------
    value
        A number of bytes, or a number followed by a unit.
    name
        The argument's name, for the error message.

    Returns
    -------
    int
        The number of bytes (at least 0).
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string like '4GB', not {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of bytes, at least 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a number of bytes or a string like '4GB', not {type(value).__name__}")
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}={value!r} is not a size; write e.g. 4GB, 500MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[unit])


def _fmt(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def available_memory() -> int:
    """Bytes of memory this process could still use: the kernel's ``MemAvailable``, or less where a
    cgroup (a container, a batch job) sets a lower limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            avail = 4 * 2**30  # no way to ask (macOS, Windows): a budget of 1 GB then
    try:  # cgroup v2: a job's limit, usually far below what the host has free
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            avail = min(avail, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return int(avail)


def auto_memory_budget() -> int:
    """The memory tier's default budget: ``AUTO_MEMORY_SHARE`` of the memory available now, at most
    ``AUTO_MEMORY_CAP``. Per process: DataLoader workers and DDP ranks each hold their own."""
    return int(min(AUTO_MEMORY_SHARE * available_memory(), AUTO_MEMORY_CAP))
