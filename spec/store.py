"""The shared store: one store that every engine of a fleet attaches to (a directory, a key-value server), holding
records in the form ``records`` states, and what the environment does to it while engines run.

A connector reaches the store only through ``SharedTier``, one namespace at a time (``Store.open``); every backend
(``kvoffload.impl.tiers``) offers the same methods. The store here is the fleet's model of one:

  * an existence check is answered later (``ask``): at most ``delay`` ticks after it was asked, never while the
    store is down, so a connector must give up on it (a lookup past its deadline is a miss);
  * ``get`` hands out a record's payload only after ``check_record`` accepted it; a damaged one is quarantined,
    counted and missed;
  * ``put`` publishes a record unless one is there (the first writer wins, nothing is written twice), within one
    byte budget for the whole fleet (least recently used records go first);
  * the environment may, at any moment, make a record vanish (another replica's eviction, a TTL), damage it (a
    writer killed mid-write, a flipped bit), take the store down, restart it with or without its records, or break
    the connection in the middle of the next batch (a server's pipeline: what was sent before the break may have
    been done, yet the whole batch failed for the connector).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol, Sequence

from attrs import define, field

from .records import Bytes, Namespace, RecordError, RecordKey, check_record, header_size, seal


class Answer(Protocol):
    """An existence check in flight."""

    def done(self) -> bool: ...

    def result(self) -> list[bool]: ...

    def waited(self) -> float:
        """How long it has been asked, on the store's clock: ticks here, seconds for a backend."""
        ...


