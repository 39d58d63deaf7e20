"""Scheduler side of the production connector: per-step work proportional to the blocks that changed.

Per request it keeps the block table, the store cursor and a count of its unfinished transfers; keys are read
straight from the request's block hashes (the spec's key rule, ``key_index`` / ``offload_keys``), only for the
offload blocks a lookup, load or store touches. A request with no offload block completed this step costs a dict
lookup and a few integer comparisons. The cursor never passes the hashes (the timing rule of ``RequestView``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Callable, cast

from attrs import define, field

from kvoffload.spec.config import Config, UnknownRequestError
from kvoffload.spec.records import Namespace
from kvoffload.spec.store import Answer
from kvoffload.spec.types import (NULL_BLOCK, SHARED_MEDIUM, BlockIds, Copy, Event, Key, RequestView, SchedulerOutput,
                                  TransferKind, TransferPlan, WorkerOutput, group_key, key_index, offload_keys)

from .shared import Opener, SharedStore
from .tier import OffloadTier


@define(slots=True)
class RequestState:
    request: RequestView
    block_tables: list[list[int]] = field(factory=lambda: [[]])  # one per KV cache group
    cursor: int = 0  # the store cursor: offload blocks already offered to the tier
    unfinished: int = 0  # transfers built and not yet reported by every worker
    unfinished_stores: int = 0  # of which stores
    allocated: bool = False  # blocks were allocated at least once (a lookup alone tracks nothing)
    store_lookup: StoreLookup | None = None  # its lookup in the shared store, until it is admitted


@define(slots=True)
class StoreLookup:
    """A waiting request's existence check in the shared store: asked once per admission, answered or given up
    after ``Config.lookup_deadline`` (the store's clock), then at most one get of the records that lengthen its
    hit; if that get fails, asked once more (the store quarantined what was damaged: the hit before it serves)."""

    keys: list[Key]
    answer: Answer
    get_job: int | None = None
    settled: bool = False
    asked_again: bool = False


@define(slots=True)
class Transfer:
    """One request's copies in one direction, built by the scheduler side; a worker submits it as a ``Job``."""

    job_id: int
    req_id: str  # "" for a put or a get: the tier's, not a request's
    kind: TransferKind
    keys: list[int]  # distinct, in order
    copies: list[Copy]  # (GPU block, key, index of that GPU block inside its offload block); NULL_BLOCK: put, get
    host_rows: list[int]  # host row of each copy
    reports: int = 0  # workers that reported it
    success: bool = True  # every report so far was a success
    weights: str = ""  # a put's or a get's: the weights of the namespace its records belong to
    sync: bool = False  # a load the worker waits for before the forward pass (``Config.sync_loads``)

    @property
    def gpu_blocks(self) -> list[int]:
        return [block for block, _key, _sub in self.copies]


class OffloadScheduler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.k, self.block_size, self.offload_size = config.k, config.block_size, config.offload_block_size
        self.tier = OffloadTier(config.tier_blocks, config.policy, config.store_threshold, config.offers_remembered)
        self.reaches = [group.reach for group in config.groups]  # tokens a group reads back; None: all (full attention)
        self.block_sizes, self.offload_sizes = config.block_sizes, config.offload_block_sizes
        self.strides = config.hashes_per_offload_block  # hashes per offload block, per group
        self.ratios = [n // config.k for n in self.strides]  # offload blocks of offload_size in one, per group
        self.hit_step = math.lcm(*self.offload_sizes)  # a hit ends on an offload block boundary of every group
        self.hybrid = config.hybrid  # block ids come one table per group
        self.windowed = any(r is not None for r in self.reaches)  # a window or a state frees blocks while requests run
        self.grouped = self.hybrid or self.windowed  # else the single-group fast paths
        self.requests: dict[str, RequestState] = {}
        self.num_workers = config.num_workers
        self.unfinished: dict[int, Transfer] = {}  # built, not yet reported by every worker
        self._pending_loads: list[Transfer] = []  # for the next plan
        self._flush_next: set[int] = set()  # stores reading blocks freed at a finish, for the next plan
        self.refusing: set[str] = set()  # fault injection: the tier refuses these requests' next store
        self.origin: dict[int, tuple[int, int]] = {}  # a later group's tier key -> (block hash, group): for events
        self._leaving: set[int] = set()  # keys that left the tier: their origins go once no unread event names them
        self._job_ids = itertools.count()
        self.counters = dict.fromkeys(("lookups", "hit_tokens", "stored_blocks", "loaded_blocks",
                                       "sync_loaded_blocks", "failed_stores", "failed_loads", "shared_lookups",
                                       "shared_deadline_misses", "shared_got_blocks", "shared_failed_gets",
                                       "shared_put_blocks"), 0)
        self.shared: SharedStore | None = None  # the shared store, once attached (for existence checks)
        self.identified = False  # attached since the last reset: the store's namespace is the engine's identity now
        self._pending_gets: list[Transfer] = []
        self._get_for: dict[int, RequestState] = {}  # a get in flight -> the request whose lookup it serves
        self._getting: set[Key] = set()  # keys a get in flight brings into the tier
        self._loading: Counter[Key] = Counter()  # keys asynchronous loads in flight read -> how many loads
        self._unput: list[Key] = []

    def _state(self, req_id: str) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {req_id!r}: the connector never saw it")
        return state

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.requests.get(request.req_id)
        if state is None:
            state = self.requests[request.req_id] = RequestState(request, [[] for _ in self.reaches])
        self.counters["lookups"] += 1
        if state.unfinished:
            return 0, False  # no load while this request's stores are in flight
        if self.identified and not self._store_settled(cast(SharedStore, self.shared), state, num_computed_tokens):
            return None, False  # ask again: the store has not answered, or its records are on their way
        end = self._hit_end(request, num_computed_tokens, self.tier.is_ready)
        if end <= num_computed_tokens:
            return 0, False
        if self._loading and self.config.prefix_caching and \
                not self._loading.keys().isdisjoint(self._keys_read(request.block_hashes, num_computed_tokens, end)):
            return None, False  # ask again: another request's load brings part of this hit, for the engine to share
        return end - num_computed_tokens, not self.config.sync_loads

    def _hit_end(self, request: RequestView, computed: int, ready: Callable[[Key], bool]) -> int:
        """Where the longest hit from ``computed`` ends, its offload blocks all ``ready``."""
        hashes, k, size = request.block_hashes, self.k, self.offload_size
        if self.grouped:
            return self._groups_hit(hashes, computed, min(request.num_tokens - 1, len(hashes) * self.block_size),
                                    ready)
        j = computed // size
        limit = min((request.num_tokens - 1) // size, len(hashes) // k)
        key = key_index(j, k)  # then each offload block's key is k hashes further
        while j < limit and ready(hashes[key]):
            j, key = j + 1, key + k
        return j * size

    def _ready(self, hashes: list[int], g: int, j: int, ready: Callable[[Key], bool]) -> bool:
        return ready(group_key(hashes[key_index(j, self.strides[g])], g))

    def _groups_hit(self, hashes: list[int], computed: int, last: int, ready: Callable[[Key], bool]) -> int:
        """The furthest token a hit can end at (at most ``last``; offload blocks before ``computed`` are on the
        GPU) such that every group finds what it reads there in the tier: full attention every offload block, up to
        its first missing one; a window its last ones. Windows lower the end until all of them agree (vLLM's fixed
        point), in time linear in the blocks scanned."""
        step, end = self.hit_step, last // self.hit_step * self.hit_step
        for g, (reach, size) in enumerate(zip(self.reaches, self.offload_sizes)):
            if reach is None:
                j = computed // size
                while (j + 1) * size <= end and self._ready(hashes, g, j, ready):
                    j += 1
                end = min(end, j * size // step * step)
        while end > computed:
            lowered = end
            for g, (reach, size) in enumerate(zip(self.reaches, self.offload_sizes)):
                if reach is not None:
                    lowered = self._window_end(hashes, g, -(-reach // size), computed, lowered, ready)
            if lowered == end:
                break
            end = lowered
        return end

    def _window_end(self, hashes: list[int], g: int, need: int, computed: int, end: int,
                    ready: Callable[[Key], bool]) -> int:
        """The furthest hit end at most ``end`` whose last ``need`` offload blocks of windowed group ``g`` (those
        after ``computed``) are ready: below the highest missing one, until none is missing."""
        size = self.offload_sizes[g]
        while end > computed:
            top = end // size
            missing = next((j for j in range(top - 1, max(computed // size, top - need) - 1, -1)
                            if not self._ready(hashes, g, j, ready)), None)
            if missing is None:
                return end
            end = missing * size // self.hit_step * self.hit_step
        return end

    # ---- the shared store ----
    def attach_shared_tier(self, open: Opener, namespace: Namespace) -> None:
        """At start, and after every reset with the identity the engine has from then on."""
        if self.shared is None:
            self.shared = SharedStore(open, namespace, payload=0)  # the scheduler side reads no record
        self.shared.namespace, self.identified = namespace, True

    def _store_settled(self, shared: SharedStore, state: RequestState, computed: int) -> bool:
        """The shared store's part of a lookup (False: ask again): one existence check of the keys a hit could read
        that the tier lacks, then one get of the records that lengthen the hit into reserved tier slots (the hit's
        entries kept). Settled once the get ends, when nothing needs getting or there is no room, or past the
        deadline."""
        lookup = state.store_lookup
        if lookup is None:
            keys = self._usable_keys(state.request, computed)
            missing = self.tier.missing(keys)
            if not missing:
                return True  # the tier holds all a hit could read: no question for the store
            lookup = state.store_lookup = StoreLookup(missing, shared.at().ask(missing))
            self.counters["shared_lookups"] += 1
        if lookup.settled or lookup.get_job is not None:
            return lookup.settled
        if not lookup.answer.done():
            lookup.settled = lookup.answer.waited() > self.config.lookup_deadline
            self.counters["shared_deadline_misses"] += lookup.settled
            return lookup.settled
        there = lookup.answer.result()
        if not self._getting and True not in there:  # the common answer: the hit is the tier's own, nothing to wait for
            lookup.settled = True
            return True
        found = {key for key, present in zip(lookup.keys, there) if present}
        end = self._hit_end(state.request, computed, lambda key: self.tier.is_ready(key) or key in found)
        read = self._keys_read(state.request.block_hashes, computed, end)
        if not self._getting.isdisjoint(read):
            return False  # another request's get brings part of this hit: wait for it, not compute it
        lookup.settled = True
        if any(key in found and not self.tier.is_ready(key) for key in read):
            slots = self.tier.prepare_store(list(read), fetched=True)  # the hit's entries kept, the records' reserved
            if slots:
                k = self.k
                for key in slots:
                    if read[key][1]:  # a later group's key: its event names the hash and the group
                        self.origin[key] = read[key]
                get = self._new_transfer(None, "get", list(slots),
                                         [(NULL_BLOCK, key, sub) for key in slots for sub in range(k)],
                                         [slot * k + sub for slot in slots.values() for sub in range(k)])
                self._pending_gets.append(get)
                self._get_for[get.job_id] = state
                self._getting.update(slots)
                lookup.get_job, lookup.settled = get.job_id, False
        return lookup.settled

    def _usable_keys(self, request: RequestView, computed: int) -> list[Key]:
        """The keys a hit from ``computed`` could read: past the offload blocks on the GPU, up to the hit's limit."""
        hashes = request.block_hashes
        if not self.grouped:  # one group: its keys are the hashes themselves, and distinct
            size = self.offload_size
            return offload_keys(hashes, self.k, computed // size, (request.num_tokens - 1) // size)
        last = min(request.num_tokens - 1, len(hashes) * self.block_size)
        return list(dict.fromkeys(group_key(h, g) for g, (n, size) in enumerate(zip(self.strides, self.offload_sizes))
                                  for h in offload_keys(hashes, n, computed // size, last // size)))

    def _keys_read(self, hashes: list[int], computed: int, end: int) -> dict[Key, tuple[int, int]]:
        """The keys a load of tokens [computed, end) reads (every group's, but the blocks a window skips), each
        with its block hash and group."""
        k, read = self.k, {}
        if not self.grouped:  # one group: the keys are the hashes of the offload blocks' last GPU blocks
            size = self.offload_size
            return {h: (h, 0) for h in offload_keys(hashes, k, computed // size, end // size)}
        for g, (size, n) in enumerate(zip(self.block_sizes, self.strides)):
            for p in range(max(computed // size, self._left_behind(g, end)), end // size):
                block_hash = hashes[key_index(p // k, n)]
                read[group_key(block_hash, g)] = (block_hash, g)
        return read

    def _puts(self) -> list[Transfer]:
        """One put of what the tier stored since the last plan and still holds, pinned until it ends; before this
        plan's stores may evict it."""
        (keys, slots), self._unput = self.tier.pin_ready(self._unput), []
        if not keys:
            return []
        k, subs = self.k, range(self.k)
        self.counters["shared_put_blocks"] += len(keys) * k
        return [self._new_transfer(None, "put", keys, [(NULL_BLOCK, key, sub) for key in keys for sub in subs],
                                   [slot * k + sub for slot in slots for sub in subs])]

    def _tables(self, block_ids: BlockIds | tuple[int, ...] | tuple[tuple[int, ...], ...]) -> list[list[int]]:
        return [list(t) for t in block_ids] if self.hybrid else [list(block_ids)]  # type: ignore[arg-type]

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None:
        state = self._state(request.req_id)
        tables = state.block_tables = self._tables(block_ids)
        state.cursor, state.allocated, state.store_lookup = 0, True, None
        self.counters["hit_tokens"] += num_external_tokens  # counted once the engine commits to the load
        if num_external_tokens:
            k, hashes = self.k, request.block_hashes
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_external_tokens
            copies = [(table[p], group_key(hashes[key_index(p // k, n)], g), p % k)
                      for g, (table, size, n) in enumerate(zip(tables, self.block_sizes, self.strides))
                      for p in range(start // size, end // size)
                      if table[p] != NULL_BLOCK]  # a window's older blocks: not loaded
            load_keys = list(dict.fromkeys(key for _block, key, _sub in copies))
            slot_of = dict(zip(load_keys, self.tier.prepare_load(load_keys)))
            host_rows = [slot_of[key] * k + sub for _block, key, sub in copies]
            load = self._new_transfer(state, "load", load_keys, copies, host_rows)
            load.sync = self.config.sync_loads
            self._pending_loads.append(load)
            if not load.sync:
                self._loading.update(load_keys)

    def _new_transfer(self, state: RequestState | None, kind: TransferKind, keys: list[int], copies: list[Copy],
                      host_rows: list[int]) -> Transfer:
        """A transfer of a request (``state``), or of the tier (None: a put or a get)."""
        if state is None:  # a put's or a get's: its records' namespace
            transfer = Transfer(next(self._job_ids), "", kind, keys, copies, host_rows,
                                weights=cast(SharedStore, self.shared).namespace.weights)
        else:
            transfer = Transfer(next(self._job_ids), state.request.req_id, kind, keys, copies, host_rows)
            state.unfinished += 1
            state.unfinished_stores += kind == "store"
        self.unfinished[transfer.job_id] = transfer
        return transfer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TransferPlan:
        plan = TransferPlan(self._pending_loads, gets=self._pending_gets, puts=self._puts() if self._unput else [])
        flush, self._pending_loads, self._flush_next = self._flush_next, [], set()
        self._pending_gets = []
        preempted = scheduler_output.preempted_req_ids
        if preempted:  # their stores finish before the forward pass may write their blocks for someone else
            flush |= {t.job_id for t in self.unfinished.values() if t.kind == "store" and t.req_id in preempted}
        for req_id in preempted:
            state = self.requests.get(req_id)
            if state is not None:  # else it finished since it was preempted
                state.block_tables, state.cursor = [[] for _ in self.reaches], 0
        requests, size, hybrid, windowed = self.requests, self.offload_size, self.hybrid, self.windowed
        # the hot loop: most requests only decode a token (a ScheduledRequest unpacked: cheaper than its fields)
        for req_id, kind, block_ids, computed, scheduled, group_block_ids in scheduler_output.scheduled:
            state = requests.get(req_id) or self._state(req_id)
            if windowed and state.unfinished_stores:
                flush |= self._reading_left_behind(state, computed)
            if hybrid:
                if kind != "running" or group_block_ids:  # else no new block in any group
                    self._update_tables(state, kind, group_block_ids, windowed)
            elif kind == "running":
                if block_ids:
                    if windowed:
                        self._forget_moved(state.block_tables, (block_ids,))
                    state.block_tables[0] += block_ids
            else:
                state.block_tables, state.cursor = [list(block_ids or ())], 0
            full = (computed + scheduled) // size
            if full > state.cursor:
                store = self._store(state, full, computed)
                if store is not None:
                    plan.stores.append(store)
        plan.flush = frozenset(flush)
        return plan

    @classmethod
    def _update_tables(cls, state: RequestState, kind: str, new: tuple[tuple[int, ...], ...] | None,
                       windowed: bool) -> None:
        """A hybrid model's tables: this step's new blocks per group (running), or every group's whole table."""
        if kind != "running":
            state.block_tables, state.cursor = [list(table) for table in new or ()], 0
        elif new:
            if windowed:
                cls._forget_moved(state.block_tables, new)
            for table, blocks in zip(state.block_tables, new):
                table += blocks

    @staticmethod
    def _forget_moved(tables: list[list[int]], new: tuple[tuple[int, ...], ...]) -> None:
        """Only a group that frees blocks while the request runs (a window, a state) can be given a block it holds
        already: the engine moved it (a state's speculative block goes to the end of its table) or freed it there
        and gave it back. Its old place is the null block now."""
        given = {block for blocks in new for block in blocks}
        given.discard(NULL_BLOCK)
        for table in tables:
            if not given.isdisjoint(table):
                table[:] = [NULL_BLOCK if block in given else block for block in table]

    def _left_behind(self, group: int, computed: int) -> int:
        """Leading blocks of a group's table that the engine may have freed (a sliding window's, once ``computed``
        tokens are computed): it frees them without telling."""
        reach = self.reaches[group]
        return 0 if reach is None else max(0, computed - reach) // self.block_sizes[group]

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
        if self.config.store_prompts_only:  # only offload blocks of prompt tokens are offered
            full = min(full, state.request.num_prompt_tokens // self.offload_size)
        if self.grouped:
            return self._store_groups(state, first, min(full, len(state.request.block_hashes) // k), computed)
        keys = offload_keys(state.request.block_hashes, k, first, full)
        if not keys:
            return None
        state.cursor = first + len(keys)
        table = state.block_tables[0]
        slots = self.tier.prepare_store(keys, refuse=state.request.req_id in self.refusing,
                                        gpu_blocks=[table[j * k] for j in range(first, first + len(keys))])
        if slots is None:  # refused: this request only
            self.refusing.discard(state.request.req_id)
        if not slots:  # ({}: all present)
            return None
        copies, host_rows = [], []
        for j, key in enumerate(keys, start=first):
            slot = slots.get(key)
            if slot is not None:
                for sub in range(k):
                    copies.append((table[j * k + sub], key, sub))
                    host_rows.append(slot * k + sub)
        return self._new_transfer(state, "store", list(slots), copies, host_rows)

    def _store_groups(self, state: RequestState, first: int, full: int, computed: int) -> Transfer | None:
        """The offload blocks of every group that end in (first, full] (in offload blocks of ``offload_size``), by
        their end; not the blocks a window may have freed."""
        if full <= first:
            return None
        state.cursor = full
        k, tables, hashes = self.k, state.block_tables, state.request.block_hashes
        kept = [self._left_behind(g, computed) for g in range(len(self.ratios))]  # a group's first block still held
        offered = []  # (offload block of its group, group, hash of its last block, its key)
        for end in range(first + 1, full + 1):
            for g, ratio in enumerate(self.ratios):
                j = end // ratio - 1
                if not end % ratio and j * k >= kept[g] and NULL_BLOCK not in tables[g][j * k:j * k + k]:
                    block_hash = hashes[key_index(j, self.strides[g])]
                    offered.append((j, g, block_hash, group_key(block_hash, g)))
        slots = self.tier.prepare_store([key for _j, _g, _h, key in offered],
                                        refuse=state.request.req_id in self.refusing,
                                        gpu_blocks=[tables[g][j * k] for j, g, _h, _key in offered])
        if slots is None:  # refused: this request only
            self.refusing.discard(state.request.req_id)
        if not slots:
            return None
        copies, host_rows = [], []
        for j, g, block_hash, key in offered:
            slot = slots.get(key)
            if slot is not None:
                if g:
                    self.origin[key] = (block_hash, g)
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
                stored = self.tier.complete_store(transfer.keys, success)
                if not success:
                    self._leaving.update(transfer.keys)
                if self.identified:
                    self._unput += stored
                self.counters["stored_blocks" if success else "failed_stores"] += len(transfer.copies)
            elif transfer.kind == "get":
                self._got(transfer, success)
            elif transfer.kind == "put":
                self.tier.unpin(transfer.keys)  # a failed put leaves the tier's entry as it was
                if success:  # the store holds every record (this engine's, or a faster replica's)
                    self.tier.events.append(Event("stored", tuple(transfer.keys), SHARED_MEDIUM))
                    cast(SharedStore, self.shared).published(transfer.weights, transfer.keys)
            else:
                self.tier.complete_load(transfer.keys, success)
                if not transfer.sync:
                    self._loading -= Counter(transfer.keys)  # (and forgets the keys no load reads now)
                self.counters["loaded_blocks" if success else "failed_loads"] += len(transfer.copies)
                self.counters["sync_loaded_blocks"] += len(transfer.copies) if success and transfer.sync else 0

    def _got(self, get: Transfer, success: bool) -> None:
        """A get ended: its records are tier entries now, or none is; the lookup it served is settled, or asks the
        store again after its first failed get."""
        if not success:
            self._leaving.update(get.keys)
        self.tier.complete_store(get.keys, success)
        self._getting.difference_update(get.keys)
        self.counters["shared_got_blocks" if success else "shared_failed_gets"] += len(get.copies)
        lookup = self._get_for.pop(get.job_id).store_lookup
        if lookup is None or lookup.get_job != get.job_id:
            return
        if success or lookup.asked_again:
            lookup.settled = True
        else:
            lookup.answer = cast(SharedStore, self.shared).at().ask(lookup.keys, fresh=True)
            lookup.get_job, lookup.asked_again = None, True
            self.counters["shared_lookups"] += 1

    def has_pending_push_work(self) -> bool:
        """Transfers in flight, or stores landed since the last plan whose put into the shared store the next plan
        makes: either needs the engine to step again, requests or none."""
        return bool(self.unfinished or self._unput)

    def request_finished(self, request: RequestView, block_ids: BlockIds) -> bool:
        state = self._state(request.req_id)
        del self.requests[request.req_id]
        state.store_lookup = None  # a get in flight for it settles nothing now
        self.refusing.discard(request.req_id)
        if state.unfinished_stores:  # they still read its blocks, which the engine frees now: flushed before reuse
            stores = [t for t in self.unfinished.values() if t.req_id == request.req_id and t.kind == "store"]
            self._flush_next |= {t.job_id for t in stores}
            if request.failed:  # it may have computed from a block a synchronous load failed to fill: garbage
                for store in stores:
                    store.success = False  # completes as failed: no entry
        return False

    def reset_cache(self) -> bool:
        """After a weight update: nothing stored so far may be served again, and the engine's identity is unknown
        until it attaches the store again (the weights may have changed): meanwhile the store is neither asked
        nor written, and it is left alone."""
        self.tier.reset()
        for state in self.requests.values():
            state.store_lookup = None
        self.identified = False
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
