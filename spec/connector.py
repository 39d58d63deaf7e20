"""The spec connector: the definition of what a correct offloading connector decides, step by step.

Scheduler side
  * lookup: count ready tier entries from the first offload block not already on the GPU, leaving at least one
    token to compute; no hit for a request that still has transfers in flight.
  * after alloc: remember the block table; a hit becomes one load transfer (pins its entries). With
    ``Config.sync_loads`` every hit loads synchronously: its request computes the rest in the same step.
  * each batch: update every request's block table first (new / resumed: replace; running: append the step's
    new ids), then offer the offload blocks that are full after this step *and hashed* (the timing rule of
    ``RequestView``; the key rule is ``key_index``), from the request's store cursor on. A refused store skips
    *that request only*; the cursor still moves past what was offered. The tier takes a block it lacks as its
    admission decides (``Config.store_threshold``: once offered that often); with ``store_prompts_only`` only the
    offload blocks of prompt tokens are offered.
  * preemption and resumption rewind the cursor to 0 (prepare_store skips what is really stored).
  * request_finished: never delay the free (FENCED_FREES); forget the request, and name its stores still in
    flight in the next plan's ``flush``, so that they finish before the forward pass that may write its blocks for
    another request. The engine frees the blocks at once: a reset right after the last request finished is granted,
    and the blocks serve the next requests a step earlier. (A load in flight keeps its blocks anyway: the engine
    waits for finished_recving.) A request that ended with an error (a synchronous load it read from failed: its
    own, or another request's hit in the engine's prefix cache) computed garbage: its stores in flight make no entry.
  * a transfer is complete once every worker reported it (tensor parallelism: each holds a shard of every block);
    it succeeded only if every worker's part did. A failed load makes its entries stale (never offered again).
  * reset_cache (a weight update): every entry goes stale; stores in flight never become loadable.
  * a hybrid model (GROUPS, several KV cache groups, or one sliding window): one block table per group (a single
    group's comes as one table), and each group's offload blocks (``k`` of its own blocks, whatever their size) are
    keyed by hash and group (``group_key``). A hit must be usable by every group (``groups.longest_hit``: it ends
    on an offload block boundary of every group; a sliding window needs only its last blocks, and its older
    positions are never loaded); a store skips the blocks a window may have freed; the stores that still read such
    blocks are flushed before the forward pass, since the engine frees them without telling and may reuse them at
    once: those of a scheduled request by its computed tokens, those of a finished one by the table it finishes
    with (the engine frees the window's blocks first), in the next plan. The cursor counts offload blocks of
    ``Config.offload_block_size`` tokens: every group's offload blocks end on those boundaries, and each is offered
    once the cursor passes its end.
  * a shared store (attach_shared_tier; a fleet's engines share it): every entry a store makes ready is put into
    it with the next plan, pinned until the put ends; a waiting request's lookup first asks the store about the
    keys a hit could read that the tier lacks (once per admission), answers "ask again" (None) until the store
    answers, gives up once the check is older than ``Config.lookup_deadline`` (the store's clock), and gets the
    records that lengthen its hit into reserved tier entries, to load from there (a failed get asks once more: what
    the store found damaged is gone by then, and the blocks checked before it still serve). The engine attaches
    the store with its identity (``records.Namespace``, the weights it computes with included), and again after
    every reset: from a reset until that attach, the store is neither asked nor written (no identity is assumed,
    least of all "the one before, plus one"), and every put and get is made in the namespace of its time.

Worker side
  * handle_preemptions, the one hook before the forward pass, flushes the plan's ``flush`` list: the stores of
    preempted and finished requests, and the stores reading blocks a window freed, before the pass may write those
    blocks;
  * loads (and gets) are submitted in start_load_kv, stores (and puts) in wait_for_save (both after the forward
    pass wrote the blocks); a get lands all of its records, each checked by the store, or none; a synchronous load
    is waited for in start_load_kv (the engine calls it before the forward pass then), and its request is not named
    in finished_recving (it is running; vLLM asserts);
  * a failed load's GPU blocks are reported by get_block_ids_with_load_errors; with several KV cache groups, its
    request is reported in ``failed_recving`` instead (a block id does not say which group's block failed).
"""

