"""``ByIdentity``: answers kept by an object's identity, never read by another object born at its address."""

from __future__ import annotations

from xinsitu.stores.memo import ByIdentity


class Store:
    pass


def test_an_answer_is_the_objects_own_and_by_key():
    memo: ByIdentity[int] = ByIdentity(8)
    a, b = Store(), Store()
    memo.put(a, "g", 1)
    memo.put(a, "h", 2)
    assert (memo.get(a, "g"), memo.get(a, "h"), memo.get(a, "x"), memo.get(b, "g")) == (1, 2, None, None)


def test_strong_answers_hold_their_object_so_no_other_takes_its_id():
    memo: ByIdentity[int] = ByIdentity(8)
    memo.put(Store(), None, 1)
    assert sum(memo.get(Store()) == 1 for _ in range(100)) == 0


def test_at_most_size_answers_the_oldest_dropped_first():
    memo: ByIdentity[int] = ByIdentity(3)
    keep = [Store() for _ in range(5)]
    for i, s in enumerate(keep):
        memo.put(s, None, i)
    assert len(memo) == 3 and [memo.get(s) for s in keep] == [None, None, 2, 3, 4]
