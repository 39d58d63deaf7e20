"""Black-box mode: any vLLM KV connector (``KVConnectorBase_V1``, scheduler side) driven by the kit's world.

``BlackBox`` is a kit adapter. It feeds the connector real vLLM ``Request``, ``KVCacheBlocks`` and
``SchedulerOutput`` objects built from the world, and plays the worker side itself: each transfer the connector's
metadata asks for becomes a world job that the environment executes, holds back and reorders, and completions go
back in the connector's own worker metadata. Nothing inside the connector is read; the checks come from what it
emits:

  * every GPU block a store or load names must be in that request's block table, at a full block (a connector
    whose tracked table drifted, as in the v0.11 seed bug, names blocks the request does not hold, or wrong ones);
  * the world then checks the bytes each store reads as it executes (SRC), every computed block after every rule
    (CONTENT: a load from the wrong tier slot shows here), delayed frees, flushes before reuse, completions once.

This module imports no vLLM module: what differs between vLLM releases (where classes live, their fields, how a
connector is built, how vLLM's own ``OffloadingConnector`` writes its metadata) lives in one small module per
release, ``vllm_<major>_<minor>`` beside this one, each defining a ``Release`` (the interface below). ``release()``
picks the one for the installed vLLM; the factories here take it as an argument too. A connector's metadata format
is its own, so a small ``Transfers`` reader translates it. GPU block ids are shifted by one on the way in and out:
vLLM reserves block 0 as its null block, the world does not.
"""

from __future__ import annotations

import importlib
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Protocol

from attrs import evolve

from kvoffload.spec import (FENCED_FREES, FILES, GARBAGE, GROUPS, NULL_BLOCK, PINS, POOL_STORE, REFUSE_STORE, RESET,
                            TRANSFER_FAILURES, BlockIds, BlockPool, Config, Copy, Event, Executor, Job, Key, ListKV,
                            Request, SchedulerOutput, State, TransferKind, WorkerOutput, group_key, key_index,
                            registered, require)

from . import tiering
from .tiering import HeldIO

NULL_BLOCKS = 1  # vLLM's block 0 is the null block: world block b is vLLM block b + 1
SUPPORTED = ("0.32", "0.33", "0.11")  # a module vllm_<major>_<minor> each


class Transfer(NamedTuple):
    """One transfer a connector's metadata asks for, read by its ``Transfers`` reader."""

    job_id: int
    req_id: str
    kind: str  # "load" | "store"
    gpu_blocks: tuple[int, ...]  # vLLM ids
    tier_slots: tuple[Hashable, ...]  # where each GPU block's bytes live in the tier
    first_positions: tuple[int, ...] | None = None  # per KV cache group, its first block's index in the request
    keys: tuple[Hashable, ...] | None = None  # the offload key each GPU block is copied under, if the metadata says
    groups: tuple[int, ...] | None = None  # the KV cache group of each GPU block, if the metadata says
    sync: bool = False  # a load its request's forward pass of this step reads (done before it: vLLM 0.33)


class Transfers(Protocol):
    """A connector's metadata format: the transfers it asks for, the jobs to flush, and completions back."""

    failures: bool  # the connector accepts failed transfers (success=False)
    fenced: bool  # it frees under in-flight stores and names them in a flush list (types.FENCED_FREES)

    def transfers(self, metadata: Any) -> Iterator[Transfer]: ...
    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]: ...
    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any: ...


class HostSlots(Protocol):
    """The CPU memory the played worker copies GPU blocks into and out of, by tier slot (a dict by default; the
    connector's own memory where its tier reads and writes it too)."""

    def __setitem__(self, slot: Hashable, content: int, /) -> None: ...
    def get(self, slot: Hashable, default: int, /) -> int: ...


