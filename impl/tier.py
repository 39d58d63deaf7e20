"""The production CPU tier: slot arrays, O(1) lookups, eviction work proportional to the victims.

Which entries to evict is the eviction policy's decision (``policies``: LRU and ARC, whose victim search stops as
soon as it has enough); the tier adds host slots, counters, events.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

from kvoffload.spec.types import Event, Key

from .policies import POLICIES


class OffloadTier:
    def __init__(self, capacity: int, policy: str = "lru", store_threshold: int = 1,
                 offers_remembered: int = 65536) -> None:
        self.capacity = capacity
        # admission: times each key was offered, least recently offered first (none counted at a threshold of 1)
        self.store_threshold, self.offers_remembered = store_threshold, offers_remembered
        self.offers: OrderedDict[Key, int] | None = OrderedDict() if store_threshold > 1 else None
        self.policy = POLICIES[policy](capacity)
        self.slot_of: dict[Key, int] = {}
        self.ready = bytearray(capacity)  # by slot
        self.stale = bytearray(capacity)  # by slot: a load failed or the tier was reset; dropped once idle
        self.refs = [0] * capacity  # by slot: in-flight loads
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot
        self.events: list[Event] = []
        self.refusals = self.evictions = 0
        self.unadmitted = 0  # offered blocks the tier lacked and admission left out

    def is_ready(self, key: Key) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and bool(self.ready[slot]) and not self.stale[slot]

    # ``is_ready`` over many keys, inlined: a lookup's question for the shared store
    def missing(self, keys: list[Key]) -> list[Key]:
        slot_of, ready, stale = self.slot_of, self.ready, self.stale
        return [key for key in keys if (slot := slot_of.get(key)) is None or not ready[slot] or stale[slot]]

    def _evictable(self, key: Key) -> bool:
        slot = self.slot_of[key]
        return bool(self.ready[slot]) and not self.refs[slot]

    def prepare_load(self, keys: list[Key]) -> list[int]:
        slots = []
        for key in keys:
            slot = self.slot_of[key]
            self.refs[slot] += 1
            self.policy.touch(key)
            slots.append(slot)
        return slots

    def pin_ready(self, keys: list[Key]) -> tuple[list[Key], list[int]]:
        """A put into the shared store reads those of these entries the tier still holds, ready: not evicted until
        it ends (``unpin``). Those keys, and their slots."""
        slot_of, ready, stale, refs = self.slot_of, self.ready, self.stale, self.refs
        held, slots = [], []
        for key in keys:
            slot = slot_of.get(key)
            if slot is not None and ready[slot] and not stale[slot]:
                refs[slot] += 1
                held.append(key)
                slots.append(slot)
        return held, slots

    def unpin(self, keys: list[Key]) -> None:
        """A put ended: its entries may be evicted again (one the tier dropped meanwhile leaves now)."""
        slot_of, refs, stale = self.slot_of, self.refs, self.stale
        for key in keys:
            slot = slot_of[key]
            refs[slot] -= 1
            if stale[slot] and not refs[slot]:
                self._remove([key])

    def complete_load(self, keys: list[Key], success: bool = True) -> None:
        for key in keys:
            slot = self.slot_of[key]
            self.refs[slot] -= 1
            self.stale[slot] |= not success  # a persistent fault would fail it again: never offer it again
            if self.stale[slot] and not self.refs[slot]:
                self._remove([key])

    def prepare_store(self, keys: list[Key], refuse: bool = False, fetched: bool = False,
                      gpu_blocks: list[int] | None = None) -> dict[Key, int] | None:
        """Host slots for the keys not present that it takes (a request's offers: once offered ``store_threshold``
        times; records ``fetched`` for a hit: all), present ones counting as used; None and no slot changed if no
        room (or ``refuse``: an injected allocation failure). ``gpu_blocks`` (each key's first GPU block): the new
        keys' slots ascend as their blocks do."""
        new = [key for key in keys if key not in self.slot_of]
        taken: set[Key] | None = None  # None: every new key
        if self.offers is not None and not fetched:
            self._count_offers(keys)
            offered, new = len(new), [key for key in new if self.offers.get(key, 0) >= self.store_threshold]
            self.unadmitted += offered - len(new)
            taken = set(new)
        short = len(new) - len(self.free)
        victims: list[Key] | None = []
        if short > 0:
            protected = set(keys)
            victims = self.policy.victims(short, lambda k: k not in protected and self._evictable(k), new)
        if new and (refuse or victims is None):
            self.refusals += 1
            return None
        slot_of, free, policy, slots = self.slot_of, self.free, self.policy, {}
        for key in victims or ():
            free.append(slot_of.pop(key))
        for key in keys:
            if key in slot_of:
                policy.touch(key)
            elif taken is None or key in taken:
                slot = slots[key] = slot_of[key] = free.pop()
                self.ready[slot] = self.stale[slot] = 0
                policy.insert(key)
        if gpu_blocks is not None and len(slots) > 1:
            self._follow_blocks(slots, dict(zip(keys, gpu_blocks)))
        if victims:
            for key in victims:  # after the inserts: ARC's target follows the ghosts as they were
                policy.evict(key)
            self.evictions += len(victims)
            self.events.append(Event("removed", tuple(victims)))
        return slots

    def _follow_blocks(self, slots: dict[Key, int], block_of: dict[Key, int]) -> None:
        """Hands the same slots out again, ascending as the keys' GPU blocks do. vLLM frees a request's blocks tail
        first, so a later request's blocks descend through its tokens; slots in token order made its store, and its
        load into blocks handed out the same way, copy backwards through memory on one side: 32 MiB took 1.55 ms in
        vLLM's CPU engine here, and 0.95 ms (memcpy's speed) as the one forward run that following the blocks makes."""
        for key, slot in zip(sorted(slots, key=block_of.__getitem__), sorted(slots.values())):
            slots[key] = self.slot_of[key] = slot

    def _count_offers(self, keys: list[Key]) -> None:
        offers = cast("OrderedDict[Key, int]", self.offers)
        for key in keys:
            offers[key] = offers.pop(key, 0) + 1
        while len(offers) > self.offers_remembered:
            offers.popitem(last=False)

    def complete_store(self, keys: list[Key], success: bool) -> list[Key]:
        """The reserved entries become ready; failed or reset ones leave. The keys that became ready."""
        stored = []
        for key in keys:
            slot = self.slot_of[key]
            if success and not self.stale[slot]:  # stale: the tier was reset while it was being stored
                self.ready[slot] = 1
                stored.append(key)
            else:
                self.free.append(self.slot_of.pop(key))
                self.policy.remove(key)
        if stored:
            self.events.append(Event("stored", tuple(stored)))
        return stored

    def reset(self) -> None:
        """Forget every entry: idle ones now, the others once their transfers end (never served again)."""
        for slot in self.slot_of.values():
            self.stale[slot] = 1
        idle = [key for key in self.policy.keys() if self.ready[self.slot_of[key]] and not self.refs[self.slot_of[key]]]
        self._remove(idle)

    def _remove(self, keys: list[Key]) -> None:
        for key in keys:
            self.free.append(self.slot_of.pop(key))
            self.policy.remove(key)
        if keys:
            self.events.append(Event("removed", tuple(keys)))

    def view(self) -> tuple[tuple[Key, bool, int], ...]:
        return tuple((k, bool(self.ready[self.slot_of[k]]), self.refs[self.slot_of[k]]) for k in self.policy.keys())
