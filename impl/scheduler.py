"""Scheduler side of the production connector: per-step work proportional to the blocks that changed.

Per request it keeps the block table, the store cursor and a count of its unfinished transfers; keys are read
straight from the request's block hashes (the spec's key rule, ``key_index`` / ``offload_keys``), only for the
offload blocks a lookup, load or store touches. A request with no offload block completed this step costs a dict
lookup and a few integer comparisons. The cursor never passes the hashes (the timing rule of ``RequestView``).
"""

from __future__ import annotations

import itertools

from attrs import define, field

from kvoffload.spec.config import Config, UnknownRequestError
from kvoffload.spec.types import (NULL_BLOCK, BlockIds, Copy, Event, RequestView, SchedulerOutput, TransferKind,
                                  TransferPlan, WorkerOutput, group_key, key_index, offload_keys)

from .tier import OffloadTier


@define(slots=True)
class RequestState:
    request: RequestView
    block_tables: list[list[int]] = field(factory=lambda: [[]])  # one per KV cache group
    cursor: int = 0  # the store cursor: offload blocks already offered to the tier
    unfinished: int = 0  # transfers built and not yet reported by every worker
    unfinished_stores: int = 0  # of which stores
    allocated: bool = False  # blocks were allocated at least once (a lookup alone tracks nothing)


@define(slots=True)
class Transfer:
    """One request's copies in one direction, built by the scheduler side; a worker submits it as a ``Job``."""

    job_id: int
    req_id: str
    kind: TransferKind
    keys: list[int]  # distinct, in order
    copies: list[Copy]  # (GPU block, key, index of that GPU block inside its offload block)
    host_rows: list[int]  # host row of each copy
    reports: int = 0  # workers that reported it
    success: bool = True  # every report so far was a success

    @property
    def gpu_blocks(self) -> list[int]:
        return [block for block, _key, _sub in self.copies]


