"""Answers kept about objects by their identity: what one metadata read or one sampled object said of a store, a
server or a file set, asked again for every generator of a process."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class ByIdentity(Generic[V]):
    """Answers by ``(object, key)``: the object's ``id`` keys them while the object is held beside its answer,
    so an object born later at a freed object's address never reads the old answer. ``weak``: the object is
    held by a weak reference and its answers go with it (a store that holds large manifests); one that takes
    no weak reference is held. At most ``size`` answers, the oldest dropped first."""

    def __init__(self, size: int, *, weak: bool = False):
        self.size, self.weak = size, weak
        self._kept: OrderedDict[tuple[int, Hashable], tuple[Any, V]] = OrderedDict()

    def get(self, obj: Any, key: Hashable = None) -> V | None:
        hit = self._kept.get((id(obj), key))
        if hit is None:
            return None
        held = hit[0]() if isinstance(hit[0], weakref.ref) else hit[0]
        return hit[1] if held is obj else None

    def put(self, obj: Any, key: Hashable, value: V) -> None:
        at = (id(obj), key)
        held: Any = obj
        if self.weak:
            def gone(ref: weakref.ref) -> None:
                if self._kept.get(at, (None,))[0] is ref:
                    del self._kept[at]

            try:
                held = weakref.ref(obj, gone)
            except TypeError:
                pass
        self._kept[at] = (held, value)
        self._kept.move_to_end(at)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)