class SharedTier(Protocol):
    """A shared store of one namespace's records. No method raises on what a store may do to a running engine (an
    I/O error, a vanished or corrupt record): each is a miss or a dropped write, counted in ``counters``."""

    namespace: Namespace

    @property
    def counters(self) -> Counter[str]:
        """What happened to its records: hits, misses, stored, present, dropped_<why>, quarantined_<why>, ..."""
        ...

    def exists(self, keys: Sequence[RecordKey]) -> list[bool]: ...

    def ask(self, keys: Sequence[RecordKey], fresh: bool = False) -> Answer:
        """``exists``, answered later: the engine does not wait for a store. ``fresh``: answered by the store as it
        is after the ask, never from what this reader remembers of it (a lookup's second ask, after a get that
        failed: the records the get found damaged are gone)."""
        ...

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        """Each key's checked payload into its buffer; False: a miss (the buffer's bytes are then undefined)."""
        ...

    def put(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[str]:
        """Publish each record: "stored", "present" (another writer was first), or "dropped:<reason>"."""
        ...

    def delete(self, keys: Sequence[RecordKey]) -> None: ...


Name = tuple[bytes, RecordKey]  # (namespace digest, key): where a record lives in the store


@define(eq=False)
class Query:
    """One ``ask``: the store answers it from the records it holds then."""

    store: Store
    names: tuple[Name, ...]
    asked_at: int
    answer: list[bool] | None = None

    def done(self) -> bool:
        return self.answer is not None

    def result(self) -> list[bool]:
        if self.answer is None:
            raise RuntimeError("the store has not answered yet")
        return self.answer

    def waited(self) -> int:
        return self.store.ticks - self.asked_at


@define
class Store:
    capacity: int  # records, over every namespace: the fleet's budget
    delay: int = 0  # ticks an existence check may wait for its answer (0: answered at once)
    records: dict[Name, bytes] = field(factory=dict)  # least recently used first
    queries: list[Query] = field(factory=list)  # asked, not yet answered
    up: bool = True
    back_at: int | None = None  # the tick a store that is down comes back (None: it stays down)
    breaks_after: int | None = None  # the next batch breaks after this many of its records were done
    ticks: int = 0
    counters: Counter[str] = field(factory=Counter)

    def open(self, namespace: Namespace, payload_len: int) -> StoreView:
        return StoreView(self, namespace, payload_len)

    # ---- what the environment does --------------------------------------------------------------------------
    def tick(self) -> None:
        """An engine step passed: a live store answers every check asked ``delay`` ticks ago."""
        self.ticks += 1
        if not self.up and self.back_at is not None and self.ticks >= self.back_at:
            self.up, self.back_at = True, None
        if self.up:
            for query in [q for q in self.queries if self.ticks - q.asked_at >= self.delay]:
                self.answer(query)

    def answer(self, query: Query) -> None:
        self.queries.remove(query)
        query.answer = [self._touch(name) for name in query.names]

    def answer_early(self, index: int) -> None:
        if self.up and self.queries:
            self.answer(self.queries[index % len(self.queries)])

    def outage(self, ticks: int) -> None:
        """The store is unreachable for ``ticks`` ticks: checks go unanswered, gets miss, puts are dropped."""
        if self.up or self.back_at is not None:
            self.up, self.back_at = False, self.ticks + ticks

    def _pick(self, index: int, keys: frozenset[RecordKey]) -> Name | None:
        """A record by index: among those of ``keys`` if the store holds any, else among all."""
        names = [name for name in self.records if name[1] in keys] or list(self.records)
        return names[index % len(names)] if names else None

    def vanish(self, index: int, keys: frozenset[RecordKey] = frozenset()) -> None:
        """Another replica evicted a record, or its TTL expired."""
        name = self._pick(index, keys)
        if name is not None:
            del self.records[name]

    def damage(self, index: int, torn: bool, keys: frozenset[RecordKey] = frozenset()) -> None:
        """A writer killed mid-write left a torn record (half its bytes), or a bit flipped in its payload."""
        name = self._pick(index, keys)
        if name is not None:
            record = self.records[name]
            self.records[name] = record[:len(record) // 2] if torn else record[:-1] + bytes([record[-1] ^ 1])

    def break_connection(self, after: int) -> None:
        """The connection breaks in the middle of the next put or get: its first ``after`` records were done on the
        server, and the connector learns that the whole batch failed."""
        self.breaks_after = after

    def _broken(self, n: int) -> int | None:
        """How many of an ``n``-record batch are done before its connection breaks, or None if it does not."""
        after, self.breaks_after = self.breaks_after, None
        return None if after is None else min(after, n)

    def restart(self, keep: bool) -> None:
        """The store restarts, with its records or without them; checks in flight are lost with the connection:
        they are never answered."""
        self.queries.clear()
        if not keep:
            self.records.clear()

    # ---- what a view does, for one namespace ----------------------------------------------------------------
    def _touch(self, name: Name) -> bool:
        if name not in self.records:
            return False
        self.records[name] = self.records.pop(name)
        return True

    def _publish(self, name: Name, record: bytes) -> str:
        if not self.up:
            return "dropped:down"
        if name in self.records:
            return "present"
        while len(self.records) >= self.capacity:
            del self.records[next(iter(self.records))]
            self.counters["evicted"] += 1
        self.records[name] = record
        return "stored"


@define
class StoreView:
    """``SharedTier`` for one namespace of a ``Store``; ``asking`` (the world's NAMESPACE check) is called with the
    namespace of every existence check."""

    store: Store
    namespace: Namespace
    payload_len: int
    asking: Callable[[Namespace], None] | None = None

    @property
    def counters(self) -> Counter[str]:
        return self.store.counters

    def _name(self, key: RecordKey) -> Name:
        return self.namespace.digest, key

    def exists(self, keys: Sequence[RecordKey]) -> list[bool]:
        return [self.store.up and self.store._touch(self._name(key)) for key in keys]

    def ask(self, keys: Sequence[RecordKey], fresh: bool = False) -> Query:  # this store remembers nothing: fresh
        if self.asking is not None:
            self.asking(self.namespace)
        query = Query(self.store, tuple(map(self._name, keys)), self.store.ticks)
        self.store.queries.append(query)
        if not self.store.delay and self.store.up:
            self.store.answer(query)
        return query

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        if self.store._broken(len(keys)) is not None:  # the records were read, the replies lost
            self.counters["errors_connection"] += len(keys)
            return [False] * len(keys)
        return [self._get(key, buffer) for key, buffer in zip(keys, into)]

    def _get(self, key: RecordKey, into: memoryview) -> bool:
        record = self.store.records.get(self._name(key)) if self.store.up else None
        if record is None:
            self.counters["misses" if self.store.up else "errors_down"] += 1
            return False
        size, payload = header_size(key), memoryview(into).cast("B")[:self.payload_len]
        chunk = record[size:size + self.payload_len]
        payload[:len(chunk)] = chunk
        try:
            check_record(record[:size], payload, len(record), self.namespace, key)
        except RecordError as bad:
            del self.store.records[self._name(key)]  # quarantined: never served again
            self.counters[f"quarantined_{bad.reason}"] += 1
            return False
        self.store._touch(self._name(key))
        self.counters["hits"] += 1
        return True

    def put(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[str]:
        done = self.store._broken(len(records))
        outcomes = [self.store._publish(self._name(key), b"".join(map(bytes, seal(self.namespace, key, payload))))
                    for key, payload in records[:done]]
        if done is not None:  # published or not, each record's reply was lost with the connection
            outcomes = ["dropped:connection"] * len(records)
        self.counters.update(o.replace(":", "_") for o in outcomes)
        return outcomes

    def delete(self, keys: Sequence[RecordKey]) -> None:
        for key in keys:
            self.counters["deleted"] += self.store.records.pop(self._name(key), None) is not None
