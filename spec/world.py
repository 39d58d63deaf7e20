"""The world: a small, faithful model of vLLM v1's scheduler and KV-cache manager around a connector.

One ``World`` owns a GPU block pool with prefix caching, the requests, a token budget per step, and the
executor that decides when each transfer the connector submits runs, fails, and is reported. Each ``step()`` is
one engine iteration, in vLLM's order:

  schedule (admissions ask the connector for hits) -> build_connector_meta -> handle_preemptions
  -> start_load_kv -> forward pass (writes KV) -> wait_for_save -> get_finished -> update_connector_output
  -> sample tokens, cache full blocks, finish requests (request_finished may delay the free)
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Callable, Iterator

from attrs import define, field

from . import invariants
from .config import BlockIdError, Config
from .types import CONNECTOR_METHODS, Connector, GpuKV, Job, ScheduledRequest, SchedulerOutput, WorkerOutput

HASH_BITS = (1 << 62) - 1
PARTIAL = -1  # content of a block whose tokens are only partly computed
GARBAGE = -2  # content of a block nothing has written yet


def extend_block_hashes(tokens: list[int], block_size: int, hashes: list[int]) -> None:
    """Append the chained hash of every block of ``tokens`` that became full. The hash is also the block's
    content: equal hashes mean equal prefixes, so a block holds the right KV iff it holds its hash."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else 0
        hashes.append(hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]))) & HASH_BITS)


def next_token(tokens: list[int]) -> int:
    """The 'model': a deterministic greedy next token, so equal prefixes continue equally."""
    return hash(tuple(tokens[-3:])) % 3


