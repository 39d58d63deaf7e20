"""The invariants of correct offloading, one named function each.

Each function returns nothing when the invariant holds and raises ``Violation`` naming the request, block or key
when it does not. The world calls the ones tied to a moment (TRACK right after ``build_connector_meta``, FINISH at
``request_finished``, SRC/DST when a block is freed or written); the kit calls the state invariants after every rule.

Two kinds, reported under their own headings. SAFETY invariants hold at every step: nothing wrong ever happens (no
block read after reuse, no wrong bytes served). LIVENESS properties hold *eventually*: something good happens once
the environment lets it (delayed frees are released, jobs reported, requests finish once no new ones arrive). A
connector that is cautious (it delays a free longer than its stores need) is safe; how long it waited beyond need is
reported, not failed, as long as the free comes.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, cast

from .types import NULL_BLOCK, POOL_STORE, Key, Observation, WorkerOutput, group_key

if TYPE_CHECKING:
    from .kit.coverage import Coverage
    from .types import GpuKV, Job
    from .executor import Executor
    from .records import Namespace
    from .requests import Request
    from .store import Store
    from .world import World

SPEC_VERSION = "0.16"

SAFETY = ("TRACK", "SRC", "DST", "CONTENT", "REF", "ATOMIC", "CURSOR", "JOBS", "FINISH", "FAIL", "LOOKUP", "SYNC",
          "CAPACITY", "KEEP", "WRITE-ONCE", "NAMESPACE")
LIVENESS = ("RELEASE", "QUIESCE", "PROGRESS")


class Violation(AssertionError):
    """An invariant failed. A kit run fills in the rest: the program that broke it (``trace``, each rule with its
    arguments), its length (``rules_run``) and what the run had exercised by then (``coverage``)."""

    invariant: str
    rules_run: int | None = None
    adapter: int = 0  # which of the adapters run alongside it was found on (the first: 0)
    trace: list[tuple[str, dict[str, Any]]] | None = None
    coverage: Coverage | None = None

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"[kvoffload spec {SPEC_VERSION}] {self.kind} · {invariant}: {message}")

    @property
    def kind(self) -> str:
        """The heading it is reported under: "safety", "liveness", "connector error" (RAISED) or "equivalence"
        (EQUIV: the exact level's comparison with the spec)."""
        if self.invariant in LIVENESS:
            return "liveness"
        return {"RAISED": "connector error", "EQUIV": "equivalence"}.get(self.invariant, "safety")

    @property
    def finding(self) -> str:
        """What was found, by a stable name: the invariant ("TRACK"), or "RAISED" and the exception's type."""
        return self.invariant


class ConnectorError(Violation):
    """RAISED — the connector (or the world, on what the connector returned) raised an exception of its own during a
    kit run: an IndexError, an assert in its code. Reported as a violation naming the exception's type, its text and
    where it was raised (``where``: file, line and function); the exception itself is the ``__cause__``."""

    raised: str  # the exception's type, by name
    where: str  # "file:line in function", or "" when unknown

    def __init__(self, raised: Exception, where: str = "") -> None:
        self.raised, self.where = type(raised).__name__, where
        super().__init__("RAISED", f"the connector raised {self.raised}" + (f": {raised}" if str(raised) else "")
                         + (f" (at {where})" if where else ""))
        self.__cause__ = raised

    @property
    def finding(self) -> str:
        return f"{self.invariant} {self.raised}"


CHECKED: Counter[str] = Counter()  # how often each invariant was evaluated in this process (for reports)


def require(ok: bool, invariant: str, message: str) -> None:
    """Evaluate one check of ``invariant``: count it in ``CHECKED`` (the coverage report's invariants line), and raise
    its ``Violation`` unless ``ok``. Checks outside this module (black-box mode's, on the jobs a connector emits) go
    through it too, so that a check that runs is counted as run."""
    CHECKED[invariant] += 1
    if not ok:
        raise Violation(invariant, message)


_require = require


def track(world: World, obs: Observation) -> None:
    """TRACK — the connector's block table for each request equals the scheduler's, whatever it decided to store.

    Prevents the seed bug: a refused store allocation that ``break``s out of the batch loop leaves every later
    request without its new block ids, and later stores read the wrong GPU block (or raise IndexError).
    """
    for req in world.requests.values():
        if req.looked_up and req.blocks:
            got = obs.tracked.get(req.req_id, ())
            _require(same_tables(world.table_of(req), got, world.grouped), "TRACK",
                     f"step {world.step_no}, request {req.req_id}: scheduler table {world.table_of(req)}, "
                     f"connector {got}")
    for req_id, table in obs.tracked.items():
        owner = world.requests.get(req_id) or world.delayed.get(req_id)
        if owner is not None and owner.state.value == "waiting" and not owner.blocks:
            continue  # vLLM freed its blocks after a failed load without telling; the next alloc replaces the table
        if any(len(t) for t in cast("tuple[tuple[int, ...], ...]", table)) if world.grouped else table:
            _require(owner is not None and same_tables(world.table_of(owner), table, world.grouped), "TRACK",
                     f"step {world.step_no}: connector tracks {table} for {req_id}, which holds "
                     f"{world.table_of(owner) if owner is not None else 'no blocks'}")


def same_tables(engine: tuple[Any, ...], tracked: tuple[Any, ...], grouped: bool) -> bool:
    """A tracked table equals the engine's, except where a sliding window freed a block: vLLM does not tell the
    connector when (its own copy keeps the old id there, and it must not read it: SRC)."""
    def same(mine: tuple[int, ...], theirs: tuple[int, ...]) -> bool:
        return len(mine) == len(theirs) and all(e in (NULL_BLOCK, t) for e, t in zip(mine, theirs))
    if not grouped:  # one table (a model of one attention kind: it may be a sliding window's)
        return same(engine, tracked)
    return len(engine) == len(tracked) and all(same(mine, theirs) for mine, theirs in zip(engine, tracked))


def src(world: World) -> None:
    """SRC — a block an unexecuted store reads still belongs to that request, holding the key being stored.

    Prevents stores that copy a block after it was freed and reused (preemption without a flush, a finish that
    freed blocks under a running store): the tier would keep another prefix's bytes under this key.
    """
    for job in (j for j in world.in_flight() if j.kind == "store" and not j.executed):
        owner = world.requests.get(job.req_id) or world.delayed.get(job.req_id)
        for block, _key, _sub in job.copies:
            if block in world.window_freed:  # fenced: checked when it is written again
                continue
            _require(owner is not None and block in owner.blocks and world.pool.refs[block] > 0, "SRC",
                     f"step {world.step_no}: store job {job.job_id} of {job.req_id} still reads block {block}, "
                     f"which the request no longer holds")


def store_bytes(world: World, job: Job, kv: GpuKV) -> None:
    """SRC — as a store executes, every GPU block it reads holds exactly the final bytes of its key's prefix.

    The data-plane half of SRC, checked whatever the protocol: a store that names the wrong GPU block (the seed
    bug's drift), reads a block already rewritten for another request, a block whose last tokens are not computed
    yet, or a rejected draft's KV, would put foreign bytes under the key. Only keys the engine has hashed exist.
    """
    if job.req_id == POOL_STORE:
        return pool_store_bytes(world, job, kv)
    req, k = world.history[job.req_id], world.config.k
    if req.read_invalid:  # garbage no connector could know of yet: the engine fails the request; CONTENT catches any
        return  # entry of it that is ever served
    keys = {group_key(h, g): (i, g) for g in range(len(world.groups)) for i, h in enumerate(req.block_hashes)}
    for block, key, sub in job.copies:
        _require(key in keys, "SRC", f"step {world.step_no}: store job {job.job_id} of {job.req_id} stores key "
                                     f"{key:#x}, which is not a block of that request's prefix in any group")
        last, group = keys[key]  # the key is its offload block's last hash; its blocks hold m hashes each
        m = world.block_sizes[group] // world.config.block_size
        block_hash = last - (k - 1 - sub) * m  # the last hash of the block at index sub
        _require(block_hash >= 0, "SRC", f"step {world.step_no}: store job {job.job_id} of {job.req_id} stores "
                                         f"key {key:#x} at index {sub}, before the request's first block")
        _require(kv.holds(block, world.kv_of(group_key(req.block_hashes[block_hash], group), job.weights)), "SRC",
                 f"step {world.step_no}: store job {job.job_id} of {job.req_id} reads GPU block {block} for "
                 f"position {block_hash // m}" + (f" of group {group}" if group else "")
                 + ", but the block holds other bytes")


def pool_store_bytes(world: World, job: Job, kv: GpuKV) -> None:
    """SRC for a store of cached blocks (PINS): each block is in the prefix cache under the key it is stored under,
    and holds that key's bytes."""
    for block, key, sub in job.copies:
        _require(sub == 0 and world.pool.hash_of.get(block) == key, "SRC",
                 f"step {world.step_no}: store job {job.job_id} stores GPU block {block} under key {key:#x} (index "
                 f"{sub}), not under the key the prefix cache holds it under")
        _require(kv.holds(block, world.kv_of(key, job.weights)), "SRC",
                 f"step {world.step_no}: store job {job.job_id} reads GPU block {block}, cached under key {key:#x}, "
                 f"but the block holds other bytes")


def not_in_flight(world: World, block: int, action: str, kinds: tuple[str, ...] = ("store", "load")) -> None:
    """SRC + DST at the moment a block is freed or written: no store still reads it, no load still writes it.
    (DST alone when it enters the prefix cache: other requests would read it before the load landed.)"""
    for job in world.touching(block):
        if job.kind not in kinds:
            continue
        _require(False, "SRC" if job.kind == "store" else "DST",
                 f"step {world.step_no}: block {block} {action} while {job.kind} job {job.job_id} "
                 f"of {job.req_id} is in flight on it")


def content(world: World) -> None:
    """CONTENT — every computed block a live request holds contains exactly its prefix's bytes, on every worker,
    as computed with the current weights.

    This is the end-to-end data check: a load of the wrong tier entry, a store of the wrong GPU block, a stale
    read of a reused block, a store of a not-yet-computed slot or of a rejected draft, and a tier entry that
    outlived a weight update all surface here as wrong bytes.
    """
    for req in world.requests.values():
        if world.invalid and world.invalid.intersection(req.blocks):  # it reads a block a synchronous load failed
            continue  # to fill: the engine fails it
        for g, (table, size) in enumerate(zip(req.tables, world.block_sizes)):
            for i in range(req.num_final_tokens // size):
                if table[i] == NULL_BLOCK:  # a sliding window's block that no position reads any more
                    continue
                for worker, kv in enumerate(world.kvs):
                    _require(kv.holds(table[i], world.kv_of(world.block_hash(req.content_hashes, i, g))),
                             "CONTENT", f"step {world.step_no}, request {req.req_id}: block {table[i]} (position {i}"
                                        + (f" of group {g}" if g else "") + ") does not hold its prefix's KV"
                                        + (f" on worker {worker}" if worker else ""))


def landed(world: World, req: Request) -> None:
    """CONTENT — a load that lands inside a block of some group filled that whole block: the request resumes there
    and never writes the positions before it again, so a block the load left alone holds no KV for them.

    Prevents a hit that ends inside a block of a group with larger blocks (aligned to a smaller group's blocks
    only) whose load skips that block: the engine would attend to whatever the block held before.
    """
    done = req.load_target
    for g, (table, size) in enumerate(zip(req.tables, world.block_sizes)):
        i = done // size
        if done % size == 0 or table[i] == NULL_BLOCK:
            continue
        last = (i + 1) * size // world.config.block_size - 1  # the block's last hash, if its tokens are known
        _require(last < len(req.content_hashes), "CONTENT",
                 f"step {world.step_no}, request {req.req_id}: its load landed at token {done}, inside block "
                 f"{table[i]} of group {g}, whose tokens are not all known: nothing could have filled it")
        whole = world.kv_of(group_key(req.content_hashes[last], g))
        for worker, kv in enumerate(world.kvs):
            _require(kv.holds(table[i], whole), "CONTENT",
                     f"step {world.step_no}, request {req.req_id}: its load landed at token {done}, inside block "
                     f"{table[i]} (position {i} of group {g}), which the load did not fill"
                     + (f" on worker {worker}" if worker else ""))


def ref(world: World, obs: Observation) -> None:
    """REF — tier ref counts equal the in-flight transfers that read each entry (loads, and puts into the shared
    store); not-ready entries are exactly the keys of in-flight transfers that write one (stores, and gets).

    Prevents evicting an entry a load or a put still reads (the slot is reused, it copies another prefix) and ghost
    entries that stay not-ready forever (the tier fills up and refuses every store).
    """
    loads: Counter[int] = Counter()
    storing: set[int] = set()
    for job in world.open_jobs.values():
        for key in dict.fromkeys(key for _b, key, _s in job.copies):
            if job.kind in ("load", "put"):
                loads[key] += 1
            else:
                storing.add(key)
    for key, ready, refs in obs.tier:
        _require(refs == loads[key], "REF", f"key {key:#x}: ref count {refs}, in-flight readers {loads[key]}")
        _require(ready == (key not in storing), "REF",
                 f"key {key:#x}: ready={ready} but {'a' if key in storing else 'no'} store is in flight")
    listed = {key for key, _r, _n in obs.tier}
    _require(set(loads) <= listed and storing <= listed, "REF",
             f"jobs in flight on keys the tier does not hold: {sorted(set(loads) - listed | storing - listed)}")


def atomic(before: tuple[tuple[Key, bool, int], ...], after: tuple[tuple[Key, bool, int], ...],
           accepted: object) -> None:
    """ATOMIC — a refused ``prepare_store`` (it returned None) changes nothing: no entry evicted, added, reordered.

    Prevents a refusal for one request from evicting entries another request is about to hit, and stores that
    half-happened: entries reserved for a store that will never be submitted stay not-ready forever.
    Tier snapshots are (key, ready, refs) tuples in eviction order.
    """
    _require(accepted is not None or before == after, "ATOMIC",
             f"a refused prepare_store changed the tier\n  before: {before}\n  after:  {after}")


def cursor(world: World, obs: Observation) -> None:
    """CURSOR — a request's store cursor never passes its offload blocks that are both computed and hashed.

    Prevents keys for tokens that are not computed yet (a store would copy half-written slots), and a cursor that
    runs ahead of the block hashes (async scheduling and draft tokens schedule positions whose tokens the engine
    has not seen): the blocks it skipped are never stored. That the cursor never skips a storable block is
    checked exactly against the spec's cursor.
    """
    for req_id, at in obs.cursors.items():
        req = world.requests.get(req_id)
        if req is None or req_id in world.preempted_since_step:  # the connector hears of these next step
            continue
        hashed = len(req.block_hashes) * world.config.block_size
        done = min(req.num_computed_tokens, hashed) // world.config.offload_block_size
        _require(at <= done, "CURSOR", f"request {req_id}: cursor {at} passes its {done} computed and hashed "
                                       f"offload blocks")


def jobs(world: World) -> None:
    """JOBS — per request, one load or any number of stores in flight, never both (checked between rules and
    each time a load is submitted, since an overlap can begin and end inside one step)."""
    kinds: Counter[tuple[str, str]] = Counter((job.req_id, job.kind) for job in world.open_jobs.values()
                                              if job.kind in ("store", "load")  # puts and gets touch no GPU block
                                              and job.job_id not in world.sync_jobs)  # done before any store
    for (req_id, kind), n in kinds.items():
        _require(kind == "store" or not kinds[req_id, "store"], "JOBS",
                 f"step {world.step_no}: request {req_id} has loads and stores in flight at once")
        _require(kind == "store" or n <= 1, "JOBS", f"request {req_id} has more than one load in flight")


def finish(req: Request, delayed: bool, stores: list[Job]) -> None:
    """FINISH (safety) — ``request_finished`` delays the free while a store of the request is still in flight.

    Prevents freeing blocks that a store still reads (they are reused and the store copies another prefix). Delaying
    with nothing in flight is safe; RELEASE requires that such a free still comes, and the report counts the steps it
    waited beyond need. (A request that finishes while its load is in flight keeps its blocks anyway: the engine
    frees them when ``finished_recving`` names it, as vLLM does.)
    """
    _require(delayed or not stores, "FINISH",
             f"request {req.req_id}: request_finished returned delay=False with {len(stores)} store(s) in flight")


def completions(world: World, executor: Executor, output: WorkerOutput, load_errors: set[int]) -> None:
    """JOBS / FAIL — each worker reports each of its completions once and for a known request; a failed load is
    reported, so that the engine recomputes what it should have loaded, and nothing else is: with one KV cache
    group either its blocks as invalid or its request in ``failed_recving``; with several, its request (vLLM
    raises on invalid block ids then: a block id does not say which group's block failed).
    """
    polled = executor.last_polled
    reported = Counter(output.job_results)
    expected = Counter((job.job_id, bool(job.success)) for job in polled)
    _require(reported == expected, "JOBS",
             f"step {world.step_no}: worker reported {sorted(reported)}, transfers that completed {sorted(expected)}")
    failed = [job for job in polled if job.kind == "load" and not job.success]
    failed_req_ids = {job.req_id for job in failed}
    _require(output.failed_recving <= failed_req_ids, "FAIL",
             f"step {world.step_no}: failed_recving names {sorted(output.failed_recving - failed_req_ids)}, whose "
             f"loads did not fail")
    _require(not load_errors or len(world.groups) == 1, "FAIL",
             f"step {world.step_no}: invalid blocks {sorted(load_errors)} reported in a model of "
             f"{len(world.groups)} KV cache groups: vLLM raises RuntimeError; report the request in failed_recving")
    failed_load_blocks = {b for job in failed if job.req_id not in output.failed_recving for b in job.gpu_blocks}
    _require(load_errors == failed_load_blocks, "FAIL",
             f"step {world.step_no}: invalid blocks reported {sorted(load_errors)}, "
             f"failed loads wrote {sorted(failed_load_blocks)} (of requests not in failed_recving)")
    loaded = {job.req_id for job in polled if job.kind == "load" and job.job_id not in world.sync_jobs}
    _require(not any(job.job_id in world.sync_jobs for job in executor.jobs), "SYNC",
             f"step {world.step_no}: a synchronous load's outcome is not in the output of its step")
    _require(output.finished_recving == loaded, "JOBS",
             f"step {world.step_no}: finished_recving {sorted(output.finished_recving)}, loads done {sorted(loaded)}")
    for req_id in output.finished_sending:
        _require("sending" in world.holds.get(req_id, ()) and not executor.of(req_id), "JOBS",
                 f"step {world.step_no}: finished_sending names {req_id}, which has no delayed free pending "
                 f"or still has jobs")


def lookup(world: World, req: Request, num_local: int, num_external: int | None, is_async: bool) -> None:
    """LOOKUP — a hit lies within the request's tokens. (A hit of the whole prompt is allowed if it loads
    asynchronously: the engine recomputes the last token to sample the next, as vLLM 0.32 does. None is "ask me
    again next step": vLLM's answer while a request still has transfers in flight.)

    A synchronous hit (loaded before the forward pass of the step that computes the rest) only under the "fail"
    policy, without async scheduling, with one KV cache group of attention, and with a token left to compute. vLLM
    caches a synchronous load's blocks as it schedules them, and evicts them when a load fails only by way of the
    requests it fails (``tests/vllm/test_sync_loads.py``): under "recompute" it fails none, and under async
    scheduling the request may have been aborted or preempted before the output arrives; either way the invalid
    blocks stay cached for the next request to read. With several groups vLLM cannot be told which blocks failed.
    vLLM asserts that a synchronous hit leaves a token to compute."""
    if num_external is None:
        return
    _require(num_external >= 0 and num_local + num_external <= req.num_tokens, "LOOKUP",
             f"request {req.req_id}: {num_local} local + {num_external} external hit tokens of {req.num_tokens}")
    if num_external == 0 or is_async:
        return
    groups, policy = world.config.groups, world.config.load_failure_policy
    _require(policy == "fail", "LOOKUP", f"request {req.req_id}: a synchronous hit under the {policy!r} policy: one "
             f"that fails leaves its blocks in vLLM's prefix cache for other requests to read")
    _require(not world.config.async_scheduling, "LOOKUP", f"request {req.req_id}: a synchronous hit under async "
             f"scheduling: one that fails outlives its request in vLLM's prefix cache if the request is aborted or "
             f"preempted before the step's output arrives")
    _require(len(groups) == 1 and not groups[0].state, "LOOKUP", f"request {req.req_id}: a synchronous hit in a "
             f"model of {len(groups)} KV cache groups or with recurrent state: vLLM cannot be told which blocks failed")
    _require(num_local + num_external < req.num_tokens, "LOOKUP", f"request {req.req_id}: a synchronous hit of "
             f"every token ({num_local} local + {num_external}): vLLM schedules it with none to compute and asserts")


def waited(world: World, job: Job) -> None:
    """SYNC — a synchronous load ran on every worker before the forward pass that reads it, and its outcome is
    reported in that step's output (vLLM fails the requests that read a block it failed to fill as that output
    arrives)."""
    _require(job.executed and job.reported, "SYNC", f"step {world.step_no}: synchronous load job {job.job_id} of "
             f"{job.req_id} still in flight when the forward pass reads it (a worker waits for it in start_load_kv)")


def release(world: World) -> None:
    """RELEASE (liveness) — every delayed free is released once its stores completed: after draining, the workers
    have named every delayed request in ``finished_sending``.

    Prevents blocks that are never returned to the engine: a connector that delays a free and never reports it
    shrinks the GPU pool by those blocks for good.
    """
    _require(not world.delayed, "RELEASE",
             f"step {world.step_no}: delayed frees of {sorted(world.delayed)} never released, with no transfer "
             f"left in flight")
    held = world.pinned() if world.pins and not world.open_jobs else {}  # with jobs open, QUIESCE says which
    _require(not held, "RELEASE", f"step {world.step_no}: the connector still holds GPU blocks {sorted(held)} after "
                                  f"draining, with no transfer left in flight: the engine lost them for good")


def pins(world: World) -> None:
    """REF — a connector that holds GPU blocks itself (PINS) frees only what it holds.

    Prevents a block going back to the free queue while a request still holds it: it would be reused under the
    request, and its KV overwritten by another prefix's.
    """
    freed = sorted(b for b, n in world.pinned().items() if n < 0)
    _require(not freed, "REF", f"step {world.step_no}: the connector freed GPU blocks {freed}, which it did not hold")


def quiesce(world: World, obs: Observation | None) -> None:
    """QUIESCE (liveness) — once every request finished and every transfer drained, nothing is left behind.

    Prevents leaks that only show after hours: per-request state never dropped, entries pinned forever, blocks
    never returned to the engine.
    """
    leftovers: Iterable[str] = (
        *(f"request {r}" for r in world.requests),
        *(f"job {j.job_id}" for j in world.open_jobs.values()),
        *(f"job {j.job_id} on a worker" for j in world.in_flight()),
        *(["an undelivered step output"] if world.undelivered else []),
        *(f"GPU block {b} still referenced" for b, n in enumerate(world.pool.refs) if n),
    )
    if obs is not None:
        leftovers = (*leftovers, *(f"tracked {r}" for r, t in obs.tracked.items() if t),
                     *(f"cursor of {r}" for r in obs.cursors), *(f"job {j}" for j in obs.jobs),
                     *(f"key {k:#x} ready={ready} refs={n}" for k, ready, n in obs.tier if not ready or n))
    leftovers = list(leftovers)
    _require(not leftovers, "QUIESCE", "left after draining: " + ", ".join(leftovers))


def capacity(store: Store) -> None:
    """CAPACITY — the store never holds more records than its budget, summed over every namespace and replica.

    Prevents a shared tier that grows until its disk is full (vLLM's fs tier has no bound; LMCache's local disk
    overran its cap): a budget counted per replica, not per store, lets N replicas fill N times it.
    """
    _require(len(store.records) <= store.capacity, "CAPACITY",
             f"the store holds {len(store.records)} records, over its budget of {store.capacity}")


def keep(store: Store) -> None:
    """KEEP — no connector deletes a record: an error, a miss, a timeout is the reader's problem, and only the store
    quarantines a record that failed its checks.

    Prevents a transient error (EMFILE, EIO, a timeout) on one replica from deleting records every other replica
    shares: vLLM's fs tier deletes the file on any load exception.
    """
    _require(not store.counters["deleted"], "KEEP",
             f"a connector deleted {store.counters['deleted']} record(s) of the shared store")


def namespace(world: World, rank: int, opened: Namespace) -> None:
    """NAMESPACE — a connector opens the shared store only as an identity its engine was told: its model and
    configuration as they are, weights it held at some time since it started (records are put in the namespace of
    the weights that computed them), its own shard.

    Prevents an identity derived from partial evidence: a checkpoint known by its path, names and sizes (a fine-tune
    redeployed in place is served the old one's records), the weights without the model's configuration, an epoch
    that counts resets (two replicas, one update in each, on other weights, share). CONTENT sees such a bug only
    once another engine's record is served; this sees it at the first ask.
    """
    told = sorted(f"{ns.model}/{ns.weights}" for ns in world.held if ns.tp_rank == rank)
    _require(opened.tp_rank == rank and opened in world.held, "NAMESPACE",
             f"step {world.step_no}: worker {rank} opened the store as {opened!r}, an identity it was never told "
             f"(told, as model/weights: {', '.join(told)})")


def asked(world: World, namespace: Namespace) -> None:
    """NAMESPACE — a lookup asks the store only as the identity the engine was last told, and never between a reset
    and the next time it is told (the weights may have changed).

    Prevents a connector that keeps an identity it no longer has: one attached at its first lookup with the
    identity it started with (an RL loop updates the weights before the first request), one whose reset clears
    the tier but keeps the namespace (vLLM's ``reset_cache`` leaves its secondary tiers alone).
    """
    now = world.namespace(0)
    _require(not world.unidentified and namespace == now, "NAMESPACE",
             f"step {world.step_no}: a lookup asked the store as {namespace.model}/{namespace.weights}, "
             + ("after a reset, before the engine was told who it is" if world.unidentified else
                f"while the engine is {now.model}/{now.weights}"))


def write_once(world: World, job: Job) -> None:
    """WRITE-ONCE — a record comes into the store once: a connector puts what it computed (what a store brought
    from the GPU into its tier), never what a get brought from the store.

    Prevents write amplification: a replica that writes back every record it read doubles the store's writes, and
    wears the disk out, for nothing.
    """
    again = sorted({key for _b, key, _s in job.copies} & world.got)
    _require(not again, "WRITE-ONCE", f"step {world.step_no}: put job {job.job_id} writes back keys "
                                      f"{', '.join(f'{k:#x}' for k in again)}, which a get brought from the store")


def progress(world: World, bound: int) -> None:
    """PROGRESS (liveness) — once no new requests arrive, every live request finishes within ``bound`` engine steps.

    Prevents livelock: a tier entry whose load keeps failing, offered again after every recompute, makes a lone
    request load, fail and recompute forever under ``kv_load_failure_policy="recompute"``.
    """
    _require(not world.requests, "PROGRESS",
             f"step {world.step_no}: requests {sorted(world.requests)} still unfinished after {bound} steps")