class Release(Protocol):
    """What one vLLM release's module provides (``vllm_0_32.Release`` and its siblings): the black box's only way
    to touch vLLM. ``vreq`` is that release's ``Request``; block ids are vLLM's (the null block is 0)."""

    version: str  # "0.32"
    # its CPU tier's LRU can starve a request waiting for promotions (known divergence
    # 'fs-tier-waiting-request-evicts-its-own-prefix')
    lru_starves: bool

    def request(self, req_id: str, prompt: list[int], max_tokens: int, block_size: int) -> Any:
        """A vLLM request whose ``block_hashes`` follow its tokens, as the engine hashes them."""
    def set_status(self, vreq: Any, status: str) -> None:
        """"running", "preempted", "aborted", "stopped" or "error" (a preempted request's progress is reset too)."""
    def blocks(self, vreq: Any, tables: list[list[int]], cached: list[list[Any]]) -> Any:
        """The ``KVCacheBlocks`` handed to ``update_state_after_alloc``, a table per KV cache group (the null
        block is 0): the first blocks of each carry their hash, ``cached[group]`` (the GPU prefix hit)."""
    def scheduler_output(self, out: SchedulerOutput, vreqs: dict[str, Any],
                         resolve: Callable[[str], tuple[list[int], ...]]) -> Any:
        """vLLM's ``SchedulerOutput`` for the world's (new, cached, resumed, preempted, finished requests, and the
        state blocks handed over by id); ``resolve``: a request's block tables now, in vLLM's ids."""
    def connector_output(self, sending: set[str], recving: set[str], failed: set[str], worker_meta: Any) -> Any:
        """The ``KVConnectorOutput`` that ``update_connector_output`` receives (``failed``: loads failed whole)."""
    def resets(self, connector: Any) -> bool:
        """Whether the connector overrides the base class's ``reset_cache`` (which does nothing)."""
    def hybrid(self, connector: Any) -> bool:
        """Whether the connector supports hybrid models (vLLM's ``SupportsHMA``): tables come one per group."""
    def pins(self, connector: Any) -> bool:
        """Whether the connector takes the engine's GPU block pool (``bind_gpu_block_pool``): PINS."""
    def gpu_block_pool(self, pool: BlockPool, box: BlackBox) -> Any:
        """The world's pool as this release's ``BlockPool`` is read and changed (``simple_cpu.WorldBlockPool``)."""
    def request_finished(self, connector: Any, vreq: Any, tables: list[list[int]]) -> bool:
        """``request_finished`` as the scheduler calls it: every group's table for a ``SupportsHMA`` connector,
        else the one table; whether the free is delayed."""
    def create(self, config: Config, name: str, module: str | None, extra: Callable[[int], dict[str, Any]]) -> Any:
        """The named connector's scheduler side, built as vLLM builds it, over a KV cache shaped like ``config``'s,
        with ``extra(bytes of one GPU block over all layers)`` as its extra config (a group per ``config.groups``,
        their layers overlaying one allocation, as vLLM lays out a hybrid model)."""
    def offloading_connector(self, config: Config, sync_loads: bool | None = None) -> BlackBox:
        """vLLM's own ``OffloadingConnector`` of this release, sized from the config, in black-box mode; hits it
        loads synchronously where the release can (0.33), if ``sync_loads`` (None: as the config says)."""
    def simple_cpu_connector(self, config: Config, lazy: bool) -> BlackBox:
        """vLLM's ``SimpleCPUOffloadConnector``, its CPU tier of ``tier_blocks`` blocks, eager or lazy."""
    def tiering_connector(self, config: Config, root: Path, io_delay: int, backpressure: bool = False) -> BlackBox:
        """vLLM's ``OffloadingConnector`` with its ``TieringOffloadingSpec``: the CPU tier sized from the config, its
        ``fs`` tier on ``root``, whose I/O jobs complete ``io_delay`` steps after they are submitted, with vLLM's
        back-pressure detector on the kit's clock if asked (``tiering``)."""
    def our_worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        """Our ``KVOffloadConnector``'s worker metadata for these results (as it travels in this release)."""


