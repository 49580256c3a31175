"""Waiting out the files' clock: a reader that began within ``FILE_CLOCK_SLACK_NS`` of a file's last write cannot
tell it from a write after its start, and reads the file again (racy git's case). Tests that count the cache's
hits of a second reader wait until every file they wrote is older than that."""

from __future__ import annotations

import os
import time

from xinsitu.cache.keys import file_clock_ns


def past_the_writes(root: str | os.PathLike) -> None:
    """Return once ``file_clock_ns()`` is past the change time of every file under ``root`` (a few ms)."""
    newest = max((os.stat(os.path.join(d, f)).st_ctime_ns for d, _, fs in os.walk(root) for f in fs), default=0)
    while file_clock_ns() <= newest:
        time.sleep(0.002)
