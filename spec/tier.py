"""The offload tier: what a CPU tier manager must do (vLLM's ``OffloadingManager`` contract).

Entries are keyed by offload-block hash. A store is two-phase: ``prepare_store`` reserves not-ready entries for the
keys not present that admission takes (all or nothing) and marks the present ones used; ``complete_store`` makes the
reserved entries ready, or removes them. A load pins ready entries (``prepare_load``) until ``complete_load``. Only
ready, unpinned entries are evicted; which ones is the eviction policy's choice: LRU or ARC.

An entry goes *stale* when a load of it fails (a persistent fault would fail it again, and the engine would
recompute and load it forever) or when the tier is reset (a weight update made its KV wrong): it is never served
again, and it goes as soon as no transfer is in flight on it. Its key comes back only when it is stored afresh.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Iterator

from attrs import define, field

from .invariants import Violation
from .types import Event, Key


@define
class Entry:
    ready: bool = False
    refs: int = 0  # in-flight loads
    stale: bool = False  # never served again; removed once no transfer is in flight on it


@define
class LRU:
    """Least recently used first."""

    order: dict[Key, None] = field(factory=dict)

    def insert(self, key: Key) -> None:
        self.order[key] = None

    def touch(self, key: Key) -> None:
        self.order[key] = self.order.pop(key)

    def remove(self, key: Key) -> None:
        del self.order[key]

    def victims(self, n: int, evictable: Callable[[Key], bool], incoming: list[Key]) -> list[Key] | None:
        found = list(islice((key for key in self.order if evictable(key)), n))
        return found if len(found) == n else None

    evict = remove

    def keys(self) -> list[Key]:
        return list(self.order)

    def state(self) -> tuple[object, ...]:
        return ()


@define
class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003, figure 4). ``t1`` holds keys used once since they
    entered, ``t2`` keys used again; ``b1``/``b2`` remember keys evicted from each (ghosts). A key that comes back
    from ``b1`` says ``t1`` was too small: its target size ``p`` grows; one from ``b2`` shrinks it. REPLACE evicts
    from ``t1`` while it is above target, else from ``t2``. The ghost lists are bounded: |t1|+|b1| <= c and
    |t1|+|t2|+|b1|+|b2| <= 2c.

    Where a tier is not a page cache: entries are evicted only when a store needs room (not on every miss), only
    ready, unpinned ones (REPLACE falls back to the other list when its list has none), and an entry can also leave
    without eviction (a failed store, a stale one): it leaves no ghost."""

    capacity: int
    t1: dict[Key, None] = field(factory=dict)
    t2: dict[Key, None] = field(factory=dict)
    b1: dict[Key, None] = field(factory=dict)
    b2: dict[Key, None] = field(factory=dict)
    p: int = 0

    def target(self, key: Key) -> int:
        """``p`` once ``key`` enters: a ``b1`` ghost grows it, a ``b2`` ghost shrinks it (cases II and III; the
        paper's ratios rounded down)."""
        if key in self.b1:
            return min(self.capacity, self.p + max(len(self.b2) // len(self.b1), 1))
        if key in self.b2:
            return max(0, self.p - max(len(self.b1) // len(self.b2), 1))
        return self.p

    def insert(self, key: Key) -> None:
        """A miss: the key enters; a ghost goes to ``t2`` (cases II and III), a new key to ``t1`` (case IV)."""
        self.p = self.target(key)
        if key in self.b1 or key in self.b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        if len(self.t1) + len(self.t2) <= self.capacity:  # else the tier evicts next, and bounds them then
            self._bound_ghosts()

    def touch(self, key: Key) -> None:
        """A hit (case I): most recently used in ``t2``."""
        (self.t1 if key in self.t1 else self.t2).pop(key)
        self.t2[key] = None

    def remove(self, key: Key) -> None:
        (self.t1 if key in self.t1 else self.t2).pop(key)

    def victims(self, n: int, evictable: Callable[[Key], bool], incoming: list[Key]) -> list[Key] | None:
        """REPLACE, ``n`` times, with the target the incoming key sets: from ``t1`` if it is above target (or at
        target and the incoming key is a ``b2`` ghost), else from ``t2``; the least recently used evictable key of
        that list, or else of the other."""
        from_t1: Iterator[Key] = (k for k in self.t1 if evictable(k))
        from_t2: Iterator[Key] = (k for k in self.t2 if evictable(k))
        t1_size, found = len(self.t1), list[Key]()
        p = self.target(incoming[0]) if incoming else self.p
        returning_from_b2 = bool(incoming) and incoming[0] in self.b2
        while len(found) < n:
            use_t1 = t1_size > p or (t1_size == p and returning_from_b2)
            first, second = (from_t1, from_t2) if use_t1 else (from_t2, from_t1)
            key = next(first, None)
            if key is None:
                key = next(second, None)
            if key is None:
                return None
            t1_size -= key in self.t1
            found.append(key)
        return found

    def evict(self, key: Key) -> None:
        resident, ghosts = (self.t1, self.b1) if key in self.t1 else (self.t2, self.b2)
        del resident[key]
        ghosts[key] = None
        self._bound_ghosts()

    def _bound_ghosts(self) -> None:
        while len(self.t1) + len(self.b1) > self.capacity and self.b1:
            del self.b1[next(iter(self.b1))]
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity and self.b2:
            del self.b2[next(iter(self.b2))]

    def keys(self) -> list[Key]:
        return [*self.t1, *self.t2]

    def state(self) -> tuple[object, ...]:
        return self.p, tuple(self.t1), tuple(self.b1), tuple(self.b2)


POLICIES: dict[str, Callable[[int], LRU | ARC]] = {"lru": lambda capacity: LRU(), "arc": ARC}  # name -> factory


@define
class Admission:
    """Which of the keys it lacks a tier takes when requests offer them (``Config.store_threshold``): a key offered
    ``threshold`` times, counting the offers of the ``remembered`` keys offered last (the least recently offered
    is forgotten first). A threshold of 1 takes every key, and counts nothing."""

    threshold: int = 1
    remembered: int = 65536
    offers: dict[Key, int] = field(factory=dict)  # key -> times offered, least recently offered first

    def offer(self, keys: list[Key]) -> None:
        if self.threshold == 1:
            return
        for key in keys:
            self.offers[key] = self.offers.pop(key, 0) + 1
        while len(self.offers) > self.remembered:
            del self.offers[next(iter(self.offers))]

    def takes(self, key: Key) -> bool:
        return self.threshold == 1 or self.offers.get(key, 0) >= self.threshold


@define
class Tier:
    capacity: int
    policy: LRU | ARC = field()
    entries: dict[Key, Entry] = field(factory=dict)
    events: list[Event] = field(factory=list)
    admission: Admission = field(factory=Admission)

    @policy.default
    def _lru(self) -> LRU:
        return LRU()

    @classmethod
    def with_policy(cls, name: str, capacity: int, admission: Admission | None = None) -> Tier:
        return cls(capacity, POLICIES[name](capacity), admission=admission or Admission())

    def lookup(self, keys: list[Key]) -> int:
        """How many leading keys are ready to load."""
        n = 0
        while n < len(keys) and self._loadable(keys[n]):
            n += 1
        return n

    def _loadable(self, key: Key) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.ready and not entry.stale

    def prepare_load(self, keys: list[Key]) -> None:
        """Pin the entries a load reads and mark them used."""
        for key in keys:
            if not self._loadable(key):
                raise Violation("LOOKUP", f"key {key:#x} was promised at lookup but is not loadable at alloc")
            self.entries[key].refs += 1
            self.policy.touch(key)

    def pin(self, keys: list[Key]) -> None:
        """Pin ready entries that a put into the shared store reads (unpinned by ``complete_load``)."""
        for key in keys:
            self.entries[key].refs += 1

    def complete_load(self, keys: list[Key], success: bool = True) -> None:
        """Unpin; a failed load makes its entries stale."""
        for key in keys:
            entry = self.entries[key]
            entry.refs -= 1
            entry.stale |= not success
            if entry.stale and not entry.refs:
                self._remove([key])

    def prepare_store(self, keys: list[Key], refuse: bool = False, fetched: bool = False) -> list[Key] | None:
        """Reserve entries for the keys not present that the tier takes, and mark the present ones used; None,
        changing no entry, if there is no room (or ``refuse``: fault injection, as if there were none). Keys a
        request offers go through admission, their offers counted first (a refusal says nothing against a block);
        records ``fetched`` from a shared store for a hit are always taken. The keys reserved."""
        if not fetched:
            self.admission.offer(keys)
        fresh = [k for k in keys if k not in self.entries and (fetched or self.admission.takes(k))]
        short = max(len(self.entries) + len(fresh) - self.capacity, 0)
        victims = self.policy.victims(short, lambda k: self.entries[k].ready and not self.entries[k].refs
                                      and k not in keys, fresh)
        if fresh and (refuse or victims is None):
            return None
        for key in victims or ():
            del self.entries[key]
        for key in keys:
            if key in self.entries:
                self.policy.touch(key)
            elif key in fresh:
                self.entries[key] = Entry()
                self.policy.insert(key)
        for key in victims or ():  # after the inserts: ARC adapts its target to the ghosts as they were (case II)
            self.policy.evict(key)
        if victims:
            self.events.append(Event("removed", tuple(victims)))
        return fresh

    def complete_store(self, keys: list[Key], success: bool) -> list[Key]:
        """Make the reserved entries ready; a failed store, or one reset meanwhile, leaves no entry behind. The keys
        made ready."""
        stored = [key for key in keys if success and not self.entries[key].stale]
        for key in keys:
            if key in stored:
                self.entries[key].ready = True
            else:
                del self.entries[key]
                self.policy.remove(key)
        if stored:
            self.events.append(Event("stored", tuple(stored)))
        return stored

    def reset(self) -> None:
        """Forget every entry: the idle ones now, those with transfers in flight once the transfers end."""
        for entry in self.entries.values():
            entry.stale = True
        self._remove([key for key in self.policy.keys() if self.entries[key].ready and not self.entries[key].refs])

    def _remove(self, keys: list[Key]) -> None:
        """Drop ready entries, announcing it."""
        for key in keys:
            del self.entries[key]
            self.policy.remove(key)
        if keys:
            self.events.append(Event("removed", tuple(keys)))

    def view(self) -> tuple[tuple[Key, bool, int], ...]:
        """(key, ready, refs) in the policy's order: what ``Observation.tier`` reports."""
        return tuple((k, self.entries[k].ready, self.entries[k].refs) for k in self.policy.keys())
