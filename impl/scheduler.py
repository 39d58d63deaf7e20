"""Scheduler side of the production connector: per-step work proportional to the blocks that changed.

Per request it keeps the block table, the store cursor and a count of its unfinished transfers; keys are read
straight from the request's block hashes (every k-th), never re-sliced. A request with no offload block completed
this step costs a dict lookup and a few integer comparisons. The cursor never passes the hashes: under async
scheduling and speculative decoding the scheduled tokens run ahead of the tokens the engine has seen.
"""

from __future__ import annotations

import itertools
from typing import Any

from attrs import define, field

from kvoffload.spec.config import Config, UnknownRequestError
from kvoffload.spec.types import Copy, Event, SchedulerOutput, TransferKind, TransferPlan, WorkerOutput

from .tier import OffloadTier


@define(slots=True)
class RequestState:
    request: Any
    blocks: list[int] = field(factory=list)
    cursor: int = 0  # offload blocks already offered to the tier
    jobs: int = 0  # transfers built and not yet completed
    stores: int = 0  # of which stores
    allocated: bool = False  # blocks were allocated at least once (a lookup alone tracks nothing)


@define(slots=True)
class TransferSpec:
    job_id: int
    req_id: str
    kind: TransferKind
    keys: list[int]  # distinct, in order
    copies: list[Copy]  # (GPU block, key, index of that GPU block inside its offload block)
    rows: list[int]  # host row of each copy
    reports: int = 0  # workers that reported it
    ok: bool = True  # every report so far was a success

    @property
    def blocks(self) -> list[int]:
        return [block for block, _key, _sub in self.copies]


class OffloadScheduler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.k, self.block_size, self.offload_size = config.k, config.block_size, config.offload_block_size
        self.tier = OffloadTier(config.tier_blocks, config.policy)
        self.requests: dict[str, RequestState] = {}
        self.num_workers = config.num_workers
        self.unfinished: dict[int, TransferSpec] = {}  # built, not yet reported by every worker
        self._loads: list[TransferSpec] = []
        self._delayed: set[str] = set()
        self._job_ids = itertools.count()
        self.counters = dict.fromkeys(("lookups", "hit_tokens", "stored_blocks", "loaded_blocks",
                                       "failed_stores", "failed_loads"), 0)

    def _state(self, req_id: str) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {req_id!r}: the connector never saw it")
        return state

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        state = self.requests.get(request.req_id)
        if state is None:
            state = self.requests[request.req_id] = RequestState(request)
        self.counters["lookups"] += 1
        if state.jobs:
            return 0, False  # no load while this request's stores are in flight
        hashes, k, size = request.block_hashes, self.k, self.offload_size
        first = j = num_computed_tokens // size
        limit = (request.num_tokens - 1) // size
        while j < limit and self.tier.is_ready(hashes[j * k + k - 1]):
            j += 1
        if j == first:
            return 0, False
        return j * size - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._state(request.req_id)
        state.blocks, state.cursor, state.allocated = list(block_ids), 0, True
        self.counters["hit_tokens"] += num_external_tokens  # counted once the engine commits to the load
        if num_external_tokens:
            first = request.num_computed_tokens // self.block_size
            end = (request.num_computed_tokens + num_external_tokens) // self.block_size
            k, hashes, base = self.k, request.block_hashes, first // self.k
            keys = [hashes[j * k + k - 1] for j in range(base, end // k)]
            slots = self.tier.prepare_load(keys)
            copies = [(block_ids[p], keys[p // k - base], p % k) for p in range(first, end)]
            rows = [slots[p // k - base] * k + p % k for p in range(first, end)]
            self._loads.append(self._transfer(state, "load", keys, copies, rows))

    def _transfer(self, state: RequestState, kind: TransferKind, keys: list[int], copies: list[Copy],
                  rows: list[int]) -> TransferSpec:
        spec = TransferSpec(next(self._job_ids), state.request.req_id, kind, keys, copies, rows)
        self.unfinished[spec.job_id] = spec
        state.jobs += 1
        state.stores += kind == "store"
        return spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        plan = TransferPlan(self._loads, delayed=frozenset(self._delayed))
        self._loads, self._delayed = [], set()
        for req_id in scheduler_output.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:  # else it finished since it was preempted
                state.blocks, state.cursor = [], 0
        requests, size = self.requests, self.offload_size
        for sched in scheduler_output.scheduled:  # the hot loop: most requests only decode a token
            state = requests.get(sched.req_id) or self._state(sched.req_id)
            if sched.kind == "running":
                if sched.block_ids:
                    state.blocks += sched.block_ids
            else:
                state.blocks, state.cursor = list(sched.block_ids or ()), 0
            full = (sched.num_computed_tokens + sched.num_scheduled_tokens) // size
            if full > state.cursor:
                store = self._store(state, full)
                if store is not None:
                    plan.stores.append(store)
        return plan

    def _store(self, state: RequestState, full: int) -> TransferSpec | None:
        """Offer offload blocks [cursor, full) to the tier, as far as their keys exist (tokens the engine has
        seen); a transfer for those it accepts."""
        k, hashes, first = self.k, state.request.block_hashes, state.cursor
        full = min(full, len(hashes) // k)
        if full <= first:
            return None
        state.cursor = full
        keys = [hashes[j * k + k - 1] for j in range(first, full)]
        slots = self.tier.prepare_store(keys)
        if not slots:  # None: refused, this request only; {}: all present
            return None
        table, copies, rows = state.blocks, [], []
        for j, key in enumerate(keys, start=first):
            slot = slots.get(key)
            if slot is not None:
                for sub in range(k):
                    copies.append((table[j * k + sub], key, sub))
                    rows.append(slot * k + sub)
        return self._transfer(state, "store", list(slots), copies, rows)

    def update_connector_output(self, output: WorkerOutput) -> None:
        for job_id, success in output.job_results:
            spec = self.unfinished.get(job_id)
            if spec is None:
                raise UnknownRequestError(f"completion for unknown job {job_id}")
            spec.reports += 1
            spec.ok &= success
            if spec.reports < self.num_workers:
                continue  # every worker copies its own shard: done once all of them are
            del self.unfinished[job_id]
            success = spec.ok
            state = self.requests.get(spec.req_id)
            if state is not None:
                state.jobs -= 1
                state.stores -= spec.kind == "store"
            if spec.kind == "store":
                self.tier.complete_store(spec.keys, success)
                self.counters["stored_blocks" if success else "failed_stores"] += len(spec.copies)
            else:
                self.tier.complete_load(spec.keys, success)
                self.counters["loaded_blocks" if success else "failed_loads"] += len(spec.copies)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        state = self._state(request.req_id)
        del self.requests[request.req_id]
        if state.stores:  # stores still read its blocks (a load in flight: the engine holds them itself)
            self._delayed.add(request.req_id)
        return state.stores > 0

    def reset_cache(self) -> bool:
        """After a weight update: nothing stored so far may be served again."""
        self.tier.reset()
        return True

    def take_events(self) -> list[Event]:
        events, self.tier.events = self.tier.events, []
        return events
