"""Scheduler side of the production connector: per-step work proportional to the blocks that changed.

Per request it keeps the block table, the store cursor and a count of its unfinished transfers; keys are read
straight from the request's block hashes (every k-th), never re-sliced. A request with no offload block completed
this step costs a dict lookup and two integer comparisons.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from attrs import define, field

from kvoffload.spec.config import Config, UnknownRequestError
from kvoffload.spec.types import Copy, Event, SchedulerOutput, WorkerOutput

from .tier import OffloadTier


@define(slots=True)
class RequestState:
    request: Any
    blocks: list[int] = field(factory=list)
    cursor: int = 0  # offload blocks already offered to the tier
    jobs: int = 0  # transfers built and not yet completed
    allocated: bool = False  # blocks were allocated at least once (a lookup alone tracks nothing)


@define(slots=True)
class TransferSpec:
    job_id: int
    req_id: str
    kind: str  # "store" | "load"
    keys: list[int]  # distinct, in order
    blocks: np.ndarray  # GPU block ids
    rows: np.ndarray  # host rows, one per GPU block
    key_of: np.ndarray  # for each GPU block, the index of its key in ``keys``
    subs: np.ndarray  # for each GPU block, its index inside its offload block

    def copies(self) -> tuple[Copy, ...]:
        return tuple((b, self.keys[i], s) for b, i, s in zip(self.blocks.tolist(), self.key_of.tolist(),
                                                              self.subs.tolist()))


@define
class TransferPlan:
    loads: list[TransferSpec] = field(factory=list)
    stores: list[TransferSpec] = field(factory=list)


class OffloadScheduler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.k, self.block_size, self.offload_size = config.k, config.block_size, config.offload_block_size
        self.tier = OffloadTier(config.tier_blocks, config.policy)
        self.requests: dict[str, RequestState] = {}
        self.unfinished: dict[int, TransferSpec] = {}
        self._loads: list[TransferSpec] = []
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
        self.counters["hit_tokens"] += j * size - num_computed_tokens
        return j * size - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        state = self._state(request.req_id)
        state.blocks, state.cursor, state.allocated = list(block_ids), 0, True
        if num_external_tokens:
            first = request.num_computed_tokens // self.block_size
            end = (request.num_computed_tokens + num_external_tokens) // self.block_size
            k, hashes = self.k, request.block_hashes
            keys = [hashes[j * k + k - 1] for j in range(first // k, end // k)]
            slots = self.tier.prepare_load(keys)
            positions = np.arange(first, end)
            key_of = positions // k - first // k
            rows = np.asarray(slots)[key_of] * k + positions % k
            self._loads.append(self._transfer(state, "load", keys, np.asarray(block_ids[first:end]), rows,
                                              key_of, positions % k))

    def _transfer(self, state: RequestState, kind: str, keys: list[int], blocks: np.ndarray, rows: np.ndarray,
                  key_of: np.ndarray, subs: np.ndarray) -> TransferSpec:
        spec = TransferSpec(next(self._job_ids), state.request.req_id, kind, keys, blocks, rows, key_of, subs)
        self.unfinished[spec.job_id] = spec
        state.jobs += 1
        return spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        plan, self._loads = TransferPlan(self._loads), []
        for req_id in scheduler_output.preempted_req_ids:
            state = self._state(req_id)
            state.blocks, state.cursor = [], 0
        for sched in scheduler_output.scheduled:
            state = self._state(sched.req_id)
            if sched.kind == "running":
                if sched.block_ids:
                    state.blocks += sched.block_ids
            else:
                state.blocks, state.cursor = list(sched.block_ids), 0
            full = (sched.num_computed_tokens + sched.num_scheduled_tokens) // self.offload_size
            if full > state.cursor:
                store = self._store(state, full)
                if store is not None:
                    plan.stores.append(store)
        return plan

    def _store(self, state: RequestState, full: int) -> TransferSpec | None:
        k, hashes, first = self.k, state.request.block_hashes, state.cursor
        state.cursor = full
        keys = [hashes[j * k + k - 1] for j in range(first, full)]
        slots = self.tier.prepare_store(keys)
        if not slots:  # None: refused, this request only; {}: all present
            return None
        offsets = np.asarray([j for j, key in enumerate(keys, start=first) if key in slots])
        key_of, subs = np.repeat(np.arange(len(offsets)), k), np.tile(np.arange(k), len(offsets))
        blocks = np.asarray(state.blocks)[offsets[key_of] * k + subs]
        rows = np.asarray(list(slots.values()))[key_of] * k + subs
        return self._transfer(state, "store", list(slots), blocks, rows, key_of, subs)

    def update_connector_output(self, output: WorkerOutput) -> None:
        for job_id, success in output.job_results:
            spec = self.unfinished.pop(job_id, None)
            if spec is None:
                raise UnknownRequestError(f"completion for unknown job {job_id}")
            state = self.requests.get(spec.req_id)
            if state is not None:
                state.jobs -= 1
            if spec.kind == "store":
                self.tier.complete_store(spec.keys, success)
                self.counters["stored_blocks" if success else "failed_stores"] += len(spec.blocks)
            else:
                self.tier.complete_load(spec.keys)
                self.counters["loaded_blocks" if success else "failed_loads"] += len(spec.blocks)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        state = self._state(request.req_id)
        del self.requests[request.req_id]
        return state.jobs > 0

    def take_events(self) -> list[Event]:
        events, self.tier.events = self.tier.events, []
        return events
