"""Answers kept about objects by their identity: what one metadata read or one sampled object said of a store or
a server, asked again for every generator of a process."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class ByIdentity(Generic[V]):
    """Answers by ``(object, key)``: the object's ``id`` keys them while the object is held beside its answer,
    so an object born later at a freed object's address never reads the old answer. At most ``size``
    answers, the oldest dropped first."""

    def __init__(self, size: int):
        self.size = size
        self._kept: OrderedDict[tuple[int, Hashable], tuple[Any, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, obj: Any, key: Hashable = None) -> V | None:
        hit = self._kept.get((id(obj), key))
        return hit[1] if hit is not None and hit[0] is obj else None

    def put(self, obj: Any, key: Hashable, value: V) -> None:
        at = (id(obj), key)
        with self._lock:
            self._kept[at] = (obj, value)
            self._kept.move_to_end(at)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)
