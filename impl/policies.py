"""Production eviction policies for the CPU tier: LRU and ARC on ordered dicts, O(1) per use, victim search that
stops at the first evictable keys. Written apart from the spec's plain policies (``kvoffload.spec.tier``), so the
exact comparison of the stateful suite checks these against those."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

Key = int


class LRUPolicy:
    def __init__(self, capacity: int) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()  # least recently used first

    def insert(self, key: Key) -> None:
        self.order[key] = None

    def touch(self, key: Key) -> None:
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        del self.order[key]

    evict = remove

    def victims(self, n: int, evictable: Callable[[Key], bool], incoming: list[Key]) -> list[Key] | None:
        found: list[Key] = []
        for key in self.order:
            if len(found) == n:
                break
            if evictable(key):
                found.append(key)
        return found if len(found) == n else None

    def keys(self) -> list[Key]:
        return list(self.order)

    def state(self) -> tuple[object, ...]:
        return ()


class ARCPolicy:
    """ARC (Megiddo & Modha 2003) as a tier policy: see ``kvoffload.spec.tier.ARC`` for where a tier differs from
    a page cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.p = capacity, 0
        self.t1: OrderedDict[Key, None] = OrderedDict()  # resident, used once
        self.t2: OrderedDict[Key, None] = OrderedDict()  # resident, used again
        self.b1: OrderedDict[Key, None] = OrderedDict()  # ghosts of t1
        self.b2: OrderedDict[Key, None] = OrderedDict()  # ghosts of t2

    def _target(self, key: Key) -> int:
        if key in self.b1:
            return min(self.capacity, self.p + max(len(self.b2) // len(self.b1), 1))
        if key in self.b2:
            return max(0, self.p - max(len(self.b1) // len(self.b2), 1))
        return self.p

    def insert(self, key: Key) -> None:
        self.p = self._target(key)
        if key in self.b1 or key in self.b2:  # a ghost comes back: used again
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        if len(self.t1) + len(self.t2) <= self.capacity:  # else an eviction follows and trims
            self._trim()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]

    def evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        self._trim()

    def _trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            self.b2.popitem(last=False)

    def victims(self, n: int, evictable: Callable[[Key], bool], incoming: list[Key]) -> list[Key] | None:
        lists = (iter(self.t1), iter(self.t2))
        t1_left, found = len(self.t1), list[Key]()
        p = self._target(incoming[0]) if incoming else self.p
        tie_to_t1 = bool(incoming) and incoming[0] in self.b2
        while len(found) < n:
            prefer = 0 if t1_left > p or (t1_left == p and tie_to_t1) else 1
            key = _next_evictable(lists[prefer], evictable)
            if key is None:
                key = _next_evictable(lists[1 - prefer], evictable)
                if key is None:
                    return None
            if key in self.t1:
                t1_left -= 1
            found.append(key)
        return found

    def keys(self) -> list[Key]:
        return [*self.t1, *self.t2]

    def state(self) -> tuple[object, ...]:
        return self.p, tuple(self.t1), tuple(self.b1), tuple(self.b2)


def _next_evictable(keys, evictable: Callable[[Key], bool]) -> Key | None:
    for key in keys:
        if evictable(key):
            return key
    return None


POLICIES: dict[str, Callable[[int], LRUPolicy | ARCPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