from __future__ import annotations

import struct
from collections import Counter
from functools import partial
from typing import Callable, ClassVar, Sequence, cast

from attrs import define, evolve, field

from .config import Config, UnknownRequestError, registered
from .groups import longest_hit
from .records import Namespace
from .store import Answer, SharedTier
from .tier import Admission, Tier
from .types import (FENCED_FREES, GROUPS, NULL_BLOCK, OBSERVE, REFUSE_STORE, RESET, SHARED, SHARED_MEDIUM,
                    TRANSFER_FAILURES, BlockIds, Copy, Event, Job, Key, Observation, RequestView, SchedulerOutput,
                    TransferKind, TransferPlan, WorkerOutput, group_key, offload_keys)
from .executor import Executor
from .memory import ListKV


@define
class Transfer:
    """One request's copies in one direction, built by the scheduler side; a worker submits it as a ``Job``."""

    job_id: int
    req_id: str  # "" for a put or a get: they belong to the tier, not to a request
    kind: TransferKind
    copies: tuple[Copy, ...]
    weights: str = ""  # a put's or a get's: the weights of the namespace its records belong to
    sync: bool = False  # a load the worker waits for before the forward pass (``Config.sync_loads``)

    @property
    def keys(self) -> list[Key]:
        return list(dict.fromkeys(key for _b, key, _s in self.copies))


@define
class SharedLookup:
    """A waiting request's lookup in the shared store, for one admission: one existence check, then at most one get
    of the records it found into the tier. A get that fails asks the store again, once: the store has quarantined
    the records it found damaged by then, so the second answer's hit ends before the first of them, and the checked
    blocks before it still serve. Once settled, the request is answered from the tier alone."""

    keys: list[Key]  # asked about: the keys a hit could read that the tier lacks
    answer: Answer
    get: int | None = None  # the get in flight for it
    settled: bool = False
    asked_again: bool = False


