"""The offload tier: what a CPU tier manager must do (vLLM's ``OffloadingManager`` contract).

Entries are keyed by offload-block hash. A store is two-phase: ``prepare_store`` reserves not-ready entries (all or
nothing), ``complete_store`` makes them ready or removes them. A load pins ready entries (``prepare_load``) until
``complete_load``. Eviction is LRU over ready, unpinned entries.
"""

from __future__ import annotations

from attrs import define, field

from .invariants import Violation
from .types import Event, Key


@define
class Entry:
    ready: bool = False
    refs: int = 0  # in-flight loads


@define
class Tier:
    capacity: int
    entries: dict[Key, Entry] = field(factory=dict)  # least recently used first
    events: list[Event] = field(factory=list)
    refuse_next: bool = False  # fault injection: the next store that needs room is refused

    def lookup(self, keys: list[Key]) -> int:
        """How many leading keys are ready to load."""
        n = 0
        while n < len(keys) and keys[n] in self.entries and self.entries[keys[n]].ready:
            n += 1
        return n

    def touch(self, keys: list[Key]) -> None:
        for key in keys:
            if key in self.entries:
                self.entries[key] = self.entries.pop(key)

    def prepare_load(self, keys: list[Key]) -> None:
        for key in keys:
            if key not in self.entries or not self.entries[key].ready:
                raise Violation("LOOKUP", f"key {key:#x} was promised at lookup but is not loadable at alloc")
            self.entries[key].refs += 1

    def complete_load(self, keys: list[Key]) -> None:
        for key in keys:
            self.entries[key].refs -= 1

    def prepare_store(self, keys: list[Key]) -> list[Key] | None:
        """Reserve entries for the keys not already present; None, changing nothing, if there is no room."""
        fresh = [k for k in keys if k not in self.entries]
        if not fresh:
            return []
        victims = [k for k, e in self.entries.items() if e.ready and e.refs == 0 and k not in keys]
        short = len(self.entries) + len(fresh) - self.capacity
        if self.refuse_next or short > len(victims):
            self.refuse_next = False
            return None
        for key in victims[:max(short, 0)]:
            del self.entries[key]
        if short > 0:
            self.events.append(Event("removed", tuple(victims[:short])))
        for key in fresh:
            self.entries[key] = Entry()
        return fresh

    def complete_store(self, keys: list[Key], ok: bool) -> None:
        for key in keys:
            if ok:
                self.entries[key].ready = True
            else:
                del self.entries[key]  # no ghost entry
        if ok:
            self.events.append(Event("stored", tuple(keys)))
