"""The world: a small, faithful model of vLLM v1's scheduler and KV-cache manager around a connector.

One ``World`` owns a GPU block pool with prefix caching, the requests, a token budget per step, the workers (each
holds its own shard of every block, as tensor-parallel workers do) and the executors that decide when each
transfer a worker submits runs, fails, and is reported. Each ``step()`` is one engine iteration, in vLLM's order
(0.32 and 0.33 alike: ``tests/vllm/test_call_order.py`` records it from vLLM's own model runner code):

  schedule (admissions ask the connector for hits; a sliding window frees its old blocks)
  -> build_connector_meta -> handle_preemptions(metadata) -> forward pass (writes KV)
  -> start_load_kv -> wait_for_save -> get_finished, get_block_ids_with_load_errors (every worker, aggregated)
  -> deliver the output: update_connector_output, free and cache blocks, sampled tokens, finishes
     (a window's old blocks are freed first, then request_finished may delay the free of the rest)

What each worker hook may assume about the blocks, given that order:
  * handle_preemptions is the only hook before the forward pass: whatever must finish before the pass writes a
    block (the stores of a preempted request, stores reading a block a window freed) is flushed here;
  * start_load_kv runs after the forward launch, since every load is asynchronous here (LOOKUP; vLLM starts a
    load before the forward only when the step has a synchronous one): a flush here comes too late, as the pass
    may already have written a freed block for another request;
  * wait_for_save runs after the pass: the step's blocks hold their KV, so stores are submitted here;
  * get_finished and get_block_ids_with_load_errors run after both: a transfer submitted this step may already
    be reported, and a request named finished this step is known to the worker by then.

The engine modes vLLM runs on GPUs are modelled too, because each one changes what a connector sees:
  * async scheduling: the output of step N is delivered after step N+1 was scheduled, so the scheduler counts
    tokens it has not seen yet (placeholders) and a request's block hashes lag behind its scheduled tokens;
  * speculative decoding: draft tokens are scheduled and written like any other, then some are rejected, which
    rolls computed tokens back; a rejected draft's KV is rewritten and never has a hash. Drafts follow a step that
    sampled, as many as configured (tokens sampled past max_tokens are dropped);
  * weight updates: the tier must forget everything, since KV computed before the update is wrong after it;
  * vLLM's load failure policy (``Config.load_failure_policy``): "recompute" rewinds a request whose load failed
    to its first invalid block; "fail", vLLM's default, ends it with an error as the output that says so arrives;
  * hybrid models: several KV cache groups (``Config.groups``: full attention, sliding windows, recurrent state), a
    block table each, with blocks of its own size; a sliding window's old blocks are freed while the request runs,
    and a prefix hit counts only as far as every group can supply it (``groups.py``);
  * recurrent state (Mamba, gated delta nets, in vLLM's align mode): prefill chunks end on block boundaries, a
    state group holds one block per chunk, the state at its end, and the null block where a chunk passed, and a
    state enters the prefix cache as its chunk is computed (vLLM caches it as it schedules it, and frees the
    block a chunk later). The state's content is its whole prefix's, as the chained block hash is. A chunk also
    ends where a shared prefix stops being cached in some group. With speculative decoding a block follows the
    running state's for the state after each draft, and moves to the end of the table once a chunk passes it.
    Mamba2 and KDA layers save the state at the prompt's last block boundary inside its last chunk, in a block
    kept for it (a prefill checkpoint);
  * the prefix cache keeps window and state blocks only where a later request resumes, as vLLM does by default
    (``Config.retention_interval``: also one per interval, or every one).
"""

from __future__ import annotations

from collections import Counter, deque
from math import lcm
from typing import Iterator, cast

from attrs import Factory, define, evolve, field

from . import invariants
from .config import Config, ConfigError
from .executor import Executor
from .groups import FULL_ATTENTION, Group, checkpoint_saved, longest_hit, retained, state_chunk
from .memory import GARBAGE, PARTIAL, BlockPool
from .records import Namespace
from .requests import Request, State, continuation, extend_block_hashes, kv_content
from .store import SharedTier, Store
from .types import (CONNECTOR_METHODS, FENCED_FREES, NULL_BLOCK, PINS, Connector, Event, GpuKV, Grouped, Job,
                    Observable, Observation, Pinning, Resettable, ScheduledRequest, SchedulerOutput, Shareable,
                    WorkerOutput, group_key, key_index)

@define
class StepOutput:
    """What one step produced, delivered to the scheduler at the end of that step (or of the next, under async
    scheduling): the tokens each request sampled and the drafts it rejected, and the workers' aggregated output."""

    samples: list[tuple[Request, int, int]]  # (request, tokens sampled, drafts rejected)
    workers: WorkerOutput
    load_errors: set[int]
    scheduled: list[tuple[Request, int]]  # (request, tokens scheduled): no longer in flight once delivered

    def __bool__(self) -> bool:
        return bool(self.samples or self.workers != WorkerOutput() or self.load_errors)


