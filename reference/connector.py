"""The reference connector: vLLM's offloading connector written plainly, both sides in one class.

The scheduler side decides (lookups, loads, stores, fenced frees) and hands the worker a ``TransferPlan`` per
step; the worker side copies rows between the engine's KV tensor and one host tensor, on the executor the
engine gives it. Read it next to ``kvoffload.spec.connector``: every decision there has one home here.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Callable

import torch
from attrs import define, evolve

from kvoffload.spec.config import BlockIdError, Config, ConfigError, UnknownRequestError, registered
from kvoffload.spec.records import Namespace
from kvoffload.spec.store import Answer, SharedTier
from kvoffload.spec.types import (FENCED_FREES, GROUPS, NULL_BLOCK, OBSERVE, REFUSE_STORE, RESET, SHARED, SHARED_MEDIUM,
                                  TRANSFER_FAILURES, BlockIds, Copy, Event, Job, Observation, RequestView,
                                  SchedulerOutput, TransferKind, TransferPlan, WorkerOutput, group_key, offload_keys)
from kvoffload.spec.executor import Executor

from .tier import LRUTier


@define
class Transfer:
    """One request's copies in one direction, built by the scheduler side; a worker submits it as a ``Job``."""

    job_id: int
    req_id: str
    kind: TransferKind
    copies: tuple[Copy, ...]  # (GPU block, key, index in the offload block); NULL_BLOCK for a put or a get
    host_rows: tuple[int, ...]  # host buffer row of each copy
    weights: str = ""  # a put's or a get's: the weights of the namespace its records belong to
    sync: bool = False  # a load the worker waits for before the forward pass

    @property
    def keys(self) -> list[int]:
        return list(dict.fromkeys(key for _b, key, _s in self.copies))