@define
class SpecConnector:
    capabilities: ClassVar[frozenset[str]] = frozenset({OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES, RESET,
                                                        GROUPS, SHARED})
    config: Config
    tier: Tier = field()
    requests: dict[str, RequestView] = field(factory=dict)
    block_tables: dict[str, list[list[int]]] = field(factory=dict)  # one per KV cache group
    cursors: dict[str, int] = field(factory=dict)  # the store cursor, in offload blocks
    unfinished: dict[int, Transfer] = field(factory=dict)  # built, not yet reported by every worker
    reports: Counter[int] = field(factory=Counter)  # job id -> workers that reported it
    failed: set[int] = field(factory=set)  # transfers some worker reported as failed
    poisoned: set[int] = field(factory=set)  # stores of requests that ended with an error: their entries go
    pending_loads: list[Transfer] = field(factory=list)  # for the next plan
    flush_next: set[int] = field(factory=set)  # stores reading blocks freed at a finish, for the next plan
    refusing: set[str] = field(factory=set)  # fault injection: the tier refuses these requests' next store
    next_job_id: int = 0
    # the shared store (attach_shared_tier): this engine's namespace (its shard's, on a worker side), the store
    namespace: Namespace | None = None
    identified: bool = False  # the engine attached the store since the last reset: the namespace is its identity now
    open_store: Callable[[Namespace, int], SharedTier] | None = None
    lookups: dict[str, SharedLookup] = field(factory=dict)  # waiting requests' lookups in the store
    pending_gets: list[Transfer] = field(factory=list)  # for the next plan
    getting: set[Key] = field(factory=set)  # keys a get in flight brings into the tier
    unput: list[Key] = field(factory=list)  # entries stored since the last plan, to put into the store
    views: dict[Namespace, SharedTier] = field(factory=dict)  # the store, opened per namespace (weights)
    # worker side (kv and executor: set by register_kv_caches)
    _kv: ListKV | None = None
    _executor: Executor | None = None
    tier_bytes: dict[tuple[Key, int], int] = field(factory=dict)  # (key, GPU block index in it) -> content
    submitted: dict[int, Transfer] = field(factory=dict)  # worker's view: submitted, not yet polled
    load_errors: set[int] = field(factory=set)  # GPU blocks of failed loads, not yet reported

    @tier.default
    def _tier(self) -> Tier:
        return Tier.with_policy(self.config.policy, self.config.tier_blocks,
                                Admission(self.config.store_threshold, self.config.offers_remembered))

    # ---- scheduler side ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.requests[request.req_id] = request
        if any(t.req_id == request.req_id for t in self.unfinished.values()):
            return 0, False
        if self.identified and not self._shared_settled(request, num_computed_tokens):
            return None, False  # ask again: the store has not answered, or its records are on their way
        end = self._hit(request, num_computed_tokens, self._in_tier)
        if end <= num_computed_tokens:
            return 0, False
        if self._loading(self._hit_keys(request, num_computed_tokens, end)):
            return None, False  # ask again: another request's load brings part of this hit
        return end - num_computed_tokens, not self.config.sync_loads

    def _loading(self, keys: list[Key]) -> bool:
        """Whether another request's asynchronous load reads one of ``keys``. Then this request waits: once that load
        lands, the engine's prefix cache serves it the same blocks, where a load of its own would copy the same KV
        into more blocks, and every later step would read both (a load convoy; vLLM's OffloadingConnector waits too).
        Not without the engine's prefix cache, which would never serve it."""
        loading = {key for t in self.unfinished.values() if t.kind == "load" and not t.sync for key in t.keys}
        return self.config.prefix_caching and not loading.isdisjoint(keys)

    def _hit(self, request: RequestView, computed: int, present: Callable[[Key], bool]) -> int:
        """The longest hit every group can supply, in tokens, leaving one to compute: offload blocks before
        ``computed`` are on the GPU, the others must be ``present``."""
        sizes, keys = self.config.offload_block_sizes, self._keys(request)
        return longest_hit(self.config.groups, sizes, self._limit(request),
                           lambda g, j: (j + 1) * sizes[g] <= computed or present(group_key(keys[g][j], g)))

    def _limit(self, request: RequestView) -> int:
        """Where a hit may end at the latest: one token is left to compute, and only hashed blocks are offloaded."""
        return min(request.num_tokens - 1, len(request.block_hashes) * self.config.block_size)

    def _usable_keys(self, request: RequestView, computed: int) -> list[Key]:
        """The keys a hit from ``computed`` could read, distinct: each group's offload blocks past those the GPU
        holds, up to the limit. The shared store is asked about nothing else."""
        sizes, limit = self.config.offload_block_sizes, self._limit(request)
        return list(dict.fromkeys(
            group_key(key, g) for g, n in enumerate(self.config.hashes_per_offload_block)
            for key in offload_keys(request.block_hashes, n, computed // sizes[g], limit // sizes[g])))

    def _in_tier(self, key: Key) -> bool:
        return self.tier.lookup([key]) == 1

    def _hit_keys(self, request: RequestView, computed: int, end: int) -> list[Key]:
        """The keys a load of tokens ``[computed, end)`` reads: every group's offload blocks there, but a sliding
        window's older ones, which the load skips."""
        k, keys = self.config.k, self._keys(request)
        return list(dict.fromkeys(
            group_key(keys[g][i // k], g)
            for g, (group, size) in enumerate(zip(self.config.groups, self.config.block_sizes))
            for i in range(max(computed // size, group.skipped_blocks(end, size)), end // size)))

    def _shared_settled(self, request: RequestView, computed: int) -> bool:
        """The shared store's part of a lookup; False: ask again. The first lookup asks the store about the keys a hit
        could read that the tier lacks. Once it answers, the records that lengthen the hit are reserved in the tier
        (with the hit's entries already there, kept) and fetched by one get; the lookup is settled when the get ends,
        when the hit needs no record, when the tier has no room for them, or when the store missed the deadline
        (``Config.lookup_deadline`` ticks): a late answer is a miss, never an endless "ask again". A hit that needs a
        record another request's get is bringing waits for that get (else the engine would compute the prefix for this
        request while the record is on its way)."""
        lookup = self.lookups.get(request.req_id)
        if lookup is None:
            missing = [key for key in self._usable_keys(request, computed) if not self._in_tier(key)]
            if not missing:  # the tier has every key a hit could read: nothing to ask
                return True
            namespace = registered(self.namespace, "namespace")
            lookup = self.lookups[request.req_id] = SharedLookup(missing, self._shared(namespace.weights).ask(missing))
        if lookup.settled or lookup.get is not None:
            return lookup.settled
        if not lookup.answer.done():
            lookup.settled = lookup.answer.waited() > self.config.lookup_deadline
            return lookup.settled
        found = {key for key, there in zip(lookup.keys, lookup.answer.result()) if there}
        end = self._hit(request, computed, lambda key: self._in_tier(key) or key in found)
        wanted = self._hit_keys(request, computed, end)
        if self.getting.intersection(wanted):
            return False
        lookup.settled = True
        if not any(key in found and not self._in_tier(key) for key in wanted):
            return True
        fetch = self.tier.prepare_store(wanted, fetched=True)  # keeps the hit's entries, reserves the records
        if fetch:
            get = self._new_transfer("", "get", [(NULL_BLOCK, key, s) for key in fetch for s in range(self.config.k)])
            self.pending_gets.append(get)
            self.getting.update(fetch)
            lookup.get, lookup.settled = get.job_id, False
        return lookup.settled

    def _keys(self, request: RequestView) -> list[list[Key]]:
        """Each group's offload keys, as far as they exist (the key rule at the group's block size)."""
        return [offload_keys(request.block_hashes, n) for n in self.config.hashes_per_offload_block]

    def _tables(self, block_ids: Sequence[int] | Sequence[Sequence[int]] | None) -> list[list[int]]:
        """Block ids as the engine hands them (one sequence per group in a hybrid model): one table per group."""
        if block_ids is None:
            return [[] for _ in self.config.groups]
        if self.config.hybrid:
            return [list(cast(Sequence[int], t)) for t in block_ids]
        return [list(cast(Sequence[int], block_ids))]

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None:
        req = self._known(request.req_id)
        self.lookups.pop(req.req_id, None)
        tables = self.block_tables[req.req_id] = self._tables(block_ids)
        self.cursors[req.req_id] = 0
        if num_external_tokens:
            k, keys, end = self.config.k, self._keys(req), req.num_computed_tokens + num_external_tokens
            copies = [(table[i], group_key(keys[g][i // k], g), i % k)
                      for g, (table, size) in enumerate(zip(tables, self.config.block_sizes))
                      for i in range(req.num_computed_tokens // size, end // size)
                      if table[i] != NULL_BLOCK]  # a window's older blocks: not loaded
            load = self._new_transfer(req.req_id, "load", copies)
            load.sync = self.config.sync_loads
            self.tier.prepare_load(load.keys)
            self.pending_loads.append(load)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        meta = TransferPlan(self.pending_loads, gets=self.pending_gets, puts=self._puts())
        preempted = scheduler_output.preempted_req_ids
        flush = self.flush_next | {t.job_id for t in self.unfinished.values() if t.req_id in preempted
                                   and t.kind == "store"}
        self.pending_loads, self.flush_next = [], set()
        self.pending_gets = []
        for req_id in preempted & self.block_tables.keys():  # it may have finished since
            self.block_tables[req_id], self.cursors[req_id] = self._tables(None), 0
        for s in scheduler_output.scheduled:
            req = self._known(s.req_id)
            flush |= self._reading_left_behind(s.req_id, s.num_computed_tokens)
            if s.kind == "running":
                self._extend(self.block_tables[s.req_id], self._tables(s.group_block_ids or s.block_ids))
            else:
                self.block_tables[s.req_id] = self._tables(s.group_block_ids or s.block_ids or ())
                self.cursors[s.req_id] = 0
            store = self._store(req, s.num_computed_tokens,
                                (s.num_computed_tokens + s.num_scheduled_tokens) // self.config.offload_block_size)
            if store:
                meta.stores.append(store)
        meta.flush = frozenset(flush)
        return meta

    @staticmethod
    def _extend(tables: list[list[int]], new: list[list[int]]) -> None:
        """Append a step's new blocks. A block is in one place of a request's tables at a time: one given again
        moved there (a state group's speculative block, which vLLM moves to the end of its table), or came back
        after a sliding window freed it; the engine holds the null block where it was."""
        moved = {b for blocks in new for b in blocks} - {NULL_BLOCK}
        for table in tables:
            table[:] = [NULL_BLOCK if b in moved else b for b in table]
        for table, blocks in zip(tables, new):
            table += blocks

    def _reading_left_behind(self, req_id: str, computed: int) -> set[int]:
        """Stores of this request that read a block its sliding windows left behind: the engine may have freed it
        this step (it does not say), so they finish before the forward pass writes anything."""
        tables = self.block_tables.get(req_id, [])
        left = {b for table, group, size in zip(tables, self.config.groups, self.config.block_sizes)
                for b in table[:group.skipped_blocks(computed, size)]}
        return {t.job_id for t in self.unfinished.values()
                if t.req_id == req_id and t.kind == "store" and left & {b for b, _k, _s in t.copies}}

    def _store(self, req: RequestView, computed: int, full: int) -> Transfer | None:
        """Offer the offload blocks that end in (cursor, full] (in offload blocks of ``offload_block_size``) to the
        tier, in order of their end, as far as their keys exist; a transfer for those it accepts. In a hybrid
        model, not the blocks of a sliding window that the engine may have freed: those before the window of the
        ``computed`` tokens (the engine does not say which it freed)."""
        k, tables, keys, sizes = self.config.k, self.block_tables[req.req_id], self._keys(req), self.config.block_sizes
        full = min(full, len(req.block_hashes) // k)
        if self.config.store_prompts_only:  # only offload blocks of prompt tokens are offered
            full = min(full, req.num_prompt_tokens // self.config.offload_block_size)
        start, self.cursors[req.req_id] = self.cursors[req.req_id], max(full, self.cursors[req.req_id])
        gone = [group.skipped_blocks(computed, size) for group, size in zip(self.config.groups, sizes)]
        ratios = [size // self.config.block_size for size in sizes]  # offload blocks of offload_block_size in one
        ends = [(end // r - 1, g) for end in range(start + 1, full + 1)  # (group's offload block ending there, group)
                for g, r in enumerate(ratios) if end % r == 0]
        offered = [(j, g) for j, g in ends if j * k >= gone[g] and NULL_BLOCK not in tables[g][j * k:j * k + k]]
        accepted = self.tier.prepare_store([group_key(keys[g][j], g) for j, g in offered],
                                           refuse=req.req_id in self.refusing)
        if accepted is None:  # refused for lack of room: skip this request only
            self.refusing.discard(req.req_id)
        if not accepted:  # ([]: all present already)
            return None
        copies = [(tables[g][j * k + s], group_key(keys[g][j], g), s) for j, g in offered
                  if group_key(keys[g][j], g) in accepted for s in range(k)]
        return self._new_transfer(req.req_id, "store", copies)

    def _puts(self) -> list[Transfer]:
        """One put of the entries stored since the last plan that the tier still holds, each pinned until it ends
        (a promotion may have evicted one meanwhile, a reset made it stale)."""
        keys, self.unput = [key for key in self.unput if self._in_tier(key)], []
        if not keys:
            return []
        self.tier.pin(keys)
        return [self._new_transfer("", "put", [(NULL_BLOCK, key, s) for key in keys for s in range(self.config.k)])]

    def _new_transfer(self, req_id: str, kind: TransferKind, copies: list[Copy]) -> Transfer:
        weights = self.namespace.weights if self.namespace is not None else ""
        transfer = Transfer(self.next_job_id, req_id, kind, tuple(copies), weights)
        self.next_job_id += 1
        self.unfinished[transfer.job_id] = transfer
        return transfer

    def update_connector_output(self, output: WorkerOutput) -> None:
        for job_id, success in output.job_results:
            if job_id not in self.unfinished:
                raise UnknownRequestError(f"completion for unknown job {job_id}")
            self.reports[job_id] += 1
            if not success:
                self.failed.add(job_id)
            if self.reports[job_id] < self.config.num_workers:
                continue
            transfer, success = self.unfinished.pop(job_id), job_id not in self.failed | self.poisoned
            del self.reports[job_id]
            self.failed.discard(job_id)
            self.poisoned.discard(job_id)
            self._completed(transfer, success)

    def _completed(self, transfer: Transfer, success: bool) -> None:
        """A transfer every worker reported. A store's new entries are put into the shared store with the next
        plan; a get's records became tier entries, or left none, and its lookup is settled."""
        if transfer.kind == "store":
            stored = self.tier.complete_store(transfer.keys, success)
            if self.identified:
                self.unput += stored
        elif transfer.kind == "get":
            self.tier.complete_store(transfer.keys, success)
            self.getting.difference_update(transfer.keys)
            for lookup in self.lookups.values():
                if lookup.get == transfer.job_id:
                    self._got(lookup, success)
        else:  # a put never makes its entries stale: the tier still holds what it read
            self.tier.complete_load(transfer.keys, success or transfer.kind == "put")
            if transfer.kind == "put" and success:  # every record is in the store (this worker's or another's)
                self.tier.events.append(Event("stored", tuple(transfer.keys), SHARED_MEDIUM))

    def _got(self, lookup: SharedLookup, success: bool) -> None:
        """Its get ended: the lookup is settled, unless that get failed and the store was not asked again yet."""
        if success or lookup.asked_again:
            lookup.settled = True
        else:
            store = self._shared(registered(self.namespace, "namespace").weights)
            lookup.answer, lookup.get, lookup.asked_again = store.ask(lookup.keys, fresh=True), None, True

    def request_finished(self, request: RequestView, block_ids: BlockIds) -> bool:
        """Free now: the stores still reading the request's blocks are flushed with the next plan, before the engine
        may reuse those blocks (it frees them at once, and a window's as the request finishes)."""
        self._known(request.req_id)
        for state in (self.requests, self.block_tables, self.cursors, self.lookups):
            state.pop(request.req_id, None)
        self.refusing.discard(request.req_id)
        stores = {t.job_id for t in self.unfinished.values() if t.req_id == request.req_id and t.kind == "store"}
        self.flush_next |= stores
        if request.failed:  # it may have computed from a block a synchronous load failed to fill: its KV is garbage
            self.poisoned |= stores
        return False

    def reset_cache(self) -> bool:
        """Every entry goes stale, and the engine's identity is unknown until it attaches the store again (the
        weights may have changed): no record is asked for or put meanwhile, and no replica's store is wiped."""
        self.tier.reset()
        self.lookups.clear()
        self.identified = False
        return True

    def take_events(self) -> list[Event]:
        events, self.tier.events = self.tier.events, []
        return events

    def _known(self, req_id: str) -> RequestView:
        if req_id not in self.requests:
            raise UnknownRequestError(f"unknown request id {req_id!r}: the connector never saw it")
        return self.requests[req_id]

    # ---- worker side ---------------------------------------------------------------------------------------
    def register_kv_caches(self, kv: ListKV, executor: Executor) -> None:
        self._kv, self._executor = kv, executor

    def attach_shared_tier(self, open: Callable[[Namespace, int], SharedTier], namespace: Namespace) -> None:
        self.open_store, self.namespace, self.identified = open, namespace, True

    def _shared(self, weights: str) -> SharedTier:
        """The store's records of this engine's namespace with ``weights`` (a transfer's: that of its time)."""
        namespace = evolve(registered(self.namespace, "namespace"), weights=weights)
        if namespace not in self.views:
            self.views[namespace] = registered(self.open_store, "open_store")(namespace, 8 * self.config.k)
        return self.views[namespace]

    @property
    def kv(self) -> ListKV:
        return registered(self._kv, "kv")

    @property
    def executor(self) -> Executor:
        return registered(self._executor, "executor")

    def handle_preemptions(self, metadata: TransferPlan) -> None:
        self.executor.flush(set(metadata.flush))

    def start_load_kv(self, metadata: TransferPlan) -> None:
        for load in metadata.loads:
            self._submit(load, partial(self._copy_in, load))
        self.executor.wait({load.job_id for load in metadata.loads if load.sync})
        for get in metadata.gets:
            self._submit(get, partial(self._get, get))

    def wait_for_save(self, metadata: TransferPlan) -> None:
        for store in metadata.stores:
            self._submit(store, partial(self._copy_out, store))
        for put in metadata.puts:
            self._submit(put, partial(self._put, put))

    def _copy_in(self, load: Transfer) -> None:  # tier -> GPU
        for b, key, s in load.copies:
            self.kv.write(b, self.tier_bytes[key, s])

    def _copy_out(self, store: Transfer) -> None:  # GPU -> tier
        self.tier_bytes.update({(key, s): self.kv.read(b) for b, key, s in store.copies})

    def _get(self, get: Transfer) -> bool:  # shared store -> tier: all of its records, or none
        k, keys = self.config.k, get.keys
        buffers = [bytearray(8 * k) for _ in keys]
        if not all(self._shared(get.weights).get(keys, [memoryview(b) for b in buffers])):
            return False
        for key, buffer in zip(keys, buffers):
            self.tier_bytes.update({(key, s): content for s, content in enumerate(struct.unpack(f"<{k}q", buffer))})
        return True

    def _put(self, put: Transfer) -> bool:  # tier -> shared store; False if the store dropped a record
        k = self.config.k
        outcomes = self._shared(put.weights).put([(key, struct.pack(f"<{k}q", *(self.tier_bytes[key, s]
                                                                            for s in range(k))))
                                                for key in put.keys])
        return not any(outcome.startswith("dropped") for outcome in outcomes)

    def _submit(self, transfer: Transfer, run: Callable[[], bool | None]) -> None:
        for b, _key, _s in transfer.copies:
            if b != NULL_BLOCK:  # a put or a get touches no GPU block
                self.kv.check(b)
        self.submitted[transfer.job_id] = transfer
        self.executor.submit(Job(transfer.job_id, transfer.req_id, transfer.kind, transfer.copies, run))

    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput:
        results = self.executor.poll()
        done = [self.submitted.pop(job_id) for job_id, _success in results]
        failed = [t for t, (_id, success) in zip(done, results) if t.kind == "load" and not success]
        if self.config.hybrid:  # a block id does not say which group's block failed: the whole request
            failed_recving = {t.req_id for t in failed}
        else:  # its blocks: the engine keeps the valid prefix
            failed_recving = set()
            self.load_errors |= {b for t in failed for b, _k, _s in t.copies}
        recving = {t.req_id for t in done if t.kind == "load" and not t.sync}  # a synchronous one's is running
        return WorkerOutput(frozenset(), frozenset(recving), tuple(results), frozenset(failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # ---- for the kit ---------------------------------------------------------------------------------------
    def observe(self) -> Observation:
        return Observation(
            tracked={r: tuple(map(tuple, t)) if self.config.hybrid else tuple(t[0])
                     for r, t in self.block_tables.items()},
            cursors=dict(self.cursors),
            tier=self.tier.view(),
            jobs=tuple(sorted((t.req_id, t.kind, t.copies) for t in self.unfinished.values())),
            tier_state=self.tier.policy.state(),
        )

    def refuse_next_store(self, req_id: str) -> None:
        self.refusing.add(req_id)