@define
class World:
    config: Config
    connector: Connector  # the scheduler side, and worker 0
    kv: GpuKV  # worker 0's shard
    executor: Executor = field(factory=Executor)  # worker 0's
    pool: BlockPool = field()
    observable: bool = False  # the connector has observe(): check TRACK, REF, CURSOR too
    # the connector frees under in-flight stores and flushes them before reuse (it declares types.FENCED_FREES), or
    # holds their blocks itself (types.PINS)
    fenced: bool = field(default=Factory(lambda world: bool({FENCED_FREES, PINS} & world.capabilities),
                                         takes_self=True))
    # the connector holds GPU blocks in the pool itself (types.PINS)
    pins: bool = field(default=Factory(lambda world: PINS in world.capabilities, takes_self=True))
    grouped: bool = False  # the connector takes one block table per KV cache group (types.GROUPS)
    store: Store | None = None  # the store this engine's fleet shares (the connector declared SHARED)
    identity: int = 0  # the engine's model (0: the default one): engines of other identities compute other KV
    workers: list[Connector] = field(factory=list)  # every worker side, worker 0 first
    kvs: list[GpuKV] = field(factory=list)
    executors: list[Executor] = field(factory=list)
    requests: dict[str, Request] = field(factory=dict)  # live: not finished
    history: dict[str, Request] = field(factory=dict)  # every request ever added: what its blocks should hold
    delayed: dict[str, Request] = field(factory=dict)  # finished, blocks held until the workers say so
    # a delayed free -> what still holds it: "sending" (the connector delayed it), "recving" (its load is in flight)
    holds: dict[str, set[str]] = field(factory=dict)
    # a free the connector delayed -> the step its last store was reported (None while one is in flight)
    needed_until: dict[str, int | None] = field(factory=dict)
    beyond_need: Counter[int] = field(factory=Counter)  # released delayed frees, by steps held beyond need
    waiting: deque[Request] = field(factory=deque)
    running: list[Request] = field(factory=list)
    finished_since_step: set[str] = field(factory=set)
    preempted_since_step: set[str] = field(factory=set)
    state_handoffs: list[tuple[str, int, int, int]] = field(factory=list)  # committed since the last step
    # state blocks committed since the last forward pass, not computed yet: no admission may start from one
    committed_states: set[int] = field(factory=set)
    open_jobs: dict[int, Job] = field(factory=dict)  # submitted, and not yet reported by every worker
    reports: Counter[int] = field(factory=Counter)  # job id -> reports delivered to the scheduler side
    failed_jobs: set[int] = field(factory=set)  # jobs some worker reported as failed
    remaining: dict[str, Counter[str]] = field(factory=lambda: {"sending": Counter(), "recving": Counter()})
    bad_blocks: set[int] = field(factory=set)  # reported invalid, their request's load not yet finished
    sync_loading: set[str] = field(factory=set)  # admitted this step with a synchronous load
    sync_jobs: set[int] = field(factory=set)  # synchronous loads not yet reported by every worker
    # blocks a synchronous load failed to fill, until the output that says so arrives: what the forward pass
    # computes from them is garbage, and the requests holding them end with an error then
    invalid: set[int] = field(factory=set)
    failed_loads: set[str] = field(factory=set)  # reported in failed_recving by some worker, not by all finished yet
    window_freed: set[int] = field(factory=set)  # freed by a sliding window, not written since: stores are fenced
    got: set[int] = field(factory=set)  # keys whose tier entry a get brought from the store (none stored since)
    undelivered: StepOutput | None = None  # async scheduling: the last step's output
    # the weights the engine computes with: 0 is its checkpoint's as first deployed (a restart on a checkpoint that
    # a fine-tune replaced starts on others); an update in place loads others (the kit picks them, so that two
    # engines may update to the same weights or to other ones)
    weights: int = 0
    updates: int = 0  # weight updates so far
    unidentified: bool = False  # reset since the connector was last told the engine's identity
    held: set[Namespace] = field(factory=set)  # every identity (of every shard) the engine was told since it started
    step_no: int = 0
    next_id: int = 0
    events: list[Event] = field(factory=list)
    stats: dict[str, int] = field(factory=lambda: dict.fromkeys(
        ("steps", "requests", "finished", "preemptions", "engine_hit_blocks", "tier_hit_tokens", "blocks_loaded",
         "blocks_stored", "failed_transfers", "drafts", "rejected_drafts", "weight_updates", "window_freed_blocks",
         "checkpoints", "checks", "failed_requests", "sync_loads"), 0))

    @pool.default
    def _pool(self) -> BlockPool:
        return BlockPool(self.config.num_gpu_blocks)

    @property
    def groups(self) -> tuple[Group, ...]:
        """The KV cache groups the engine runs: the model's, or one full-attention group for a connector that
        does not take several (vLLM turns its hybrid manager off for it). A model of one attention kind keeps its
        group either way, sliding window included: vLLM then frees the blocks that fall out of the window for any
        connector, and hands it one table with null blocks in it."""
        return self.config.groups if self.grouped or len(self.config.groups) == 1 else FULL_ATTENTION

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Tokens per block of each group the engine runs."""
        return tuple(map(self.config.block_size_of, self.groups))

    @property
    def aligned(self) -> bool:
        """A model with recurrent state (vLLM's ``need_mamba_block_aligned_split``): prefill chunks end on block
        boundaries, and the state groups allocate one block per chunk."""
        return any(group.state for group in self.groups)

    def block_hash(self, hashes: list[int], block: int, g: int) -> int:
        """The key of block ``block`` of group ``g`` in the prefix cache, from a request's hashes (per
        ``Config.block_size`` tokens): its last hash, in its group."""
        return group_key(hashes[key_index(block, self.block_sizes[g] // self.config.block_size)], g)

    def table_of(self, req: Request) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        """A request's block tables as a connector's ``observe()`` reports them (``Observation.tracked``)."""
        return tuple(tuple(t) for t in req.tables) if self.grouped else tuple(req.tables[0])

    def _allocated(self, req: Request, num_external: int) -> None:
        """``update_state_after_alloc``, with one table per group for a connector that takes them (GROUPS)."""
        if self.grouped:
            cast(Grouped, self.connector).update_state_after_alloc(req, tuple(map(list, req.tables)), num_external)
        else:
            self.connector.update_state_after_alloc(req, list(req.tables[0]), num_external)

    def _finished(self, req: Request) -> bool:
        """``request_finished``, with one table per group for a connector that takes them (GROUPS)."""
        if self.grouped:
            return cast(Grouped, self.connector).request_finished(req, tuple(map(list, req.tables)))
        return self.connector.request_finished(req, list(req.tables[0]))

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(getattr(self.connector, "capabilities", ()))

    def __attrs_post_init__(self) -> None:
        if any(group.state for group in self.config.groups) and not self.aligned:
            raise ConfigError("vLLM cannot turn its hybrid KV cache manager off for a model with recurrent state: "
                              "the connector must take one block table per KV cache group (GROUPS)")
        self._join(self.connector, self.kv, self.executor)
        if self.pins:
            cast(Pinning, self.connector).bind_gpu_block_pool(self.pool)

    def pinned(self) -> Counter[int]:
        """The references the connector holds in the pool itself (PINS), by block: all it holds beyond the requests'
        (negative: it freed what it did not hold)."""
        held = Counter(b for r in (*self.requests.values(), *self.delayed.values()) for b in r.blocks)
        return Counter({b: refs - held[b] for b, refs in enumerate(self.pool.refs) if refs != held[b]})

    def add_worker(self, connector: Connector, kv: GpuKV) -> None:
        """Another tensor-parallel worker: its own shard of every block, its own transfers, every job reported."""
        self._join(connector, kv, Executor(self.executor.delay))

    def _join(self, connector: Connector, kv: GpuKV, executor: Executor) -> None:
        missing = [name for name in CONNECTOR_METHODS if not callable(getattr(connector, name, None))]
        if missing:
            raise TypeError(f"{type(connector).__name__} is not a connector: it lacks {', '.join(missing)}")
        executor.kv = kv
        executor.before_store = lambda job: invariants.store_bytes(self, job, kv)
        executor.on_submit = self._submitted
        executor.weights = self.weights
        connector.register_kv_caches(kv, executor)
        if self.store is not None:
            self._attach(connector, len(self.workers))
        self.workers.append(connector)
        self.kvs.append(kv)
        self.executors.append(executor)

    def _identify(self) -> None:
        """Every side of the connector learns the engine's identity, as the weights it holds now give it."""
        self.unidentified = False
        for rank, worker in enumerate(self.workers):
            self._attach(worker, rank)

    def _attach(self, worker: Connector, rank: int) -> None:
        """Worker ``rank`` (the scheduler side with worker 0) is told its identity, and gets the store's ``open``;
        every namespace it opens is checked (NAMESPACE) against the identities it has held."""
        told, store = self.namespace(rank), cast(Store, self.store)
        self.held.add(told)

        def open(namespace: Namespace, payload_len: int) -> SharedTier:
            invariants.namespace(self, rank, namespace)
            return evolve(store.open(namespace, payload_len), asking=lambda asked: invariants.asked(self, asked))
        cast(Shareable, worker).attach_shared_tier(open, told)

    def namespace(self, rank: int) -> Namespace:
        """The KV identity of this engine's shard ``rank``: what its records are shared under, derived from what it
        computes with (its model and the weights it holds now)."""
        c = self.config
        return Namespace(model=f"model-{self.identity}", weights=f"w{self.weights}", kv_dtype="content-id",
                         kv_layout="spec", block_size=c.block_size, hash_block_size=c.block_size,
                         hash_algorithm="chained", hash_seed="0", tp_rank=rank, tp_size=c.num_workers)

    def kv_of(self, block_hash: int, weights: int | None = None) -> int:
        """What a block of this engine holds once computed for the prefix ending in ``block_hash``."""
        return kv_content(block_hash, self.weights if weights is None else weights, self.identity)

    # ---- the engine's inputs -------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_tokens: int) -> Request:
        req = Request(f"r{self.next_id}", tuple(prompt), max_tokens, self.config.block_size,
                      tables=[[] for _ in self.groups])
        self.next_id += 1
        self.requests[req.req_id] = self.history[req.req_id] = req
        self.waiting.append(req)
        self.stats["requests"] += 1
        on_new_request = getattr(self.connector, "on_new_request", None)  # optional: vLLM calls it on arrival
        if on_new_request is not None:
            on_new_request(req)
            req.looked_up = True  # told of it: it hears of its finish too, even if it is never looked up
        return req

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (vLLM's ``reset_prefix_cache``): hits must come from the tier."""
        for block in [b for b in self.pool.hash_of if self.pool.refs[b] == 0]:
            del self.pool.by_hash[self.pool.hash_of.pop(block)]

    def update_weights(self, weights: int | None = None) -> bool:
        """An RL loop's weight update in place to ``weights`` (by default, those its count of updates numbers:
        engines updated as often hold the same weights, as replicas given the same pushes do), then vLLM's
        ``reset_prefix_cache(reset_running_requests=True, reset_connector=True)``: it preempts every running request,
        drops the GPU prefix cache and resets the connector; KV computed before it is wrong after it, unless the
        weights are the same. A connector with a shared store learns the engine's identity again when the next
        step's output arrives (vLLM's workers derive it from the weights they hold), and not before. Refused (False),
        as vLLM refuses it, while blocks are held by anything but a running request (a load, a loaded request not
        yet running, a delayed free, the connector itself: PINS)."""
        if self.delayed or any(r.blocks and r.state is not State.RUNNING for r in self.requests.values()) \
                or self.pins and self.pinned():
            return False
        while self.running:
            self._preempt(self.running.pop(), drop_in_flight=True)
        self.reset_prefix_cache()
        self.updates += 1
        self.weights = self.updates if weights is None else weights
        for executor in self.executors:
            executor.weights = self.weights
        self.unidentified = self.store is not None
        self.stats["weight_updates"] += 1
        # the kit updates weights only for a connector that declares RESET; vLLM treats None (the base class's
        # answer) as done
        return cast(Resettable, self.connector).reset_cache() is not False

    def abort(self, req: Request) -> None:
        if req.state is State.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, State.ABORTED)

    # ---- one engine step -----------------------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        if self.store is not None:
            self.store.tick()
        for executor in self.executors:
            executor.tick()
        out = self._schedule()
        meta = self.connector.build_connector_meta(out)
        if self.observable:
            invariants.track(self, self.observe())
        for worker in self.workers:
            worker.handle_preemptions(meta)
        if not self.fenced:
            invariants.src(self)
        if out.has_sync_loads:  # before the forward pass, which reads what they load
            for worker in self.workers:
                worker.start_load_kv(meta)
            self._waited()
        invariants.content(self)  # what the forward pass attends to: checked each step, not only between rules
        scheduled = [(self.requests[s.req_id], s.num_scheduled_tokens) for s in out.scheduled]
        samples = self._forward(out)
        self.committed_states.clear()
        for worker in self.workers:  # otherwise after the forward launch, off its critical path
            if not out.has_sync_loads:
                worker.start_load_kv(meta)
            worker.wait_for_save(meta)
        output: StepOutput | None = StepOutput(samples, *self._worker_output(out), scheduled)
        if self.config.async_scheduling:  # the engine schedules the next step before it applies this one
            output, self.undelivered = self.undelivered, output
        if output is not None:
            self._deliver(output)
        if self.unidentified:  # the workers' digests of the weights they hold came with this step's output
            self._identify()
        self.events += self.connector.take_events()
        self.stats["steps"] += 1
        return out

    def _schedule(self) -> SchedulerOutput:
        self.step_no += 1
        self.sync_loading = set()
        budget = self.config.token_budget
        scheduled: list[ScheduledRequest] = []
        preempted_now = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._surely_done(req):
                i += 1
                continue
            n = self._chunk(req, req.num_computed_tokens,
                            min(req.num_tokens + req.num_placeholders - req.num_computed_tokens, budget))
            if n == 0:  # no budget left for a block-aligned chunk: vLLM skips the request (``continue``)
                i += 1
                continue
            n += self._drafts(req, n, budget)
            self._free_outside_windows(req)
            new_blocks = self._grow(req, req.num_computed_tokens, req.num_computed_tokens + n)
            while new_blocks is None:  # short of blocks: preempt the lowest-priority running request
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
                new_blocks = self._grow(req, req.num_computed_tokens, req.num_computed_tokens + n)
            if new_blocks is None:
                break
            scheduled.append(self._scheduled(req, "running", new_blocks, n))
            budget -= n
            i += 1
        if not preempted_now:
            self._admit(scheduled, budget)
        finished, self.finished_since_step = frozenset(self.finished_since_step), set()
        preempted, self.preempted_since_step = frozenset(self.preempted_since_step), set()
        handoffs, self.state_handoffs = tuple(self.state_handoffs), []
        return SchedulerOutput(self.step_no, tuple(scheduled), preempted, finished, handoffs, bool(self.sync_loading))

    @staticmethod
    def _surely_done(req: Request) -> bool:
        """The step in flight yields the request's last token even if it rejects every draft: vLLM schedules it no
        more (async scheduling; in sync mode nothing is in flight when it schedules)."""
        return req.num_placeholders > 0 and \
            req.num_computed_tokens + 2 - req.num_placeholders >= req.num_prompt_tokens + req.max_tokens

    def _drafts(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens to verify after a decode token, as many as the budget leaves room for, only for a request
        that sampled in its last step (vLLM drafts for it after that step; not after a prefill chunk, even one that
        leaves one prompt token to compute). Its max_tokens does not bound them: the tokens sampled past it are
        dropped (``_apply_sample``)."""
        if n != 1 or not req.sampled_last or req.num_computed_tokens + 1 != req.num_tokens + req.num_placeholders:
            return 0
        drafts = max(min(self.config.num_spec_tokens, budget - 1), 0)
        self.stats["drafts"] += drafts
        return drafts

    def _scheduled(self, req: Request, kind: str, tables: list[list[int]] | None, n: int) -> ScheduledRequest:
        """vLLM advances computed tokens when it schedules them; a request that will sample gets placeholders.
        ``tables``: the whole tables (new, resumed) or this step's new blocks (running; None: none)."""
        ids = None if kind == "running" and not (tables and any(tables)) else tuple(tuple(t) for t in tables or ())
        s = ScheduledRequest(req.req_id, kind, None if self.grouped or ids is None else ids[0],  # type: ignore[arg-type]
                             req.num_computed_tokens, n, ids if self.grouped else None)
        known = req.num_tokens + req.num_placeholders
        req.sampled_last = req.num_computed_tokens < known <= req.num_computed_tokens + n
        if req.sampled_last:
            req.num_placeholders += req.num_computed_tokens + n - known + 1  # the drafts and the sampled token
        req.num_computed_tokens += n
        req.num_in_flight_tokens += n
        self._commit(req, min(req.num_computed_tokens, req.num_tokens))  # drafts and placeholders are not committed
        return s

    def _commit(self, req: Request, num_tokens: int, computed: bool = False) -> None:
        """vLLM's block pool commits a request's full blocks as it schedules them, once its load lands, and (async
        scheduling) as a step's output arrives. The world caches attention blocks once computed
        (``_cache_full_blocks``); a state block enters the prefix cache here, and is handed to the connector by id
        (``state_handoffs``), the null blocks a chunk passed are not (vLLM's ``MambaManager.cache_blocks``). Unless
        it is ``computed`` already, no admission starts from it until the forward pass computes it."""
        if not self.aligned:
            return
        unit = lcm(*self.block_sizes)
        full = min(num_tokens, len(req.block_hashes) * self.config.block_size) // unit * unit
        for g, (table, size, group) in enumerate(zip(req.tables, self.block_sizes, self.groups)):
            for i in range(req.num_committed_tokens // size, full // size) if group.state else ():
                if table[i] != NULL_BLOCK and self._retained(req, g, i):
                    self.pool.cache(table[i], self.block_hash(req.block_hashes, i, g))
                    if not computed:
                        self.committed_states.add(table[i])
                    self.state_handoffs.append((req.req_id, g, table[i], (i + 1) * size))
        req.num_committed_tokens = max(req.num_committed_tokens, full)

    def _forget_handoffs(self, req: Request) -> None:
        """A request's blocks go back to the pool: its hand-offs not yet in a scheduler output are dropped, as
        vLLM drops them (a block may be another request's by the next step)."""
        self.state_handoffs = [handoff for handoff in self.state_handoffs if handoff[0] != req.req_id]

    def _admit(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        for req in list(self.waiting):
            if budget <= 0:
                break
            if req.loading():
                continue
            if not req.blocks:
                hit = self._lookup(req)
                if hit is None:  # the connector cannot answer yet: ask again next step, as vLLM does
                    continue
                if not self._allocate_with_hits(req, budget, *hit):
                    break
            if req.loading():
                continue
            n = self._chunk(req, req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0 or self._grow(req, req.num_computed_tokens, req.num_computed_tokens + n) is None:
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.state = State.RUNNING
            scheduled.append(self._scheduled(req, "resumed" if req.resumed else "new", req.tables, n))
            req.resumed = False
            budget -= n

    def _lookup(self, req: Request) -> tuple[list[list[int]], int, int, bool] | None:
        """The GPU prefix hit (per group, the blocks a hit needs and NULL_BLOCK before them, and its tokens), then
        the connector's hit in tokens (None: the connector asks to be asked later) and whether it loads
        asynchronously."""
        hashes = req.block_hashes
        hashed = min(req.num_tokens - 1, len(hashes) * self.config.block_size)  # the last token is always computed
        end = longest_hit(self.groups, self.block_sizes, hashed,
                          lambda g, b: self.block_hash(hashes, b, g) in self.pool.by_hash) \
            if self.config.prefix_caching else 0
        hit = [[self.pool.by_hash[self.block_hash(hashes, b, g)] if b in group.blocks_read(end, size) else NULL_BLOCK
                for b in range(end // size)] for g, (group, size) in enumerate(zip(self.groups, self.block_sizes))]
        req.shared_prefix_boundary = self._shared_prefix_boundary(req, hashed, end)
        num_external, is_async = self.connector.get_num_new_matched_tokens(req, end)
        req.looked_up = True
        invariants.lookup(self, req, end, num_external, is_async)
        return None if num_external is None else (hit, end, num_external, is_async)

    def _shared_prefix_boundary(self, req: Request, hashed: int, hit: int) -> int:
        """How far the first group vLLM looks up (full attention if there is one) alone has the prefix cached, if
        further than the ``hit`` every group can supply; else 0 (vLLM's ``shared_prefix_boundary``, from its
        coordinator's ``num_uncached_common_prefix_tokens``). A model with recurrent state then ends a prefill chunk
        there, so that its state is cached too (``groups.state_chunk``)."""
        if not self.aligned or len(self.groups) == 1 or not self.config.prefix_caching:
            return 0
        first = next((g for g, group in enumerate(self.groups) if group.window is None and not group.state), 0)
        alone = longest_hit(self.groups[first:first + 1], self.block_sizes[first:first + 1], hashed,
                            lambda _g, b: self.block_hash(req.block_hashes, b, first) in self.pool.by_hash)
        return alone if alone > hit else 0

    def _allocate_with_hits(self, req: Request, budget: int, hit: list[list[int]], num_local: int,
                            num_external: int, is_async: bool) -> bool:
        """Admission: take the hits, allocate the rest of the first step, tell the connector. False: no room. A
        load fills only the blocks the hit needs: those a sliding window skips once the hit's tokens are computed
        stay NULL_BLOCK, as in vLLM (a hit may end inside a block). An asynchronous load's request waits for it; a
        synchronous one's is scheduled at once, computed from the end of the hit, and the hit's blocks enter the
        prefix cache as it is scheduled (vLLM's ``allocate_slots``): the workers load them before the forward pass."""
        start = end = num_local + num_external
        if not (num_external and is_async):  # it computes in this step: from the end of its hit
            end += self._chunk(req, start, min(req.num_tokens - start, budget))
            if end == start:  # no budget for a block-aligned chunk: vLLM admits no more this step (``break``)
                return False
        if any(table and table[-1] in self.committed_states for table in hit):  # its state is not computed yet:
            return False  # vLLM reports no room (``MambaManager.get_num_blocks_to_allocate``) and admits no more
        held = [b for table in hit for b in table if b != NULL_BLOCK]
        self.pool.take(held)
        req.tables, req.left_behind = [list(table) for table in hit], {}
        for table, group, size in zip(req.tables, self.groups, self.block_sizes):
            skipped = group.skipped_blocks(start, size) if num_external else 0
            table += [NULL_BLOCK] * (skipped - len(table))
        if self._grow(req, start, end, first=True) is None:
            self.pool.release(held)
            req.tables = [[] for _ in self.groups]
            return False
        req.num_computed_tokens = req.num_final_tokens = req.num_cached_tokens = req.num_committed_tokens = num_local
        self.stats["engine_hit_blocks"] += len(held)
        self._allocated(req, num_external)
        if num_external:
            self.stats["tier_hit_tokens"] += num_external
        if num_external and is_async:
            req.state, req.load_target = State.WAITING_FOR_LOAD, start
        elif num_external:
            req.num_computed_tokens = req.num_final_tokens = req.load_target = start
            self._cache_full_blocks(req)
            self.sync_loading.add(req.req_id)
            self.stats["sync_loads"] += 1
        return True

    def _chunk(self, req: Request, start: int, n: int) -> int:
        """The ``n`` tokens from ``start`` that the scheduler computes: a model with recurrent state ends its
        prefill chunks where a state can be cached (``groups.state_chunk``)."""
        if not self.aligned:
            return n
        return state_chunk(start, n, req.num_prompt_tokens, req.num_tokens, lcm(*self.block_sizes),
                           self.config.token_budget, req.shared_prefix_boundary, self.config.checkpoint_alignment)

    def _grow(self, req: Request, start: int, num_tokens: int, first: bool = False) -> list[list[int]] | None:
        """Blocks for ``num_tokens`` in every group, all or none, for a step that computes from ``start``; per
        group, what vLLM reports as new (its ``new_block_ids``). ``first``: the request holds no blocks of its own
        yet (a hit's at most)."""
        plans = [self._grow_state(table, size, num_tokens, first,
                                  self._checkpoint_reserved(req, table, size, start, num_tokens, first))
                 if group.state else (table, max(-(-num_tokens // size) - len(table), 0))
                 for table, size, group in zip(req.tables, self.block_sizes, self.groups)]
        new = self.pool.allocate(sum(n for _table, n in plans))
        if new is None:
            return None
        added = []
        for table, (grown, n) in zip(req.tables, plans):
            first_new = len(table)
            table[:] = grown + new[:n]
            added.append(table[first_new:])  # the null blocks and moved blocks are new ids too, as vLLM reports them
            new = new[n:]
        return added

    def _grow_state(self, table: list[int], size: int, num_tokens: int, first: bool,
                    checkpoint: bool) -> tuple[list[int], int]:
        """A state group's table for ``num_tokens``, and how many new blocks it takes (vLLM's align mode,
        ``MambaManager.allocate_new_blocks``). The state after the last token goes in the block holding that token,
        the null block at the positions before it that the table does not reach yet, except the block before it when
        the step saves a prefill ``checkpoint`` there. With speculative decoding, the ``num_spec_tokens`` blocks
        after it hold the states after each draft token (``num_speculative_blocks``); once the request has blocks,
        those a chunk passed move to the end of the table, the null block in their place
        (``_relocate_speculative_block``): then the table is not append-only."""
        spec = self.config.num_spec_tokens
        need = -(-num_tokens // size) + spec
        if need <= len(table) and not checkpoint:
            return table, 0
        last = need - spec - 1  # the position of the state after the last token
        grown = table + [NULL_BLOCK] * (last - checkpoint - len(table))
        for i in range(len(table) - spec, len(table)) if not first else ():
            if i < last - checkpoint:
                grown.append(grown[i])
                grown[i] = NULL_BLOCK
        return grown, max(need - len(grown), 0)

    def _checkpoint_reserved(self, req: Request, table: list[int], size: int, start: int, num_tokens: int,
                             first: bool) -> bool:
        """Whether vLLM keeps a block for a prefill checkpoint in this step (``MambaManager``'s
        ``_needs_internal_checkpoint``): the chunk saves a checkpoint (``groups.checkpoint_saved``), and reaches the
        end of prefill unless every chunk's state is kept (a ``retention_interval`` other than 0: the coordinator
        passes no prefill end), and that position's column is free: past the table, null, or a speculative block's."""
        alignment, i, spec = self.config.checkpoint_alignment, -(-num_tokens // size) - 2, self.config.num_spec_tokens
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1) if self.config.retention_interval == 0 else 0
        return (alignment is not None and num_tokens >= prefill_end and i >= 0
                and checkpoint_saved(start, num_tokens, (num_tokens - 1) // size * size, size, alignment)
                and (first or i >= len(table) or table[i] == NULL_BLOCK or i >= len(table) - spec))

    def _free_outside_windows(self, req: Request) -> None:
        """A sliding window's blocks that no position still to compute reads go back to the pool, NULL_BLOCK in
        their place (vLLM's ``remove_skipped_blocks``). Nothing tells the connector: a store still reading one
        must be done before the block is written again (the connector can tell from the window and the computed
        tokens which blocks these may be, and flushes its stores of them). Under async scheduling the step in flight
        may still read below its window, and its drafts may be rejected: only the tokens of delivered steps count."""
        processed = max(req.num_computed_tokens - req.num_in_flight_tokens, 0)
        for g, (table, group) in enumerate(zip(req.tables, self.groups)):
            for i in range(min(group.skipped_blocks(processed, self.block_sizes[g]), len(table))):
                if table[i] != NULL_BLOCK:
                    invariants.not_in_flight(self, table[i], "freed by the sliding window", ("load",))
                    self.pool.release([table[i]])
                    self.window_freed.add(table[i])
                    req.left_behind[table[i]] = (g, i)
                    self.stats["window_freed_blocks"] += 1
                    table[i] = NULL_BLOCK

    def _preempt(self, req: Request, drop_in_flight: bool = False) -> None:
        """Free a running request's blocks and queue it again. Its in-flight tokens (async scheduling) are
        delivered, as vLLM delivers them before the request may run again; with ``drop_in_flight`` (a weight
        update: vLLM's ``drop_stale_output``) they are dropped and sampled again."""
        if self.undelivered:
            self.undelivered.samples = [s for s in self.undelivered.samples if s[0] is not req]
        if drop_in_flight:
            req.drop_undelivered()
        else:
            req.deliver(min(len(req.tokens) - req.num_tokens, req.max_tokens - req.num_output_tokens))
        if req.num_output_tokens >= req.max_tokens:  # its last token was in flight: it finishes, not waits
            self._finish(req, State.FINISHED)
            return
        self.pool.release(req.blocks)  # in-flight stores are flushed by the workers before the forward pass
        req.tables = [[] for _ in self.groups]
        req.num_computed_tokens, req.num_cached_tokens, req.num_final_tokens = 0, 0, 0
        req.num_committed_tokens = 0
        self._forget_handoffs(req)
        req.num_placeholders = req.rollback = 0
        req.sampled_last = False  # vLLM drops its drafts
        req.state, req.resumed = State.PREEMPTED, True
        self.waiting.appendleft(req)
        self.preempted_since_step.add(req.req_id)
        self.stats["preemptions"] += 1

    def _forward(self, out: SchedulerOutput) -> list[tuple[Request, int, int]]:
        """Write the KV of every scheduled position (drafts too), sample, and say what each request sampled."""
        samples = []
        for s in out.scheduled:
            req = self.requests[s.req_id]
            start = s.num_computed_tokens - req.rollback  # the GPU already knows which drafts it rejected
            end, known = start + s.num_scheduled_tokens, len(req.tokens)
            drafts = max(end - known, 0)
            accepted = (known * 7 + self.step_no * 13) % (drafts + 1)  # the environment's verdict, reproducible
            inputs = req.tokens[:end] + self._draft_tokens(req, drafts, accepted)
            self._write(req, start, end, inputs, drafts, accepted)
            if end >= known:  # every known token is computed: the request samples
                req.sample(accepted + 1)
                req.rollback += drafts - accepted
                req.num_final_tokens = known + accepted
                samples.append((req, accepted + 1, drafts - accepted))
                self.stats["rejected_drafts"] += drafts - accepted
            else:
                req.num_final_tokens = end
                if self.aligned:  # vLLM caches a state as it schedules it: before the next chunk frees its block
                    self._cache_full_blocks(req)
        return samples

    @staticmethod
    def _draft_tokens(req: Request, drafts: int, accepted: int) -> list[int]:
        """The true continuation, wrong from draft ``accepted`` on (the first wrong one rejects the rest)."""
        tokens = continuation(req.tokens, drafts)
        return tokens[:accepted] + [(t + 1) % 3 for t in tokens[accepted:]]

    def _write(self, req: Request, start: int, end: int, inputs: list[int], drafts: int, accepted: int) -> None:
        """The forward pass writes the KV of positions ``start`` to ``end`` (the last ``drafts`` of them drafts, the
        first ``accepted`` of those right), and a state group the states it computes: garbage, where it attends to
        a block a synchronous load failed to fill."""
        bs = self.config.block_size
        hashes = req.content_hashes[:len(req.tokens) // bs]
        extend_block_hashes(inputs, bs, hashes)  # blocks holding drafts get the hash of what was really input
        req.read_invalid |= bool(self.invalid) and bool(self.invalid.intersection(req.blocks))

        def content(g: int, upto: int) -> int:  # what a block holds once computed up to token ``upto``
            if req.read_invalid:
                return GARBAGE
            size = self.block_sizes[g]
            return self.kv_of(self.block_hash(hashes, upto // size - 1, g)) if upto % size == 0 else PARTIAL
        for g, (table, size, group) in enumerate(zip(req.tables, self.block_sizes, self.groups)):
            writes = self._state_writes(table, start, end, drafts, accepted, size) if group.state else \
                [(i, min(end, (i + 1) * size)) for i in range(start // size, -(-end // size))]
            for i, upto in writes:
                invariants.not_in_flight(self, table[i], "written by the forward pass")
                self.window_freed.discard(table[i])
                for kv in self.kvs:
                    kv.write(table[i], content(g, upto))

    def _state_writes(self, table: list[int], start: int, end: int, drafts: int, accepted: int,
                      size: int) -> list[tuple[int, int]]:
        """(position, the token its state is after) of each state block the forward pass writes, in order (vLLM's
        align mode, ``mamba_utils``): a prefill checkpoint inside the chunk, into its column's block unless the
        table holds the null block there (``compute_mamba_prefill_checkpoints``: the worker decides by itself);
        the state after the last token before the drafts, in the block holding the last token scheduled, and the
        state after each draft in a speculative block after it; then, when the accepted tokens reach a block
        boundary, the state there is copied into that boundary's block (the worker's ``postprocess_mamba``): that
        is the state a later request may hit."""
        known, last = end - drafts, (end - 1) // size
        alignment, checkpoint = self.config.checkpoint_alignment, (end - 1) // size * size
        saved = alignment is not None and checkpoint_saved(start, end, checkpoint, size, alignment) \
            and table[checkpoint // size - 1] != NULL_BLOCK
        writes = [(checkpoint // size - 1, checkpoint)] if saved else []
        self.stats["checkpoints"] += saved
        writes += [(last + j, known + j) for j in range(drafts + 1)]
        boundary = (known + accepted) // size * size
        if boundary >= known and (boundary // size - 1, boundary) not in writes:
            writes.append((boundary // size - 1, boundary))
        return writes

    def _worker_output(self, out: SchedulerOutput) -> tuple[WorkerOutput, set[int]]:
        """Every worker's completions, checked, then merged as vLLM's ``KVOutputAggregator`` merges them: a
        request is finished once every worker said so, job results are concatenated, invalid blocks united, and a
        failed load is failed once its request is finished and some worker said it failed."""
        sending: set[str] = set()
        recving: set[str] = set()
        results: list[tuple[int, bool]] = []
        errors: set[int] = set()
        for worker, executor in zip(self.workers, self.executors):
            executor.last_polled = []
            output = worker.get_finished(out.finished_req_ids)
            load_errors = set(worker.get_block_ids_with_load_errors())
            invariants.completions(self, executor, output, load_errors)
            results += output.job_results
            errors |= load_errors
            self.failed_loads |= output.failed_recving
            sending |= self._count_down("sending", output.finished_sending)
            recving |= self._count_down("recving", output.finished_recving)
        failed, self.failed_loads = self.failed_loads & recving, self.failed_loads - recving
        return WorkerOutput(frozenset(sending), frozenset(recving), tuple(results), frozenset(failed)), errors

    def _count_down(self, what: str, req_ids: frozenset[str]) -> set[str]:
        remaining, done = self.remaining[what], set()
        for req_id in req_ids:
            remaining[req_id] += 1
            if remaining[req_id] == len(self.workers):
                del remaining[req_id]
                done.add(req_id)
        return done

    def _submitted(self, job: Job) -> None:
        self.open_jobs.setdefault(job.job_id, job)
        if job.kind == "load" and job.req_id in self.sync_loading:
            self.sync_jobs.add(job.job_id)
        if job.kind == "load":  # a load and a store of one request may not overlap even within a step
            invariants.jobs(self)
        elif job.kind == "put":
            invariants.write_once(self, job)
        keys = {key for _b, key, _s in job.copies}
        if job.kind == "get":
            self.got |= keys
        elif job.kind == "store":
            self.got -= keys

    def _deliver(self, output: StepOutput) -> None:
        for req, n in output.scheduled:
            req.num_in_flight_tokens -= n
        if self.config.load_failure_policy == "fail" and (output.workers.failed_recving or output.load_errors):
            self._fail_loads(output.workers.failed_recving, output.load_errors)
        self.connector.update_connector_output(output.workers)
        self._count_reports(output.workers.job_results)
        self._apply_worker_output(output.workers, output.load_errors)
        for req, sampled, rejected in output.samples:
            if self.requests.get(req.req_id) is req:  # not finished or aborted meanwhile
                self._apply_sample(req, sampled, rejected)

    def _waited(self) -> None:
        """After ``start_load_kv`` in a step with synchronous loads: every worker ran each of them before the
        forward pass (SYNC), and the blocks one failed to fill hold garbage until the output that reports it."""
        for worker, executor in enumerate(self.executors):
            for job in executor.jobs:
                if job.job_id in self.sync_jobs:
                    invariants.waited(self, job)
                    if not job.success:
                        self.invalid.update(job.gpu_blocks)
                    elif worker == 0:
                        self.stats["blocks_loaded"] += len(job.gpu_blocks)

    def _fail_loads(self, failed: frozenset[str], load_errors: set[int]) -> None:
        """The "fail" policy: a request whose load failed, as a whole (``failed_recving``) or in a block it loads
        into (invalid blocks), ends with an error as the output that says so arrives, before the transfers that
        output reports are applied (vLLM's ``update_from_output``: ``_handle_failed_recving`` and
        ``_handle_invalid_blocks`` first, ``_update_from_kv_xfer_finished`` last). An asynchronous load's blocks
        stay held until it has finished on every worker. A synchronous load's blocks entered the prefix cache as it
        was scheduled: every running request that holds one of them (a later one may have hit it) ends too, and
        vLLM evicts each request's first invalid block and every block after it (``evict_blocks``)."""
        doomed = [r for r in self.waiting if r.loading() and (r.req_id in failed or load_errors & set(r.blocks))]
        marked: set[int] = set()
        for req in self.running:
            invalid = [i for i, b in enumerate(req.tables[0]) if b in load_errors]
            if invalid:
                doomed.append(req)
                first = next((i for i in invalid if req.tables[0][i] not in marked), None)
                marked |= {req.tables[0][i] for i in invalid}
                if first is not None:
                    self.pool.evict(req.tables[0][first:])
        self.invalid -= load_errors
        for req in doomed:
            (self.waiting if req.loading() else self.running).remove(req)
            self._finish(req, State.FAILED)
            self.stats["failed_requests"] += 1

    def _count_reports(self, results: tuple[tuple[int, bool], ...]) -> None:
        for job_id, success in results:
            self.reports[job_id] += 1
            if not success:
                self.failed_jobs.add(job_id)
            if self.reports[job_id] == len(self.workers):
                job = self.open_jobs.pop(job_id)
                del self.reports[job_id]
                self.sync_jobs.discard(job_id)
                if job_id in self.failed_jobs:
                    self.failed_jobs.discard(job_id)
                    self.stats["failed_transfers"] += 1
                elif job.kind == "store":
                    self.stats["blocks_stored"] += len(job.copies)
                if job.req_id in self.needed_until and all(j.kind != "store" for j in self.jobs_of(job.req_id)):
                    self.needed_until[job.req_id] = self.step_no  # its free is not needed any more

    def _apply_worker_output(self, output: WorkerOutput, load_errors: set[int]) -> None:
        # a loading request's invalid blocks (another worker may finish its load later); vLLM reads the others in
        # no request's table, and so does the world
        if load_errors:
            self.bad_blocks |= load_errors & {b for r in self.waiting if r.loading() for b in r.blocks}
        for req_id in sorted(output.finished_sending):  # sorted: set order must not steer block reuse
            self._unhold(req_id, "sending")
        for req_id in sorted(output.finished_recving):
            if req_id in self.delayed:  # finished while its load was in flight
                self._unhold(req_id, "recving")
                continue
            self._load_landed(self.requests[req_id], failed=req_id in output.failed_recving)

    def _unhold(self, req_id: str, what: str) -> None:
        """One hold on a delayed free ends; the blocks go once none is left."""
        self.holds[req_id].discard(what)
        needed_until = self.needed_until.pop(req_id, None) if what == "sending" else None
        if needed_until is not None:  # how long the connector held it beyond its last store, for the report
            self.beyond_need[self.step_no - needed_until] += 1
        if not self.holds[req_id]:
            del self.holds[req_id]
            self._release(self.delayed.pop(req_id).blocks)

    def _load_landed(self, req: Request, failed: bool = False) -> None:
        """The request resumes where its hit ends if every group has what it reads there; else from the longest
        prefix every group can still supply: up to the first block a failed load left invalid, or (a sliding
        window) short of the blocks it needs; from scratch when its load failed as a whole (``failed_recving``: vLLM
        sets its computed tokens to 0), or when that prefix would have it compute into the null blocks the hit left
        in a window's table."""
        bad, sizes = self.bad_blocks & set(req.blocks), self.block_sizes
        self.bad_blocks -= set(req.blocks)

        def valid(g: int, i: int) -> bool:
            return req.tables[g][i] not in bad and req.tables[g][i] != NULL_BLOCK
        if failed:
            done = 0
        elif all(valid(g, i) for g, (group, size) in enumerate(zip(self.groups, sizes))
                 for i in group.blocks_read(req.load_target, size)):
            done = req.load_target
        else:
            done = longest_hit(self.groups, sizes, req.load_target, valid)
            if any(NULL_BLOCK in table[done // size:] for table, size in zip(req.tables, sizes)):
                done = 0  # the hit left a window's null blocks where the request would compute again: start over
        if done and done == req.load_target:
            invariants.landed(self, req)
        self.stats["blocks_loaded"] += (done - req.num_computed_tokens) // self.config.block_size
        req.num_computed_tokens = req.num_final_tokens = done
        req.state = State.WAITING
        if done == 0:  # nothing valid: vLLM frees the blocks without telling the connector, and allocates anew
            self.pool.release(req.blocks)
            req.tables, req.num_cached_tokens, req.num_committed_tokens = [[] for _ in self.groups], 0, 0
            self._forget_handoffs(req)
            return
        self._commit(req, done)
        self._cache_full_blocks(req)
        req.num_computed_tokens = min(done, req.num_tokens - 1)  # a whole-prompt hit recomputes the last token

    def _apply_sample(self, req: Request, sampled: int, rejected: int) -> None:
        req.num_computed_tokens -= rejected
        req.num_placeholders -= rejected + sampled
        req.rollback -= rejected
        req.deliver(min(sampled, req.max_tokens - req.num_output_tokens))  # vLLM stops a request at max_tokens
        if self.config.async_scheduling:  # vLLM's AsyncScheduler commits what the delivered step computed
            self._commit(req, req.num_computed_tokens - req.num_placeholders, computed=True)
        self._cache_full_blocks(req)
        if req.num_output_tokens >= req.max_tokens:
            self.running.remove(req)
            self._finish(req, State.FINISHED)

    def _cache_full_blocks(self, req: Request) -> None:
        """Blocks computed for good and hashed enter the prefix cache, up to a block boundary of every group
        (vLLM caches only as far as a hit could reach)."""
        unit = lcm(*self.block_sizes)
        full = min(req.num_final_tokens, len(req.block_hashes) * self.config.block_size) // unit * unit
        for g, (table, size) in enumerate(zip(req.tables, self.block_sizes)):
            for i in range(req.num_cached_tokens // size, full // size):
                if table[i] != NULL_BLOCK and self._retained(req, g, i):
                    invariants.not_in_flight(self, table[i], "entered the prefix cache", ("load",))
                    self.pool.cache(table[i], self.block_hash(req.block_hashes, i, g))
        req.num_cached_tokens = max(req.num_cached_tokens, full)

    def _retained(self, req: Request, g: int, i: int) -> bool:
        """Whether the prefix cache keeps block ``i`` of group ``g`` of this request (``groups.retained``): where a
        later request resumes is the prompt's last token, and the shared-prefix junction if it has one."""
        boundaries = [req.num_prompt_tokens - 1] + ([req.shared_prefix_boundary] if req.shared_prefix_boundary else [])
        return retained(self.groups[g], i, self.block_sizes[g], lcm(*self.block_sizes), boundaries,
                        self.config.retention_interval)

    def _finish(self, req: Request, state: State) -> None:
        loading = req.loading()  # the engine itself holds its blocks until the load lands
        if loading:  # a block it was loading into may be another request's next: its invalid marks go with it
            self.bad_blocks -= set(req.blocks)
        req.state = state
        del self.requests[req.req_id]
        self.finished_since_step.add(req.req_id)  # if preempted since the last step, it is reported as both
        self._forget_handoffs(req)
        self.stats["finished"] += 1
        self._free_outside_windows(req)  # vLLM's _connector_finished frees them before request_finished
        delay = False
        if req.looked_up:
            stores = [job for job in self.jobs_of(req.req_id) if job.kind == "store"]
            delay = self._finished(req)
            if not self.fenced:
                invariants.finish(req, delay, stores)
            if delay:
                self.needed_until[req.req_id] = None if stores else self.step_no
        holds = {what for what, on in (("sending", delay), ("recving", loading)) if on}
        if holds:
            self.delayed[req.req_id], self.holds[req.req_id] = req, holds
        else:
            self._release(req.blocks)

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.pool.refs[b] == 1:  # a fenced connector may free under stores: they must flush before reuse
                invariants.not_in_flight(self, b, "freed", ("load",) if self.fenced else ("store", "load"))
        self.pool.release(blocks)

    # ---- transfers, as the engine and the workers see them ---------------------------------------------------
    def jobs_of(self, req_id: str) -> list[Job]:
        """Jobs of a request that the scheduler side has not heard the end of from every worker."""
        return [job for job in self.open_jobs.values() if job.req_id == req_id]

    def in_flight(self) -> Iterator[Job]:
        """Every worker's copy of every job submitted and not yet polled."""
        for executor in self.executors:
            yield from executor.jobs

    def touching(self, block: int) -> Iterator[Job]:
        """Jobs that still read (unexecuted stores) or write (unreported loads; synchronous ones: unexecuted) a GPU
        block, on any worker."""
        return (j for j in self.in_flight() if block in j.gpu_blocks
                and (j.kind == "load" and j.job_id not in self.sync_jobs or not j.executed))

    def advance(self, index: int, fail: bool) -> None:
        """The environment moves one job on one worker a stage on (picked by index over all workers' jobs)."""
        jobs = [(executor, i) for executor in self.executors for i in range(len(executor.jobs))]
        if jobs:
            executor, i = jobs[index % len(jobs)]
            executor.advance(i, fail)

    # ---- for the kit ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """The state invariants, after any rule."""
        invariants.content(self)
        invariants.jobs(self)
        if self.pins:
            invariants.pins(self)
        if self.observable:
            obs = self.observe()
            invariants.ref(self, obs)
            invariants.cursor(self, obs)
        self.stats["checks"] += 1

    def run_to_completion(self) -> None:
        """PROGRESS: with no new requests, every live request finishes within a bound of engine steps."""
        bound = 20 + 4 * sum(len(r.prompt) + r.max_tokens for r in self.requests.values())
        steps = 0
        while self.requests and steps < bound:
            self.step()
            steps += 1
        invariants.progress(self, bound)

    def fits(self) -> bool:
        """The live requests fit the GPU pool together. (When they do not, the engine itself can deadlock: waiting
        requests that hold loaded blocks are never preempted, in vLLM as here. Liveness is the connector's only
        where the engine cannot stall on its own.)"""
        need = sum(-(-(len(r.prompt) + r.max_tokens + self.config.num_spec_tokens) // size)
                   for r in self.requests.values() for size in self.block_sizes)
        return need + sum(len(r.blocks) for r in self.delayed.values()) <= self.config.num_gpu_blocks

    def drain(self, max_steps: int = 12) -> None:
        """Abort everything, let every transfer finish, and check RELEASE and QUIESCE. With a shared store, a quiet
        step may still plan puts (a store's completion does): it takes two quiet steps in a row to be drained."""
        for req in list(self.requests.values()):
            self.abort(req)
        quiet = 0
        for _ in range(max_steps):
            busy = self.open_jobs or self.delayed or self.finished_since_step or self.undelivered
            quiet = 0 if busy else quiet + 1
            if quiet > (2 if self.store is not None else 0):
                break
            for executor in self.executors:
                executor.drain()
            self.step()
        invariants.release(self)
        invariants.quiesce(self, self.observe() if self.observable else None)

    def observe(self) -> Observation:
        """The connector's observable state; only for an ``observable`` world (its connector declares OBSERVE)."""
        return cast(Observable, self.connector).observe()

    def snapshot(self) -> tuple[tuple[object, ...], ...]:
        """What two worlds driven by equivalent connectors agree on, step for step."""
        reqs = tuple((r.req_id, r.state.value, r.num_computed_tokens, self.table_of(r), r.num_tokens)
                     for r in self.requests.values())
        jobs = tuple((j.req_id, j.kind, j.copies, j.executed, j.success, j.reported) for j in self.in_flight())
        return reqs, tuple(sorted(self.delayed)), jobs, tuple(self.events)