@define
class ListKV:
    """GPU KV memory holding one content id per block (the torch version holds real bytes)."""

    num_blocks: int
    data: list[int] = field()

    @data.default
    def _garbage(self) -> list[int]:
        return [GARBAGE] * self.num_blocks

    def check(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise BlockIdError(f"GPU block id {block_id} out of range [0, {self.num_blocks})")
        return block_id

    def write(self, block_id: int, content: int) -> None:
        self.data[self.check(block_id)] = content

    def read(self, block_id: int) -> int:
        return self.data[self.check(block_id)]

    def holds(self, block_id: int, content: int) -> bool:
        return self.read(block_id) == content


@define
class BlockPool:
    """vLLM's block pool: ref counts, prefix cache by hash, free blocks reused least-recently-freed first."""

    num_blocks: int
    refs: list[int] = field()
    free: dict[int, None] = field()  # an ordered set: the head is reused first
    hash_of: dict[int, int] = field(factory=dict)  # cached block -> hash
    by_hash: dict[int, int] = field(factory=dict)  # hash -> cached block

    @refs.default
    def _no_refs(self) -> list[int]:
        return [0] * self.num_blocks

    @free.default
    def _all_free(self) -> dict[int, None]:
        return dict.fromkeys(range(self.num_blocks))

    def prefix_hit(self, hashes: list[int]) -> list[int]:
        hit = []
        for h in hashes:
            if h not in self.by_hash:
                break
            hit.append(self.by_hash[h])
        return hit

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free.pop(b, None)
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        blocks = list(self.free)[:n]
        for b in blocks:
            del self.free[b]
            if b in self.hash_of:  # reusing a cached block evicts it from the prefix cache
                del self.by_hash[self.hash_of.pop(b)]
            self.refs[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail blocks first, so they are reused first (vLLM's order)
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def cache(self, block: int, block_hash: int) -> None:
        if block_hash not in self.by_hash and block not in self.hash_of:
            self.by_hash[block_hash] = block
            self.hash_of[block] = block_hash


class State(Enum):
    WAITING = "waiting"
    WAITING_FOR_LOAD = "waiting-for-load"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@define(eq=False)
class Request:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    block_size: int
    tokens: list[int] = field()
    block_hashes: list[int] = field(factory=list)
    state: State = State.WAITING
    num_computed_tokens: int = 0
    blocks: list[int] = field(factory=list)  # the block table
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    load_target: int = 0  # tokens computed once the pending load lands
    looked_up: bool = False  # the connector has seen this request
    resumed: bool = False  # preempted since it last ran

    @tokens.default
    def _prompt(self) -> list[int]:
        return list(self.prompt)

    def __attrs_post_init__(self) -> None:
        extend_block_hashes(self.tokens, self.block_size, self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def append_token(self) -> None:
        self.tokens.append(next_token(self.tokens))
        extend_block_hashes(self.tokens, self.block_size, self.block_hashes)


@define
class Executor:
    """The environment's side of transfers. A job is submitted, then executed (its copy runs, or it fails without
    copying), then released for reporting, then polled by the worker. With ``delay`` 0 all of it happens at submit;
    otherwise the environment may hold a job back, but for at most ``delay`` steps."""

    delay: int = 0
    jobs: list[Job] = field(factory=list)  # submitted, not yet polled, in submission order
    last_polled: list[Job] = field(factory=list)
    fail_next: bool = False  # the next job to execute fails
    before_store: Callable[[Job], None] | None = None  # checks what a store is about to read
    submitted_at: dict[int, int] = field(factory=dict)  # id(job) -> tick of submission
    ticks: int = 0
    kv: GpuKV | None = None  # where failed loads leave garbage

    def submit(self, job: Job) -> None:
        self.jobs.append(job)
        self.submitted_at[id(job)] = self.ticks
        if not self.delay:
            self.execute(job)
            job.reported = True

    def tick(self) -> None:
        """One engine step passed: jobs held back for ``delay`` steps complete now."""
        self.ticks += 1
        for job in self.jobs:
            if self.ticks - self.submitted_at[id(job)] >= self.delay:
                if not job.executed:
                    self.execute(job)
                job.reported = True

    def execute(self, job: Job, fail: bool = False) -> None:
        ok = not (fail or self.fail_next)
        self.fail_next = False
        if ok:
            if job.kind == "store" and self.before_store:
                self.before_store(job)
            job.run()
        elif job.kind == "load" and self.kv is not None:
            for block in job.gpu_blocks:  # a load that failed midway leaves garbage behind
                self.kv.write(block, GARBAGE)
        job.executed, job.ok = True, ok

    def advance(self, index: int, fail: bool) -> None:
        """Move one job a stage on: execute it (or fail it), else release it for reporting."""
        job = self.jobs[index % len(self.jobs)]
        if job.executed:
            job.reported = True
        else:
            self.execute(job, fail)

    def flush(self, job_ids: set[int]) -> None:
        """A worker waits for these jobs to execute now (preemption); they may still fail."""
        for job in self.jobs:
            if job.job_id in job_ids and not job.executed:
                self.execute(job)

    def poll(self) -> list[tuple[int, bool]]:
        self.last_polled = [j for j in self.jobs if j.reported]
        self.jobs = [j for j in self.jobs if not j.reported]
        for job in self.last_polled:
            del self.submitted_at[id(job)]
        return [(j.job_id, bool(j.ok)) for j in self.last_polled]

    def drain(self) -> None:
        for job in self.jobs:
            if not job.executed:
                self.execute(job)
            job.reported = True

    def of(self, req_id: str) -> list[Job]:
        return [j for j in self.jobs if j.req_id == req_id]

    def unexecuted(self, kind: str) -> Iterator[Job]:
        return (j for j in self.jobs if j.kind == kind and not j.executed)

    def touching(self, block: int) -> Iterator[Job]:
        """Jobs that still read (unexecuted stores) or write (unreported loads) a GPU block."""
        return (j for j in self.jobs if block in j.gpu_blocks and (j.kind == "load" or not j.executed))


@define
class World:
    config: Config
    connector: Connector
    kv: GpuKV
    executor: Executor = field(factory=Executor)
    pool: BlockPool = field()
    observable: bool = False  # the connector has observe(): check TRACK, REF, CURSOR too
    fenced: bool = False  # the connector frees under in-flight stores and flushes before reuse (types.FENCED_FREES)
    requests: dict[str, Request] = field(factory=dict)  # live: not finished
    history: dict[str, Request] = field(factory=dict)  # every request ever added: what its blocks should hold
    delayed: dict[str, Request] = field(factory=dict)  # finished, blocks held until the worker says so
    waiting: deque[Request] = field(factory=deque)
    running: list[Request] = field(factory=list)
    finished_since_step: set[str] = field(factory=set)
    step_no: int = 0
    next_id: int = 0
    events: list = field(factory=list)
    stats: dict[str, int] = field(factory=lambda: dict.fromkeys(
        ("steps", "requests", "finished", "preemptions", "engine_hit_blocks", "tier_hit_tokens", "blocks_loaded",
         "blocks_stored", "failed_transfers", "checks"), 0))

    @pool.default
    def _pool(self) -> BlockPool:
        return BlockPool(self.config.num_gpu_blocks)

    def __attrs_post_init__(self) -> None:
        missing = [name for name in CONNECTOR_METHODS if not callable(getattr(self.connector, name, None))]
        if missing:
            raise TypeError(f"{type(self.connector).__name__} is not a connector: it lacks {', '.join(missing)}")
        self.executor.kv = self.kv
        self.executor.before_store = lambda job: invariants.store_bytes(self, job)
        self.connector.register_kv_caches(self.kv, self.executor)

    # ---- the engine's inputs -------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_tokens: int) -> Request:
        req = Request(f"r{self.next_id}", tuple(prompt), max_tokens, self.config.block_size)
        self.next_id += 1
        self.requests[req.req_id] = self.history[req.req_id] = req
        self.waiting.append(req)
        self.stats["requests"] += 1
        return req

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (vLLM's ``reset_prefix_cache``): hits must come from the tier."""
        for block in [b for b in self.pool.hash_of if self.pool.refs[b] == 0]:
            del self.pool.by_hash[self.pool.hash_of.pop(block)]

    def abort(self, req: Request) -> None:
        if req.state is State.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, State.ABORTED)

    # ---- one engine step -----------------------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        self.executor.tick()
        out = self._schedule()
        meta = self.connector.build_connector_meta(out)
        if self.observable:
            invariants.track(self, self.connector.observe())
        self.connector.handle_preemptions(out.preempted_req_ids)
        if not self.fenced:
            invariants.src(self)
        self.connector.start_load_kv(meta)
        self._forward(out)
        self.connector.wait_for_save(meta)
        self.executor.last_polled = []
        output = self.connector.get_finished(out.finished_req_ids)
        load_errors = set(self.connector.get_block_ids_with_load_errors())
        invariants.completions(self, output, self.executor.last_polled, load_errors)
        self.connector.update_connector_output(output)
        self._apply_worker_output(output, load_errors)
        self._after_forward(out)
        self.events += self.connector.take_events()
        self.stats["steps"] += 1
        self.stats["blocks_stored"] += sum(
            len(j.copies) for j in self.executor.last_polled if j.kind == "store" and j.ok)
        self.stats["failed_transfers"] += sum(not j.ok for j in self.executor.last_polled)
        return out

    def _schedule(self) -> SchedulerOutput:
        self.step_no += 1
        budget = self.config.token_budget
        scheduled: list[ScheduledRequest] = []
        preempted: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = self._grow(req, req.num_computed_tokens + n)
            while new_blocks is None:  # short of blocks: preempt the lowest-priority running request
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.req_id)
                if victim is req:
                    break
                new_blocks = self._grow(req, req.num_computed_tokens + n)
            if new_blocks is None:
                break
            scheduled.append(ScheduledRequest(req.req_id, "running", tuple(new_blocks) or None,
                                              req.num_computed_tokens, n))
            budget -= n
            i += 1
        if not preempted:
            self._admit(scheduled, budget)
        finished, self.finished_since_step = frozenset(self.finished_since_step), set()
        return SchedulerOutput(self.step_no, tuple(scheduled), frozenset(preempted), finished)

    def _admit(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        for req in list(self.waiting):
            if budget <= 0:
                break
            if req.state is State.WAITING_FOR_LOAD:
                continue
            if not req.blocks:
                hit = self._lookup(req)
                if hit is None:  # the connector cannot answer yet: ask again next step, as vLLM does
                    continue
                if not self._allocate_with_hits(req, budget, *hit):
                    break
            if req.state is State.WAITING_FOR_LOAD:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._grow(req, req.num_computed_tokens + n) is None:
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.state = State.RUNNING
            scheduled.append(ScheduledRequest(req.req_id, "resumed" if req.resumed else "new", tuple(req.blocks),
                                              req.num_computed_tokens, n))
            req.resumed = False
            budget -= n

    def _lookup(self, req: Request) -> tuple[list[int], int] | None:
        """The GPU prefix hit, then the connector's hit in tokens (None: the connector asks to be asked later)."""
        bs = self.config.block_size
        hit = self.pool.prefix_hit(req.block_hashes[:(req.num_tokens - 1) // bs]) if self.config.prefix_caching else []
        num_external, is_async = self.connector.get_num_new_matched_tokens(req, len(hit) * bs)
        req.looked_up = True
        invariants.lookup(req, len(hit) * bs, num_external, is_async)
        return None if num_external is None else (hit, num_external)

    def _allocate_with_hits(self, req: Request, budget: int, hit: list[int], num_external: int) -> bool:
        """Admission: take the hits, allocate the rest of the first step, tell the connector. False: no room."""
        num_local = len(hit) * self.config.block_size
        first_step = num_external if num_external else min(req.num_tokens - num_local, budget)
        self.pool.take(hit)
        req.blocks = list(hit)
        if self._grow(req, num_local + first_step) is None:
            self.pool.release(hit)
            req.blocks = []
            return False
        req.num_computed_tokens, req.num_cached_blocks = num_local, len(hit)
        self.stats["engine_hit_blocks"] += len(hit)
        self.connector.update_state_after_alloc(req, list(req.blocks), num_external)
        if num_external:
            req.state, req.load_target = State.WAITING_FOR_LOAD, num_local + num_external
            self.stats["tier_hit_tokens"] += num_external
        return True

    def _grow(self, req: Request, num_tokens: int) -> list[int] | None:
        need = -(-num_tokens // self.config.block_size) - len(req.blocks)
        new = self.pool.allocate(max(need, 0))
        if new is not None:
            req.blocks += new
        return new

    def _preempt(self, req: Request) -> None:
        self.pool.release(req.blocks)  # in-flight stores are flushed by the worker before the forward pass
        req.blocks, req.num_computed_tokens, req.num_cached_blocks = [], 0, 0
        req.state, req.resumed = State.PREEMPTED, True
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def _forward(self, out: SchedulerOutput) -> None:
        bs = self.config.block_size
        for s in out.scheduled:
            req = self.requests[s.req_id]
            end = s.num_computed_tokens + s.num_scheduled_tokens
            for i in range(s.num_computed_tokens // bs, -(-end // bs)):
                block = req.blocks[i]
                invariants.not_in_flight(self, block, "written by the forward pass")
                self.kv.write(block, req.block_hashes[i] if end >= (i + 1) * bs else PARTIAL)

    def _apply_worker_output(self, output: WorkerOutput, load_errors: set[int]) -> None:
        for req_id in sorted(output.finished_sending):  # sorted: set order must not steer block reuse
            self._release(self.delayed.pop(req_id).blocks)
        for req_id in sorted(output.finished_recving):
            if req_id in self.delayed:  # finished while its load was in flight: now the blocks can go
                self._release(self.delayed.pop(req_id).blocks)
                continue
            req = self.requests[req_id]
            bad = [i for i, b in enumerate(req.blocks) if b in load_errors]
            done = min([req.load_target] + [i * self.config.block_size for i in bad])
            self.stats["blocks_loaded"] += (done - req.num_computed_tokens) // self.config.block_size
            req.num_computed_tokens, req.state = done, State.WAITING
            self._cache_full_blocks(req)
            req.num_computed_tokens = min(done, req.num_tokens - 1)  # a whole-prompt hit recomputes the last token

    def _after_forward(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            req = self.requests[s.req_id]
            req.num_computed_tokens += s.num_scheduled_tokens
            self._cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.append_token()
                if req.num_output_tokens >= req.max_tokens:
                    self.running.remove(req)
                    self._finish(req, State.FINISHED)

    def _cache_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.config.block_size
        for i in range(req.num_cached_blocks, full):
            invariants.not_in_flight(self, req.blocks[i], "entered the prefix cache", ("load",))
            self.pool.cache(req.blocks[i], req.block_hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def _finish(self, req: Request, state: State) -> None:
        loading = req.state is State.WAITING_FOR_LOAD  # the engine itself holds its blocks until the load lands
        req.state = state
        del self.requests[req.req_id]
        self.finished_since_step.add(req.req_id)
        self.stats["finished"] += 1
        delay = False
        if req.looked_up:
            stores = [job for job in self.executor.of(req.req_id) if job.kind == "store"]
            delay = self.connector.request_finished(req, list(req.blocks))
            if not self.fenced:
                invariants.finish(req, delay, stores)
        if delay or loading:
            self.delayed[req.req_id] = req
        else:
            self._release(req.blocks)

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.pool.refs[b] == 1:  # a fenced connector may free under stores: they must flush before reuse
                invariants.not_in_flight(self, b, "freed", ("load",) if self.fenced else ("store", "load"))
        self.pool.release(blocks)

    # ---- for the kit ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """The state invariants, after any rule."""
        invariants.content(self)
        invariants.jobs(self)
        if self.observable:
            obs = self.connector.observe()
            invariants.ref(self, obs)
            invariants.cursor(self, obs)
        self.stats["checks"] += 1

    def drain(self, max_steps: int = 8) -> None:
        """Abort everything, let every transfer finish, and check QUIESCE."""
        for req in list(self.requests.values()):
            self.abort(req)
        for _ in range(max_steps):
            if not (self.executor.jobs or self.delayed or self.finished_since_step):
                break
            self.executor.drain()
            self.step()
        invariants.quiesce(self, self.connector.observe() if self.observable else None)

    def snapshot(self) -> tuple:
        """What two worlds driven by equivalent connectors agree on, step for step."""
        reqs = tuple((r.req_id, r.state.value, r.num_computed_tokens, tuple(r.blocks), r.num_tokens)
                     for r in self.requests.values())
        jobs = tuple((j.req_id, j.kind, j.copies, j.executed, j.ok, j.reported) for j in self.executor.jobs)
        return reqs, tuple(sorted(self.delayed)), jobs, tuple(self.events)