def release(version: str | None = None) -> Release:
    """The adapter for ``version`` ("0.32"), by default for the installed vLLM (imported here, not before)."""
    if version is None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm
        version = ".".join(vllm.__version__.split(".")[:2])
    if version not in SUPPORTED:
        raise NotImplementedError(f"no black-box adapter for vLLM {version}; supported: {', '.join(SUPPORTED)} "
                                  f"(add a module vllm_{version.replace('.', '_')} defining Release)")
    module = importlib.import_module(f"{__name__}.vllm_{version.replace('.', '_')}")
    return module.Release()


class KVOffloadTransfers:
    """Our ``KVOffloadConnector``: a plan of transfers, and the stores to flush before the forward pass (a preempted
    or finished request's, and those reading blocks a sliding window freed): it frees at once, fenced."""

    failures, fenced = True, True

    def __init__(self, vllm: Release) -> None:
        self.vllm = vllm

    def transfers(self, metadata: Any) -> Iterator[Transfer]:
        for t in (*metadata.plan.loads, *metadata.plan.stores):
            yield Transfer(t.job_id, t.req_id, t.kind, tuple(t.gpu_blocks), tuple(t.host_rows),
                           keys=tuple(key for _block, key, _sub in t.copies))

    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]:
        return set(metadata.plan.flush)

    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        return self.vllm.our_worker_meta(job_results) if job_results else None