class TensorKV:
    """GPU KV memory as a real tensor: one row of ``width`` int64 per block, filled from the block's content id."""

    layout = "blocks_first"  # [num_blocks, ...], as vLLM's caches are described to a connector

    def __init__(self, num_blocks: int, width: int = 8, device: str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.tensor = torch.full((num_blocks, width), -2, dtype=torch.int64, device=device)
        self.caches = {"kv": self.tensor}
        self._lanes = torch.arange(width, dtype=torch.int64, device=device) * 0x9E3779B97F4A7C15 % (1 << 61)

    def row(self, content: int) -> torch.Tensor:
        return self._lanes ^ content

    def write(self, block_id: int, content: int) -> None:
        self.tensor[block_id] = self.row(content)

    def holds(self, block_id: int, content: int) -> bool:
        return bool(torch.equal(self.tensor[block_id], self.row(content)))


@define
class StoreLookup:
    """One waiting request's question to the shared store, until it is admitted: asked once; answered, or given up
    after ``Config.lookup_deadline`` on the store's clock; then at most one get of what it found. A failed get asks
    the store once more (the damaged records are quarantined by then: the hit before them still serves)."""

    keys: list[int]
    answer: Answer
    get_job: int | None = None
    done: bool = False
    second_ask: bool = False


class ReferenceConnector:
    capabilities = frozenset({OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES, RESET, GROUPS, SHARED})
    tier_class = LRUTier

    def __init__(self, config: Config) -> None:
        if config.policy != "lru":
            raise ConfigError(f"the reference connector implements the 'lru' policy only, not {config.policy!r}")
        self.config = config
        # scheduler side
        self.tier = self.tier_class(config.tier_blocks, config.store_threshold, config.offers_remembered)
        self._requests: dict[str, RequestView] = {}
        self.groups = config.groups  # the KV cache groups: a table each, and a key each per block (group_key)
        self._block_tables: dict[str, list[list[int]]] = {}
        self._cursors: dict[str, int] = {}  # the store cursor, in offload blocks
        self._unfinished: dict[int, Transfer] = {}  # built, not yet reported by every worker
        self._reports: defaultdict[int, list[bool]] = defaultdict(list)  # job id -> each worker's success so far
        self._pending_loads: list[Transfer] = []  # for the next plan
        self._flush_next: set[int] = set()  # stores reading blocks freed at a finish, for the next plan
        self._poisoned: set[int] = set()  # stores of requests that ended with an error: they make no entry
        self.refusing: set[str] = set()  # fault injection: the tier refuses these requests' next store
        self._job_ids = itertools.count()
        # the shared store, once attached: this engine's (this shard's) namespace, and how to open one
        self._namespace: Namespace | None = None
        self._identified = False  # attached since the last reset: the namespace is the engine's identity now
        self._open: Callable[[Namespace, int], SharedTier] | None = None
        self._opened: dict[Namespace, SharedTier] = {}
        self._store_lookups: dict[str, StoreLookup] = {}
        self._pending_gets: list[Transfer] = []
        self._being_got: set[int] = set()  # keys on their way from the store into the tier
        self._to_put: list[int] = []  # keys stored into the tier since the last plan
        # worker side
        self._executor: Executor | None = None
        self._gpu: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._submitted: dict[int, Transfer] = {}
        self._load_errors: set[int] = set()  # GPU blocks of failed loads, not yet reported

    # ================= scheduler side =================
    def _keys(self, req: RequestView) -> list[list[int]]:
        """Each group's offload keys (its offload blocks hold k of its own blocks, which may span several hashes)."""
        return [offload_keys(req.block_hashes, n) for n in self.config.hashes_per_offload_block]

    def _request(self, req_id: str) -> RequestView:
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request id {req_id!r}: the connector never saw it") from None

    def _has_transfers(self, req_id: str) -> bool:
        return any(t.req_id == req_id for t in self._unfinished.values())

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.req_id] = request
        if self._has_transfers(request.req_id):
            return 0, False  # a load must not overlap this request's stores
        if self._identified and not self._store_part_done(request, num_computed_tokens):
            return None, False  # ask again
        end = self._longest_hit(request, num_computed_tokens, self._in_tier)
        if not end:
            return 0, False
        if self.config.prefix_caching and self._loading(self._keys_read(request, num_computed_tokens, end)):
            return None, False  # ask again: another request's load brings part of this hit, for the engine to share
        return end - num_computed_tokens, not self.config.sync_loads

    def _loading(self, keys: list[int]) -> bool:
        """Whether an asynchronous load in flight reads one of ``keys``."""
        for transfer in self._unfinished.values():
            if transfer.kind == "load" and not transfer.sync and set(transfer.keys) & set(keys):
                return True
        return False

    def _in_tier(self, key: int) -> bool:
        return self.tier.lookup([key]) == 1

    def _longest_hit(self, request: RequestView, computed: int, has: Callable[[int], bool]) -> int:
        """The end of the longest hit past ``computed`` whose offload blocks ``has`` holds, or 0."""
        step = math.lcm(*self.config.offload_block_sizes)  # a hit ends on an offload block boundary of every group
        last, keys = self._last(request), self._keys(request)
        for end in range(last // step * step, computed, -step):
            if self._serves_every_group(keys, computed, end, has):
                return end
        return 0

    def _serves_every_group(self, keys: list[list[int]], computed: int, end: int, has: Callable[[int], bool]) -> bool:
        """Whether ``has`` holds what a hit up to token ``end`` needs from every group, beyond the offload blocks
        on the GPU (those before ``computed``): all of them for full attention, the last ones a window reads."""
        for g, (group, size) in enumerate(zip(self.groups, self.config.offload_block_sizes)):
            first, last = computed // size, end // size
            start = first if group.reach is None else max(first, last - -(-group.reach // size))
            if not all(has(group_key(key, g)) for key in keys[g][start:last]):
                return False
        return True

    def _store_part_done(self, request: RequestView, computed: int) -> bool:
        """Whether the shared store has had its say in this request's lookup (False: ask again). Asked once about
        every key a hit could read that the tier lacks; once answered, the records that lengthen the hit come into
        reserved tier slots by one get. Done when that get ends, when there is nothing to get or no room for it, or
        when the store has not answered within the deadline."""
        lookup = self._store_lookups.get(request.req_id)
        if lookup is None:
            missing = [key for key in self._usable_keys(request, computed) if not self._in_tier(key)]
            if not missing:
                return True  # nothing a hit could read that the tier lacks: nothing to ask
            lookup = self._store_lookups[request.req_id] = StoreLookup(missing, self._opened_store().ask(missing))
        if lookup.done or lookup.get_job is not None:
            return lookup.done
        if not lookup.answer.done():
            lookup.done = lookup.answer.waited() > self.config.lookup_deadline  # late is a miss
            return lookup.done
        there = {key for key, found in zip(lookup.keys, lookup.answer.result()) if found}
        end = self._longest_hit(request, computed, lambda key: self._in_tier(key) or key in there)
        read = self._keys_read(request, computed, end)
        if any(key in self._being_got for key in read):
            return False  # another request's get brings part of this hit: wait for it
        lookup.done = True
        if any(key in there and not self._in_tier(key) for key in read):
            slots = self.tier.prepare_store(read, fetched=True)  # the hit's slots kept, the records' reserved
            if slots:
                k = self.config.k
                copies = [(NULL_BLOCK, key, sub) for key in slots for sub in range(k)]
                rows = [slots[key] * k + sub for key in slots for sub in range(k)]
                get = self._new_transfer("", "get", copies, rows)
                self._pending_gets.append(get)
                self._being_got |= set(slots)
                lookup.get_job, lookup.done = get.job_id, False
        return lookup.done

    def _last(self, request: RequestView) -> int:
        """Where a hit may end at the latest: one token is left to compute, and only hashed blocks are offloaded."""
        return min(request.num_tokens - 1, len(request.block_hashes) * self.config.block_size)

    def _usable_keys(self, request: RequestView, computed: int) -> list[int]:
        """Every key a hit from ``computed`` could read: past the offload blocks on the GPU, up to the last one that
        ends by the hit's limit."""
        last, usable = self._last(request), dict[int, None]()
        for g, (keys, size) in enumerate(zip(self._keys(request), self.config.offload_block_sizes)):
            for j in range(computed // size, last // size):
                if j < len(keys):
                    usable[group_key(keys[j], g)] = None
        return list(usable)

    def _keys_read(self, request: RequestView, computed: int, end: int) -> list[int]:
        """The keys a load of tokens [computed, end) copies: not those of the blocks a window skips."""
        k, keys, read = self.config.k, self._keys(request), dict[int, None]()
        for g, bs in enumerate(self.config.block_sizes):
            for i in range(max(computed // bs, self._left_behind(g, end)), end // bs):
                read[group_key(keys[g][i // k], g)] = None
        return list(read)

    def _tables(self, block_ids: BlockIds | tuple[tuple[int, ...], ...] | tuple[int, ...]) -> list[list[int]]:
        """One table per group: a hybrid model's ids come a list per group."""
        if self.config.hybrid:
            return [list(table) for table in block_ids]  # type: ignore[arg-type]
        return [list(block_ids)]  # type: ignore[arg-type]

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None:
        req_id = self._request(request.req_id).req_id
        self._store_lookups.pop(req_id, None)
        tables = self._block_tables[req_id] = self._tables(block_ids)
        self._cursors[req_id] = 0
        if num_external_tokens == 0:
            return
        k, keys, end = self.config.k, self._keys(request), request.num_computed_tokens + num_external_tokens
        copies = [(table[i], group_key(keys[g][i // k], g), i % k)
                  for g, (table, bs) in enumerate(zip(tables, self.config.block_sizes))
                  for i in range(request.num_computed_tokens // bs, end // bs)
                  if table[i] != NULL_BLOCK]  # a window's older blocks: not loaded
        load_keys = list(dict.fromkeys(key for _block, key, _sub in copies))
        slots = dict(zip(load_keys, self.tier.prepare_load(load_keys)))
        rows = [slots[key] * k + sub for _block, key, sub in copies]
        load = self._new_transfer(req_id, "load", copies, rows)
        load.sync = self.config.sync_loads
        self._pending_loads.append(load)

    def _new_transfer(self, req_id: str, kind: TransferKind, copies: list[Copy], rows: list[int]) -> Transfer:
        weights = self._namespace.weights if self._namespace else ""
        transfer = Transfer(next(self._job_ids), req_id, kind, tuple(copies), tuple(rows), weights)
        self._unfinished[transfer.job_id] = transfer
        return transfer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        plan = TransferPlan(loads=self._pending_loads, gets=self._pending_gets, puts=self._plan_puts())
        flush = self._flush_next | self._stores_of(scheduler_output.preempted_req_ids)
        self._pending_loads, self._flush_next, self._pending_gets = [], set(), []
        for req_id in scheduler_output.preempted_req_ids:
            if req_id in self._block_tables:  # else it finished since it was preempted
                self._block_tables[req_id] = [[] for _ in self.groups]
                self._rewind(req_id)
        flush |= self._collect_stores(scheduler_output, plan)
        plan.flush = frozenset(flush)
        return plan

    def _plan_puts(self) -> list[Transfer]:
        """Put what the tier stored since the last plan into the shared store (what it still holds), its slots
        pinned until the put ends: before this plan's stores may evict them."""
        keys = [key for key in self._to_put if self._in_tier(key)]
        self._to_put = []
        if not keys:
            return []
        k = self.config.k
        for key in keys:
            self.tier.slots[key].refs += 1
        rows = [self.tier.slots[key].index * k + sub for key in keys for sub in range(k)]
        return [self._new_transfer("", "put", [(NULL_BLOCK, key, sub) for key in keys for sub in range(k)], rows)]

    def _stores_of(self, req_ids: frozenset[str]) -> set[int]:
        """The unfinished stores of these requests (preempted or finished: they finish before their blocks are
        reused)."""
        return {t.job_id for t in self._unfinished.values() if t.kind == "store" and t.req_id in req_ids}

    def _collect_stores(self, scheduler_output: SchedulerOutput, plan: TransferPlan) -> set[int]:
        """The stores of the batch; returns the stores to flush before the forward pass."""
        flush: set[int] = set()
        for sched in scheduler_output.scheduled:
            flush |= self._reading_left_behind(sched.req_id, sched.num_computed_tokens)
            self._update_block_table(sched)
            offered = self._storable(sched)
            keys = [key for _j, _g, key in offered]
            slots = self.tier.prepare_store(keys, refuse=sched.req_id in self.refusing)
            if slots is None:
                self.refusing.discard(sched.req_id)
                continue  # no room for this request's blocks: skip it, never the rest of the batch
            if slots:
                plan.stores.append(self._store_transfer(sched.req_id, offered, slots))
        return flush

    def _left_behind(self, group_index: int, computed: int) -> int:
        """Leading blocks of a sliding window's table that the engine may have freed once ``computed`` tokens are
        computed (it frees them without telling): none for full attention."""
        reach = self.groups[group_index].reach
        return 0 if reach is None else max(0, computed - reach) // self.config.block_sizes[group_index]

    def _reading_left_behind(self, req_id: str, computed: int) -> set[int]:
        """This request's stores that read a block its windows left behind: they must finish before the forward
        pass, which may write that block for another request."""
        tables = self._block_tables.get(req_id, [])
        left = {b for g, table in enumerate(tables) for b in table[:self._left_behind(g, computed)]}
        return {t.job_id for t in self._unfinished.values()
                if t.req_id == req_id and t.kind == "store" and any(b in left for b, _key, _sub in t.copies)}

    def _update_block_table(self, sched) -> None:
        self._request(sched.req_id)
        new = sched.group_block_ids or sched.block_ids
        if sched.kind == "running":
            if new is not None:  # blocks allocated this step
                tables, added = self._block_tables[sched.req_id], self._tables(new)
                for table in tables:  # a block given again left its old place (vLLM moved it, or freed it there)
                    for i, block in enumerate(table):
                        if block != NULL_BLOCK and any(block in blocks for blocks in added):
                            table[i] = NULL_BLOCK
                for table, blocks in zip(tables, added):
                    table.extend(blocks)
        else:  # new or resumed: the whole table
            self._block_tables[sched.req_id] = self._tables(new)
            self._rewind(sched.req_id)

    def _rewind(self, req_id: str) -> None:
        self._cursors[req_id] = 0

    def _storable(self, sched) -> list[tuple[int, int, int]]:
        """(offload block, group, key) of the offload blocks full after this step whose end the cursor has not
        passed, by their end, in each group that still holds them (not a block its window may have freed); moves
        the cursor (in offload blocks of offload_block_size tokens: every group's offload blocks end on one)."""
        request, size = self._requests[sched.req_id], self.config.offload_block_size
        keys = self._keys(request)  # only blocks whose tokens the engine has seen have one
        full = min((sched.num_computed_tokens + sched.num_scheduled_tokens) // size,
                   len(request.block_hashes) // self.config.k)
        if self.config.store_prompts_only:
            full = min(full, request.num_prompt_tokens // size)
        first, k, tables = self._cursors[sched.req_id], self.config.k, self._block_tables[sched.req_id]
        self._cursors[sched.req_id] = max(first, full)
        offered = []
        for end in range((first + 1) * size, full * size + 1, size):
            for g, (table, group_size) in enumerate(zip(tables, self.config.offload_block_sizes)):
                if end % group_size:
                    continue  # none of this group's offload blocks ends here
                j = end // group_size - 1
                blocks = table[j * k:j * k + k]
                if j * k >= self._left_behind(g, sched.num_computed_tokens) and NULL_BLOCK not in blocks:
                    offered.append((j, g, group_key(keys[g][j], g)))
        return offered

    def _store_transfer(self, req_id: str, offered: list[tuple[int, int, int]], slots: dict[int, int]) -> Transfer:
        k, tables = self.config.k, self._block_tables[req_id]
        copies, rows = [], []
        for j, g, key in offered:
            if key in slots:
                for sub in range(k):
                    copies.append((tables[g][j * k + sub], key, sub))
                    rows.append(slots[key] * k + sub)
        return self._new_transfer(req_id, "store", copies, rows)

    def update_connector_output(self, output: WorkerOutput) -> None:
        for job_id, success in output.job_results:
            if job_id not in self._unfinished:
                raise UnknownRequestError(f"completion for unknown job {job_id}")
            self._reports[job_id].append(success)
            if len(self._reports[job_id]) < self.config.num_workers:
                continue  # every worker copies its own shard of the blocks
            transfer, success = self._unfinished.pop(job_id), all(self._reports.pop(job_id))
            success = success and job_id not in self._poisoned
            self._poisoned.discard(job_id)
            if transfer.kind == "store":
                self.tier.complete_store(transfer.keys, success)
                if self._identified and success:
                    self._to_put += [key for key in transfer.keys if key in self.tier.slots]
            elif transfer.kind == "get":
                self.tier.complete_store(transfer.keys, success)
                self._being_got -= set(transfer.keys)
                for lookup in self._store_lookups.values():
                    if lookup.get_job != job_id:
                        continue
                    if success or lookup.second_ask:
                        lookup.done = True
                    else:
                        lookup.answer, lookup.get_job = self._opened_store().ask(lookup.keys, fresh=True), None
                        lookup.second_ask = True
            elif transfer.kind == "put":
                self.tier.complete_load(transfer.keys)  # unpinned: the tier's copy is as good as before
                if success:  # the store holds every record now
                    self.tier.events.append(Event("stored", tuple(transfer.keys), SHARED_MEDIUM))
            else:
                self.tier.complete_load(transfer.keys, success)

    def request_finished(self, request: RequestView, block_ids: BlockIds) -> bool:
        req_id = self._request(request.req_id).req_id
        del self._requests[req_id]
        self._store_lookups.pop(req_id, None)
        self._block_tables.pop(req_id, None)
        self._cursors.pop(req_id, None)
        self.refusing.discard(req_id)
        stores = self._stores_of(frozenset({req_id}))
        self._flush_next |= stores  # the engine frees its blocks now
        if request.failed:  # it may have computed from a block a synchronous load failed to fill: garbage
            self._poisoned |= stores
        return False

    def reset_cache(self) -> bool:
        """Forget the tier, and who the engine is: the shared store waits for the engine's next attach."""
        self.tier.reset()
        self._store_lookups.clear()
        self._identified = False
        return True

    def take_events(self) -> list[Event]:
        events, self.tier.events = self.tier.events, []
        return events

    # ================= worker side =================
    def register_kv_caches(self, kv: TensorKV, executor: Executor) -> None:
        self._gpu, self._executor = kv.tensor, executor
        rows = self.config.tier_blocks * self.config.k
        self._host = torch.zeros((rows, kv.tensor.shape[1]), dtype=kv.tensor.dtype)

    def attach_shared_tier(self, open: Callable[[Namespace, int], SharedTier], namespace: Namespace) -> None:
        self._open, self._namespace, self._identified = open, namespace, True

    def _opened_store(self, weights: str | None = None) -> SharedTier:
        """This engine's records in the shared store, with its weights now or with ``weights``."""
        namespace = registered(self._namespace, "namespace")
        namespace = namespace if weights is None else evolve(namespace, weights=weights)
        if namespace not in self._opened:
            payload = self.config.k * self.host.shape[1] * self.host.element_size()
            self._opened[namespace] = registered(self._open, "open")(namespace, payload)
        return self._opened[namespace]

    # what register_kv_caches set
    @property
    def executor(self) -> Executor:
        return registered(self._executor, "executor")

    @property
    def gpu(self) -> torch.Tensor:
        return registered(self._gpu, "gpu")

    @property
    def host(self) -> torch.Tensor:
        return registered(self._host, "host")

    def handle_preemptions(self, metadata: TransferPlan) -> None:
        self.executor.flush(set(metadata.flush))  # before the forward pass may write their blocks

    def start_load_kv(self, metadata: TransferPlan) -> None:
        for transfer in metadata.loads + metadata.gets:
            self._submit(transfer)
        self.executor.wait({load.job_id for load in metadata.loads if load.sync})  # the forward pass reads them

    def wait_for_save(self, metadata: TransferPlan) -> None:
        for transfer in metadata.stores + metadata.puts:
            self._submit(transfer)

    def _submit(self, transfer: Transfer) -> None:
        self._submitted[transfer.job_id] = transfer
        run = self._store_io(transfer) if transfer.kind in ("get", "put") else self._copy(transfer)
        self.executor.submit(Job(transfer.job_id, transfer.req_id, transfer.kind, transfer.copies, run))

    def _copy(self, transfer: Transfer) -> Callable[[], None]:
        """Rows between the GPU and the host buffer."""
        blocks, pool = [b for b, _key, _sub in transfer.copies], self.gpu.shape[0]
        if any(not 0 <= b < pool for b in blocks):
            raise BlockIdError(f"transfer {transfer.job_id} names GPU blocks {blocks}; the pool has {pool}")
        gpu_idx, host_idx = torch.tensor(blocks), torch.tensor(transfer.host_rows)
        if transfer.kind == "store":
            def run() -> None:
                self.host.index_copy_(0, host_idx, self.gpu.index_select(0, gpu_idx))
        else:
            def run() -> None:
                self.gpu.index_copy_(0, gpu_idx, self.host.index_select(0, host_idx))
        return run

    def _store_io(self, transfer: Transfer) -> Callable[[], bool]:
        """An entry's k host rows, as one record of the shared store, in one direction or the other. A get lands
        only if every record it reads was found whole."""
        k, store = self.config.k, self._opened_store(transfer.weights)
        keys = transfer.keys
        rows = [torch.tensor(transfer.host_rows[i * k:(i + 1) * k]) for i in range(len(keys))]
        if transfer.kind == "put":
            def run() -> bool:
                outcomes = store.put([(key, self.host[r].numpy().tobytes()) for key, r in zip(keys, rows)])
                return all(not outcome.startswith("dropped") for outcome in outcomes)
        else:
            def run() -> bool:
                landing = [torch.empty_like(self.host[r]) for r in rows]
                if not all(store.get(keys, [t.numpy().data for t in landing])):
                    return False
                for r, t in zip(rows, landing):
                    self.host[r] = t
                return True
        return run

    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput:
        results = self.executor.poll()
        recving, failed_recving = set(), set()
        for job_id, success in results:
            transfer = self._submitted.pop(job_id)
            if transfer.kind == "load":
                if not transfer.sync:  # a synchronous load's request is running: vLLM asserts it is not named
                    recving.add(transfer.req_id)
                if success:
                    continue
                if self.config.hybrid:  # with several groups, a failed load is reported by its request
                    failed_recving.add(transfer.req_id)
                else:
                    self._load_errors.update(b for b, _key, _sub in transfer.copies)
        return WorkerOutput(frozenset(), frozenset(recving), tuple(results), frozenset(failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ================= for the conformance kit =================
    def observe(self) -> Observation:
        return Observation(
            tracked={r: tuple(map(tuple, t)) if self.config.hybrid else tuple(t[0])
                     for r, t in self._block_tables.items()},
            cursors=dict(self._cursors),
            tier=tuple((key, slot.ready, slot.refs) for key, slot in self.tier.slots.items()),
            jobs=tuple(sorted((t.req_id, t.kind, t.copies) for t in self._unfinished.values())),
        )

    def refuse_next_store(self, req_id: str) -> None:
        self.refusing.add(req_id)
