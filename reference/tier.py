"""An LRU CPU tier with slots: each entry owns ``k`` rows of the host buffer."""

from __future__ import annotations

from collections import OrderedDict

from attrs import define

from kvoffload.spec.types import Event, Key


@define
class Slot:
    index: int  # which k-row slice of the host buffer holds this entry
    ready: bool = False
    refs: int = 0
    stale: bool = False  # a load of it failed, or the tier was reset: never served, dropped when idle


class LRUTier:
    def __init__(self, capacity: int, store_threshold: int = 1, offers_remembered: int = 65536) -> None:
        self.capacity = capacity
        self.store_threshold, self.offers_remembered = store_threshold, offers_remembered
        self.offers: OrderedDict[Key, int] = OrderedDict()  # times offered, least recently offered first
        self.slots: OrderedDict[Key, Slot] = OrderedDict()  # least recently used first
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self.events: list[Event] = []
        self.refusals = 0  # prepare_store calls that found no room

    def lookup(self, keys: list[Key]) -> int:
        for n, key in enumerate(keys):
            slot = self.slots.get(key)
            if slot is None or not slot.ready or slot.stale:
                return n
        return len(keys)

    def prepare_load(self, keys: list[Key]) -> list[int]:
        for key in keys:
            self.slots[key].refs += 1
            self.slots.move_to_end(key)
        return [self.slots[key].index for key in keys]

    def complete_load(self, keys: list[Key], success: bool = True) -> None:
        for key in keys:
            slot = self.slots[key]
            slot.refs -= 1
            slot.stale |= not success  # a fault that failed this load may fail every one: do not offer it again
            if slot.stale and slot.refs == 0:
                self.evict([key])

    def evictable(self, protected: set[Key]) -> list[Key]:
        return [key for key, slot in self.slots.items() if slot.ready and slot.refs == 0 and key not in protected]

    def prepare_store(self, keys: list[Key], refuse: bool = False, fetched: bool = False) -> dict[Key, int] | None:
        """Slots for the keys not stored yet that it takes (a request's offers: once offered ``store_threshold``
        times; records ``fetched`` for a hit: all), or None (and no slot changed) when the tier cannot make room (or
        is told to ``refuse``)."""
        if not fetched:
            self._count_offers(keys)
        new = [key for key in keys if key not in self.slots and (fetched or self._takes(key))]
        shortfall = len(new) - len(self.free)
        victims = self.evictable(set(keys))[:shortfall] if shortfall > 0 else []
        if new and (refuse or len(victims) < shortfall):
            self.refusals += 1
            return None
        self.evict(victims)
        for key in keys:  # present keys count as used; new ones get a slot
            if key in self.slots:
                self.slots.move_to_end(key)
            elif key in new:
                self.slots[key] = Slot(self.free.pop())
        return {key: self.slots[key].index for key in new}

    def _count_offers(self, keys: list[Key]) -> None:
        if self.store_threshold > 1:
            for key in keys:
                self.offers[key] = self.offers.pop(key, 0) + 1
            while len(self.offers) > self.offers_remembered:
                self.offers.popitem(last=False)  # the least recently offered

    def _takes(self, key: Key) -> bool:
        return self.store_threshold == 1 or self.offers.get(key, 0) >= self.store_threshold

    def evict(self, keys: list[Key]) -> None:
        for key in keys:
            self.free.append(self.slots.pop(key).index)
        if keys:
            self.events.append(Event("removed", tuple(keys)))

    def complete_store(self, keys: list[Key], success: bool) -> None:
        stored = [key for key in keys if success and not self.slots[key].stale]  # stale: reset while storing
        for key in keys:
            if key in stored:
                self.slots[key].ready = True
            else:
                self.free.append(self.slots.pop(key).index)
        if stored:
            self.events.append(Event("stored", tuple(stored)))

    def reset(self) -> None:
        """Forget everything: idle entries now, the others when their transfers end."""
        for slot in self.slots.values():
            slot.stale = True
        self.evict([key for key, slot in self.slots.items() if slot.ready and slot.refs == 0])