class OffloadScheduler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.k, self.block_size, self.offload_size = config.k, config.block_size, config.offload_block_size
        self.tier = OffloadTier(config.tier_blocks, config.policy)
        self.windows = [group.window for group in config.groups]  # None: full attention
        self.hybrid = config.hybrid  # block ids come one table per group
        self.windowed = any(w is not None for w in self.windows)  # a window frees blocks while requests run
        self.requests: dict[str, RequestState] = {}
        self.num_workers = config.num_workers
        self.unfinished: dict[int, Transfer] = {}  # built, not yet reported by every worker
        self._pending_loads: list[Transfer] = []  # for the next plan
        self._delayed: set[str] = set()  # request_finished delayed their free since the last plan
        self.refusing: set[str] = set()  # fault injection: the tier refuses these requests' next store
        self.origin: dict[int, tuple[int, int]] = {}  # a later group's tier key -> (block hash, group): for events
        self._leaving: set[int] = set()  # keys that left the tier: their origins go once no unread event names them
        self._job_ids = itertools.count()
        self.counters = dict.fromkeys(("lookups", "hit_tokens", "stored_blocks", "loaded_blocks",
                                       "failed_stores", "failed_loads"), 0)

    def _state(self, req_id: str) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {req_id!r}: the connector never saw it")
        return state

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        state = self.requests.get(request.req_id)
        if state is None:
            state = self.requests[request.req_id] = RequestState(request, [[] for _ in self.windows])
        self.counters["lookups"] += 1
        if state.unfinished:
            return 0, False  # no load while this request's stores are in flight
        hashes, k, size = request.block_hashes, self.k, self.offload_size
        first = j = num_computed_tokens // size
        limit = (request.num_tokens - 1) // size
        if self.windowed:
            j = self._windowed_hit(offload_keys(hashes, k, 0, limit), first)
        else:
            key = key_index(first, k)  # then each offload block's key is k hashes further
            while j < limit and self.tier.is_ready(hashes[key]):
                j, key = j + 1, key + k
        if j == first:
            return 0, False
        return j * size - num_computed_tokens, True

    def _windowed_hit(self, keys: list[int], first: int) -> int:
        """The furthest offload block a hit can end at, blocks before ``first`` being on the GPU: every group finds
        what it reads there in the tier (full attention: every block from ``first``; a window: its last ones)."""
        size = self.offload_size
        for end in range(len(keys), first, -1):
            if all(self.tier.is_ready(group_key(keys[j], g))
                   for g, window in enumerate(self.windows)
                   for j in range(first if window is None else max(first, end - -(-(window - 1) // size)), end)):
                return end
        return first

    def _tables(self, block_ids: BlockIds | tuple[int, ...] | tuple[tuple[int, ...], ...]) -> list[list[int]]:
        return [list(t) for t in block_ids] if self.hybrid else [list(block_ids)]  # type: ignore[arg-type]

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None:
        state = self._state(request.req_id)
        tables = state.block_tables = self._tables(block_ids)
        state.cursor, state.allocated = 0, True
        self.counters["hit_tokens"] += num_external_tokens  # counted once the engine commits to the load
        if num_external_tokens:
            first = request.num_computed_tokens // self.block_size
            end = (request.num_computed_tokens + num_external_tokens) // self.block_size
            k, base = self.k, first // self.k
            keys = offload_keys(request.block_hashes, k, base, end // k)
            copies = [(table[p], group_key(keys[p // k - base], g), p % k) for g, table in enumerate(tables)
                      for p in range(first, end) if table[p] != NULL_BLOCK]  # a window's older blocks: not loaded
            load_keys = list(dict.fromkeys(key for _block, key, _sub in copies))
            slot_of = dict(zip(load_keys, self.tier.prepare_load(load_keys)))
            host_rows = [slot_of[key] * k + sub for _block, key, sub in copies]
            self._pending_loads.append(self._new_transfer(state, "load", load_keys, copies, host_rows))

    def _new_transfer(self, state: RequestState, kind: TransferKind, keys: list[int], copies: list[Copy],
                      host_rows: list[int]) -> Transfer:
        transfer = Transfer(next(self._job_ids), state.request.req_id, kind, keys, copies, host_rows)
        self.unfinished[transfer.job_id] = transfer
        state.unfinished += 1
        state.unfinished_stores += kind == "store"
        return transfer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        plan = TransferPlan(self._pending_loads, delayed=frozenset(self._delayed))
        self._pending_loads, self._delayed = [], set()
        for req_id in scheduler_output.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:  # else it finished since it was preempted
                state.block_tables, state.cursor = [[] for _ in self.windows], 0
        requests, size, hybrid, windowed = self.requests, self.offload_size, self.hybrid, self.windowed
        flush: set[int] = set()
        for sched in scheduler_output.scheduled:  # the hot loop: most requests only decode a token
            state = requests.get(sched.req_id) or self._state(sched.req_id)
            if windowed:
                flush |= self._reading_left_behind(state, sched.num_computed_tokens)
            if hybrid:
                self._update_tables(state, sched.kind, sched.group_block_ids)
            elif sched.kind == "running":
                if sched.block_ids:
                    state.block_tables[0] += sched.block_ids
            else:
                state.block_tables, state.cursor = [list(sched.block_ids or ())], 0
            full = (sched.num_computed_tokens + sched.num_scheduled_tokens) // size
            if full > state.cursor:
                store = self._store(state, full, sched.num_computed_tokens)
                if store is not None:
                    plan.stores.append(store)
        plan.flush = frozenset(flush)
        return plan

    @staticmethod
    def _update_tables(state: RequestState, kind: str, new: tuple[tuple[int, ...], ...] | None) -> None:
        """A hybrid model's tables: this step's new blocks per group (running), or every group's whole table."""
        if kind != "running":
            state.block_tables, state.cursor = [list(table) for table in new or ()], 0
        elif new:
            for table, blocks in zip(state.block_tables, new):
                table += blocks

    def _left_behind(self, group: int, computed: int) -> int:
        """Leading blocks of a group's table that the engine may have freed (a sliding window's, once ``computed``
        tokens are computed): it frees them without telling."""
        window = self.windows[group]
        return 0 if window is None else max(0, computed - window + 1) // self.block_size

    def _reading_left_behind(self, state: RequestState, computed: int) -> set[int]:
        """Stores of this request still reading a block its windows left behind: flushed before the forward pass,
        which may write that block for another request."""
        if not state.unfinished_stores:
            return set()
        left = {b for g, table in enumerate(state.block_tables) for b in table[:self._left_behind(g, computed)]}
        return {t.job_id for t in self.unfinished.values() if t.req_id == state.request.req_id and t.kind == "store"
                and not left.isdisjoint(t.gpu_blocks)}

    def _store(self, state: RequestState, full: int, computed: int) -> Transfer | None:
        """Offer offload blocks [cursor, full) to the tier, as far as their keys exist (tokens the engine has
        seen); a transfer for those it accepts. In a hybrid model, each group's blocks that it still holds."""
        k, first = self.k, state.cursor
        keys = offload_keys(state.request.block_hashes, k, first, full)
        if not keys:
            return None
        state.cursor = first + len(keys)
        if self.windowed:
            return self._store_groups(state, first, keys, computed)
        slots = self.tier.prepare_store(keys, refuse=state.request.req_id in self.refusing)
        if slots is None:  # refused: this request only
            self.refusing.discard(state.request.req_id)
        if not slots:  # ({}: all present)
            return None
        table, copies, host_rows = state.block_tables[0], [], []
        for j, key in enumerate(keys, start=first):
            slot = slots.get(key)
            if slot is not None:
                for sub in range(k):
                    copies.append((table[j * k + sub], key, sub))
                    host_rows.append(slot * k + sub)
        return self._new_transfer(state, "store", list(slots), copies, host_rows)

    def _store_groups(self, state: RequestState, first: int, keys: list[int], computed: int) -> Transfer | None:
        k, tables = self.k, state.block_tables
        offered = [(j, g, group_key(key, g)) for j, key in enumerate(keys, start=first)
                   for g, table in enumerate(tables)
                   if j * k >= self._left_behind(g, computed) and NULL_BLOCK not in table[j * k:j * k + k]]
        slots = self.tier.prepare_store([key for _j, _g, key in offered], refuse=state.request.req_id in self.refusing)
        if slots is None:  # refused: this request only
            self.refusing.discard(state.request.req_id)
        if not slots:
            return None
        copies, host_rows = [], []
        for j, g, key in offered:
            slot = slots.get(key)
            if slot is not None:
                if g:
                    self.origin[key] = (keys[j - first], g)
                for sub in range(k):
                    copies.append((tables[g][j * k + sub], key, sub))
                    host_rows.append(slot * k + sub)
        return self._new_transfer(state, "store", list(slots), copies, host_rows)

    def update_connector_output(self, output: WorkerOutput) -> None:
        for job_id, success in output.job_results:
            transfer = self.unfinished.get(job_id)
            if transfer is None:
                raise UnknownRequestError(f"completion for unknown job {job_id}")
            transfer.reports += 1
            transfer.success &= success
            if transfer.reports < self.num_workers:
                continue  # every worker copies its own shard: done once all of them are
            del self.unfinished[job_id]
            success = transfer.success
            state = self.requests.get(transfer.req_id)
            if state is not None:
                state.unfinished -= 1
                state.unfinished_stores -= transfer.kind == "store"
            if transfer.kind == "store":
                self.tier.complete_store(transfer.keys, success)
                if not success:
                    self._leaving.update(transfer.keys)
                self.counters["stored_blocks" if success else "failed_stores"] += len(transfer.copies)
            else:
                self.tier.complete_load(transfer.keys, success)
                self.counters["loaded_blocks" if success else "failed_loads"] += len(transfer.copies)

    def request_finished(self, request: RequestView, block_ids: BlockIds) -> bool:
        state = self._state(request.req_id)
        del self.requests[request.req_id]
        self.refusing.discard(request.req_id)
        if state.unfinished_stores:  # stores still read its blocks (a load in flight: the engine holds them itself)
            self._delayed.add(request.req_id)
        return state.unfinished_stores > 0

    def reset_cache(self) -> bool:
        """After a weight update: nothing stored so far may be served again."""
        self.tier.reset()
        return True

    def take_events(self) -> list[Event]:
        """The tier's events since the last call. The origins of the keys they name stay until the next call (the
        caller reads them in between); a key that left the tier and is named by no event of this call goes now."""
        events, self.tier.events = self.tier.events, []
        named = {key for event in events for key in event.keys}
        for key in self._leaving - named:
            if key not in self.tier.slot_of:
                self.origin.pop(key, None)
        self._leaving = (self._leaving & named) | {key for e in events if e.kind == "removed" for key in e.keys}
        return events