class BlackBox:
    """A vLLM connector's scheduler side, plus a played worker side, as a kit adapter."""

    def __init__(self, config: Config, connector: Any, transfers: Transfers, vllm: Release,
                 refuse: Callable[[str], None] | None = None, host: HostSlots | None = None,
                 tier_io: HeldIO | None = None) -> None:
        self.config, self.connector, self.reader, self.vllm = config, connector, transfers, vllm
        self.capabilities = frozenset({name for name, on in (
            (FENCED_FREES, transfers.fenced), (REFUSE_STORE, refuse), (TRANSFER_FAILURES, transfers.failures),
            (RESET, vllm.resets(connector)), (GROUPS, vllm.hybrid(connector)), (PINS, vllm.pins(connector)),
            (FILES, tier_io)) if on})
        if refuse:
            self.refuse_next_store = refuse
        self.seen: dict[str, tuple[Request, Any]] = {}  # world request, vLLM request
        self.pending: dict[int, tuple[Transfer, tuple[Copy, ...]]] = {}  # asked for this step, not submitted
        self.draining: set[str] = set()  # request_finished returned True; not reported in finished_sending yet
        self.submitted: dict[int, Transfer] = {}  # submitted, not polled
        self.tier: HostSlots = {} if host is None else host  # tier slot -> content: the worker's CPU memory
        self.load_errors: set[int] = set()
        self._kv: ListKV | None = None
        self._executor: Executor | None = None
        self.local_and_tier_hits = 0  # admissions that took a GPU prefix hit and a tier hit on top of it
        self.tier_io = tier_io  # the I/O of a file tier below the CPU, where the kit holds it (FILES)
        self.pool: BlockPool | None = None  # the world's GPU block pool, bound to a connector that holds blocks (PINS)
        self.hash_pairs: dict[Key, tuple[Any, int, int]] = {}  # world key -> vLLM hash, group, tokens to block end
        self.world_hashes: dict[Any, int] = {}  # vLLM block hash -> the world's

    # ---- world -> vLLM ---------------------------------------------------------------------------------------
    def on_new_request(self, req: Request) -> None:
        """The world adds a request: vLLM's scheduler tells the connector on arrival, before any lookup (vLLM 0.33
        holds a lock across a step's lookups and complains when a request arrives inside them)."""
        vreq = self.vllm.request(req.req_id, list(req.prompt), req.max_tokens, self.config.block_size)
        self.seen[req.req_id] = (req, vreq)
        if hasattr(self.connector, "on_new_request"):  # vLLM 0.11 has no such hook
            self.connector.on_new_request(vreq)

    def _vllm(self, req: Request) -> Any:
        """The vLLM request mirroring ``req``: same tokens (so the same block hashes), same progress."""
        vreq = self.seen[req.req_id][1]
        for token in req.tokens[vreq.num_tokens:req.num_tokens]:  # the tokens the engine has seen
            vreq.append_output_token_ids(token)
        vreq.num_computed_tokens = req.num_computed_tokens
        vreq.num_output_placeholders = req.num_placeholders  # async scheduling: tokens scheduled, not sampled yet
        if self.pool is not None:
            self._pair_hashes(req, vreq)
        return vreq

    def _pair_hashes(self, req: Request, vreq: Any) -> None:
        """Learn which vLLM block hash is which world hash (the same tokens give both), in every group."""
        for j, (world_hash, vllm_hash) in enumerate(zip(req.block_hashes, vreq.block_hashes)):
            if vllm_hash not in self.world_hashes:
                self.world_hashes[vllm_hash] = world_hash
                for g in range(len(req.tables)):
                    self.hash_pairs[group_key(world_hash, g)] = (vllm_hash, g, (j + 1) * self.config.block_size)

    def vllm_key(self, key: Key) -> tuple[Any, int, int]:
        """A world key of the prefix cache in vLLM's terms: its block hash, group, and tokens up to its block's
        end (a request that sampled since it was last scheduled is caught up first)."""
        if key not in self.hash_pairs:
            for req, _vreq in self.seen.values():
                self._vllm(req)
        return self.hash_pairs[key]

    def world_key(self, vllm_hash: Any, g: int) -> Key | None:
        world_hash = self.world_hashes.get(vllm_hash)
        return None if world_hash is None else group_key(world_hash, g)

    def holder(self, block: int, req_ids: list[str]) -> str | None:
        """Which of these requests' block tables holds a GPU block (vLLM's id)."""
        return next((r for r in req_ids if r in self.seen and block - NULL_BLOCKS in self.seen[r][0].blocks), None)

    def _scheduler_output(self, out: SchedulerOutput) -> Any:
        for s in out.scheduled:
            self._vllm(self.seen[s.req_id][0])
        return self.vllm.scheduler_output(out, {req_id: vreq for req_id, (_req, vreq) in self.seen.items()},
                                          lambda req_id: tuple(self._vllm_tables(tuple(self.seen[req_id][0].tables))))

    # ---- scheduler side ----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector.get_num_new_matched_tokens(self._vllm(request), num_computed_tokens)

    @staticmethod
    def _vllm_tables(block_ids: BlockIds) -> list[list[int]]:
        """The world's tables (one, or one per group: GROUPS) as vLLM's: a list per group, the null block 0."""
        tables = block_ids if isinstance(block_ids, tuple) else (block_ids,)
        return [[b + NULL_BLOCKS for b in table] for table in tables]  # NULL_BLOCK + 1 is vLLM's null block

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_external_tokens: int) -> None:
        vreq = self._vllm(request)
        self.local_and_tier_hits += bool(num_external_tokens and request.num_computed_tokens)
        tables, hashes, bs = self._vllm_tables(block_ids), vreq.block_hashes, self.config.block_size
        cached = [[hashes[key_index(i, size // bs)] for i in range(request.num_cached_tokens // size)]
                  for size in self._block_sizes(tables)]  # a block's hash: its last hash block's (vLLM's rule)
        blocks = self.vllm.blocks(vreq, tables, cached)
        self.connector.update_state_after_alloc(vreq, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        metadata = self.connector.build_connector_meta(self._scheduler_output(scheduler_output))
        self.pending = {t.job_id: (t, self._copies(t)) for t in self.reader.transfers(metadata)}
        return metadata

    def _copies(self, t: Transfer) -> tuple[Copy, ...]:
        """What the transfer copies, as (world GPU block, its offload block's key in its group, index inside it).
        A block that is not where the job says in the request's table, or whose offload block is not full, is a
        violation here, before anything is copied (each check counted, through ``require``).

        Which invariant a bad block names: the job's blocks are the connector's tracked table as it emits it, so
        wherever the job itself places a block (its first position, its blocks in request order, its group, the key
        it files a block under) and the request's real table disagree, the table drifted: TRACK, both tables shown.
        Only a job whose claims all agree with the real table and that still reaches a position not yet hashed
        stored too far ahead: CURSOR. (A drifted table often also reaches unhashed positions; naming it CURSOR hid
        the cause.) In a hybrid model each group is checked against its own table; a job that does not say a
        block's group gets the group whose table holds it."""
        if t.req_id == POOL_STORE:
            return self._cached_copies(t)
        (req, vreq), k = self.seen[t.req_id], self.config.k
        blocks = [b - NULL_BLOCKS for b in t.gpu_blocks]
        claims = f"{t.kind} job {t.job_id} of {t.req_id}"
        tables = f"\n  request's block tables: {req.tables}\n  job's GPU blocks:       {blocks}"
        groups = list(t.groups) if t.groups is not None else [self._group_holding(req, b) for b in blocks]
        copies = []
        for g in dict.fromkeys(groups):
            mine = [(i, b) for i, (b, group) in enumerate(zip(blocks, groups)) if group == g]
            table = req.tables[g]
            for _i, block in mine:  # a load into a block the request does not own would write another's block
                held = block != NULL_BLOCK and block in table
                left = t.kind == "store" and req.left_behind.get(block, (None,))[0] == g  # fenced: bytes checked
                require(held or left, "TRACK" if t.kind == "store" else "DST",
                        f"{claims} names GPU block {block} in group {g}, whose table {table} does not hold it (nor did "
                        f"a sliding window free it from there){tables}")
            positions = [table.index(block) if block in table else req.left_behind[block][1] for _i, block in mine]
            first = t.first_positions[g] if t.first_positions is not None else None
            require(first is None or positions[0] == first, "TRACK",
                    f"{claims} starts group {g} at GPU block {mine[0][1]} for position {first}, but that block is at "
                    f"position {positions[0]} of that group's table {table}{tables}")
            require(all(a < b for a, b in zip(positions, positions[1:])), "TRACK",
                    f"{claims}: its GPU blocks of group {g} are not in request order (positions {positions}){tables}")
            n = k * self._block_sizes(req.tables)[g] // self.config.block_size  # hashes per offload block
            for (i, block), position in zip(mine, positions):
                last = key_index(position // k, n)  # the key of the offload block holding this position
                hashed = last < len(req.block_hashes)
                if t.keys is not None:  # the job says where it files the block (a key in vLLM's hashes): elsewhere?
                    require(last < len(vreq.block_hashes) and t.keys[i] == group_key(vreq.block_hashes[last], g),
                            "TRACK", f"{claims} files GPU block {block} (position {position} of group {g}) under key "
                                     f"{t.keys[i]!r}, not under its offload block's key: the tracked table drifted"
                                     f"{tables}")
                require(hashed, "CURSOR", f"{claims} covers position {position}, whose offload block is not full "
                                          f"({len(req.block_hashes)} full GPU blocks)")
                copies.append((i, (block, group_key(req.block_hashes[last], g), position % k)))
        return tuple(copy for _i, copy in sorted(copies))

    def _cached_copies(self, t: Transfer) -> tuple[Copy, ...]:
        """A store of cached GPU blocks, no request's (PINS): each one the connector holds, in the prefix cache, copied
        under its own key."""
        pool, copies = self.pool, []
        if pool is None:
            raise RuntimeError(f"store job {t.job_id} names no request, but no GPU block pool was bound (PINS)")
        for block in (b - NULL_BLOCKS for b in t.gpu_blocks):
            require(block != NULL_BLOCK and pool.refs[block] > 0, "SRC", f"store job {t.job_id} reads GPU block "
                                                                          f"{block}, which nothing holds: it may be "
                                                                          f"reused before the copy runs")
            require(block in pool.hash_of, "CURSOR", f"store job {t.job_id} stores GPU block {block}, which is not in "
                                                     f"the prefix cache: its tokens are not all computed")
            copies.append((block, pool.hash_of[block], 0))
        return tuple(copies)

    def _block_sizes(self, tables: list[list[int]]) -> tuple[int, ...]:
        """Tokens per block of each of the world's tables: the model's groups, or its one group."""
        return self.config.block_sizes if len(tables) > 1 else (self.config.block_size,)

    @staticmethod
    def _group_holding(req: Request, block: int) -> int:
        """The group whose table holds ``block`` (the world's block ids are unique across groups), or held it until
        a sliding window freed it; 0 if none, for the check to name."""
        held = (g for g, table in enumerate(req.tables) if block != NULL_BLOCK and block in table)
        return next(held, req.left_behind.get(block, (0, 0))[0])

    def update_connector_output(self, output: WorkerOutput) -> None:
        self.connector.update_connector_output(self.vllm.connector_output(
            set(output.finished_sending), set(output.finished_recving), set(output.failed_recving),
            self.reader.worker_meta(list(output.job_results))))

    def request_finished(self, request: Request, block_ids: BlockIds) -> bool:
        vreq = self._vllm(request)
        self.vllm.set_status(vreq, {State.ABORTED: "aborted", State.FAILED: "error"}.get(request.state, "stopped"))
        delay = self.vllm.request_finished(self.connector, vreq, self._vllm_tables(block_ids))
        if delay:
            self.draining.add(request.req_id)
        return delay

    def reset_cache(self) -> bool:
        return self.connector.reset_cache() is not False  # vLLM treats None as done

    def file_fault(self, index: int, how: str) -> None:
        assert self.tier_io is not None, "a black box without a file tier declares no FILES"
        self.tier_io.fault_next(index, how)

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        self.pool = pool
        self.connector.bind_gpu_block_pool(self.vllm.gpu_block_pool(pool, self))

    def take_events(self) -> list[Event]:
        list(self.connector.take_events())  # its keys are vLLM's hashes: drained, not compared
        return []

    # ---- the played worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv: ListKV, executor: Executor) -> None:
        self._kv, self._executor = kv, executor

    @property
    def kv(self) -> ListKV:
        return registered(self._kv, "kv")

    @property
    def executor(self) -> Executor:
        return registered(self._executor, "executor")

    def handle_preemptions(self, metadata: Any) -> None:
        flush = self.reader.flushes(metadata, self.submitted)
        self._submit("store", flush)  # a flushed job of this very step is submitted first, as vLLM's worker does
        self.executor.flush(flush)

    def start_load_kv(self, metadata: Any) -> None:
        self._submit("load")
        self.executor.wait({job_id for job_id, t in self.submitted.items() if t.kind == "load" and t.sync})

    def wait_for_save(self, metadata: Any) -> None:
        self._submit("store")

    def _submit(self, kind: TransferKind, only: set[int] | None = None) -> None:
        for job_id, (t, copies) in list(self.pending.items()):
            if t.kind != kind or (only is not None and job_id not in only):
                continue
            del self.pending[job_id]
            self.submitted[job_id] = t
            pairs = [(b - NULL_BLOCKS, slot) for b, slot in zip(t.gpu_blocks, t.tier_slots)]
            self.executor.submit(Job(job_id, t.req_id, kind, copies, partial(self._copy, kind, pairs)))

    def _copy(self, kind: str, pairs: list[tuple[int, Hashable]]) -> None:
        for block, slot in pairs:
            if kind == "store":
                self.tier[slot] = self.kv.read(block)
            else:
                self.kv.write(block, self.tier.get(slot, GARBAGE))

    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput:
        results = self.executor.poll()
        done = [self.submitted.pop(job_id) for job_id, _success in results]
        failed = [t for t, (_id, success) in zip(done, results) if t.kind == "load" and not success]
        hybrid = self.config.hybrid  # vLLM's worker then reports the request, not its blocks
        self.load_errors |= set() if hybrid else {b - NULL_BLOCKS for t in failed for b in t.gpu_blocks}
        busy = {t.req_id for t in self.submitted.values()}
        sending = {r for r in self.draining if r not in busy}
        self.draining -= sending
        recving = frozenset(t.req_id for t in done if t.kind == "load" and not t.sync)  # a synchronous one's runs
        return WorkerOutput(frozenset(sending), recving, tuple(results),
                            frozenset(t.req_id for t in failed) if hybrid else frozenset())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors


def vllm_offloading_connector(config: Config, vllm: Release | None = None, sync_loads: bool | None = None) -> BlackBox:
    """A kit factory: vLLM's own ``OffloadingConnector`` of the installed release (or of ``vllm``), with its real
    CPU manager, sized from the config, store refusals injected at its manager; ``sync_loads`` as the release's
    ``offloading_connector`` takes it."""
    return (vllm or release()).offloading_connector(config, sync_loads)


class OneResetBetweenSteps(BlackBox):
    """vLLM's OffloadingConnector asserts when it is reset twice with no engine step in between (known divergence
    'reset-twice-between-steps'). A caller that resets it at most once between steps, so every other check runs:
    the hunt's ``--past-known``, and the tests' ``vllm_offloading``."""

    reset_since_step = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self.reset_since_step = False
        return super().build_connector_meta(scheduler_output)

    def reset_cache(self) -> bool:
        if not self.reset_since_step:
            self.reset_since_step = True
            return super().reset_cache()
        return True


def vllm_offloading_past_known(config: Config, transfers: Callable[[Transfers], Transfers] | None = None,
                               sync_loads: bool | None = None) -> BlackBox:
    """A kit factory: vLLM's ``OffloadingConnector`` as ``vllm_offloading_connector`` makes it, short of its known
    divergences (``transfers`` may change its metadata reader)."""
    box = vllm_offloading_connector(config, sync_loads=sync_loads)
    reader = transfers(box.reader) if transfers else box.reader
    refuse = getattr(box, "refuse_next_store", None)  # set where the release's manager can refuse
    return OneResetBetweenSteps(config, box.connector, reader, box.vllm, refuse=refuse)


class FilesWipedAtReset(OneResetBetweenSteps):
    """vLLM's tiering keeps its ``fs`` tier's files across a connector reset, so after a weight update it serves KV
    computed with the old weights (known divergence 'fs-tier-stale-after-weight-update'). Past it, as an operator
    would get past it: every block file is removed when the connector is reset (the tier is not told)."""

    root: Path

    def reset_cache(self) -> bool:
        done = super().reset_cache()
        for path in self.root.rglob("*.bin"):
            path.unlink()
        return done


def vllm_simple_cpu_connector(config: Config) -> BlackBox:
    """A kit factory: vLLM's ``SimpleCPUOffloadConnector`` of the installed release, eager (it stores each
    request's blocks as they are computed), its CPU tier of ``tier_blocks`` blocks. See ``simple_cpu``."""
    return release().simple_cpu_connector(config, lazy=False)


def vllm_simple_cpu_lazy(config: Config) -> BlackBox:
    """A kit factory: vLLM's ``SimpleCPUOffloadConnector`` with ``lazy_offload``: it stores cached blocks from the
    GPU free queue before they are evicted."""
    return release().simple_cpu_connector(config, lazy=True)


def vllm_simple_cpu_lazy_past_known(config: Config) -> BlackBox:
    """``vllm_simple_cpu_lazy`` short of its known divergence ('lazy-offload-never-quiesces'): its CPU tier holds
    every GPU block, so the blocks it stores from the free queue never evict each other there."""
    return vllm_simple_cpu_lazy(evolve(config, tier_blocks=max(config.tier_blocks, config.num_gpu_blocks)))


def vllm_tiering_connector(config: Config, io_delay: int = 0, root: Path | None = None,
                           backpressure: bool = False) -> BlackBox:
    """A kit factory: vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` (its CPU tier sized from the
    config, store refusals injected at it) and the ``fs`` tier on ``root`` (default: a directory of its own, removed
    at exit), with vLLM's back-pressure detector if asked, short of the known divergence of resetting twice between
    steps. See ``tiering``."""
    box = release().tiering_connector(config, root or tiering.new_directory(), io_delay, backpressure)
    return _rebox(OneResetBetweenSteps, box)


def _rebox(cls: type[BlackBox], box: BlackBox) -> Any:
    """The same connector, played by another black box."""
    return cls(box.config, box.connector, box.reader, box.vllm, getattr(box, "refuse_next_store", None), box.tier,
               box.tier_io)


def vllm_tiering_past_known(config: Config, io_delay: int = 0, root: Path | None = None,
                            backpressure: bool = False) -> BlackBox:
    """``vllm_tiering_connector``, short of its known divergences (its files are wiped at a reset)."""
    root = root or tiering.new_directory()
    past = _rebox(FilesWipedAtReset, vllm_tiering_connector(config, io_delay, root, backpressure))
    past.root = root
    return past


def vllm_tiering_backpressure(config: Config) -> BlackBox:
    """A kit factory: ``vllm_tiering_past_known`` on a slow disk (every file job takes a step), with vLLM's
    back-pressure detector on its fs tier (EMA of store latency, local-disk water marks, throttled drops) timing
    stores in steps: the tier comes under pressure and drops stores. See ``tiering``."""
    return vllm_tiering_past_known(config, io_delay=1, backpressure=True)


def vllm_tiering_fleet(config: Config, io_delay: int = 0) -> BlackBox:
    """A kit factory: ``vllm_tiering_past_known``, and in a fleet every engine's fs tier on one directory, its file
    jobs ending ``io_delay`` steps after they are submitted (``partial(vllm_tiering_fleet, io_delay=2)``: the kit
    passes the delay on to the fleet, and a trace records it)."""
    return vllm_tiering_past_known(config, io_delay)


def _on_one_directory(io_delay: int = 0) -> Callable[[Config], BlackBox]:
    return partial(vllm_tiering_past_known, io_delay=io_delay, root=tiering.new_directory())


vllm_tiering_fleet.for_fleet = _on_one_directory  # type: ignore[attr-defined]


class NoWeightUpdates(BlackBox):
    """A connector that is never reset: it does not declare RESET, so the kit updates no engine's weights."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities -= {RESET}


def vllm_tiering_fleet_past_known(config: Config, io_delay: int = 0) -> BlackBox:
    """``vllm_tiering_fleet`` short of its known divergence: the fs tier has no notion of weights, so engines on one
    directory must all have the same (known divergence 'fs-tier-shared-across-weights'): no weight updates."""
    return _rebox(NoWeightUpdates, vllm_tiering_past_known(config, io_delay))


def _on_one_directory_past_known(io_delay: int = 0) -> Callable[[Config], BlackBox]:
    one = _on_one_directory(io_delay)
    return lambda config: _rebox(NoWeightUpdates, one(config))


vllm_tiering_fleet_past_known.for_fleet = _on_one_directory_past_known  # type: ignore[attr-defined]


def kvoffload_connector(config: Config, name: str = "KVOffloadConnector",
                        module: str = "kvoffload.impl.vllm_connector", vllm: Release | None = None) -> BlackBox:
    """A kit factory: our own vLLM connector (or a subclass, by name and module) in black-box mode."""
    vllm = vllm or release()
    connector = vllm.create(config, name, module, lambda block_bytes: {
        "tier_bytes": block_bytes * config.k * config.tier_blocks, "offload_block_size": config.offload_block_size,
        "policy": config.policy})
    return BlackBox(config, connector, KVOffloadTransfers(vllm), vllm, refuse=connector.offload.refuse_next_store)
