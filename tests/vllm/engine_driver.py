"""vLLM's real scheduler driven the way vLLM's engine core drives it on GPUs (DESIGN 6.1), without a model.

* **Async scheduling**: vLLM's ``AsyncScheduler`` behind a batch queue of depth 2, as ``step_with_batch_queue``
  runs it: step N+1 is scheduled before step N's output is applied, so ``num_computed_tokens`` counts output
  placeholders and a request's block hashes lag behind its scheduled tokens. Sync mode is ``Scheduler`` with a
  queue of depth 1 (``step``).
* **Speculative decoding**: an ngram ``SpeculativeConfig`` with k draft tokens. In sync mode the drafts are
  proposed after each step (``update_draft_token_ids``, as ``post_step`` does); in async mode the scheduler
  schedules placeholders itself. Each request accepts a random number of drafts, so it samples 1..k+1 tokens.
* **Tensor parallelism**: N worker-role instances of ``KVOffloadConnector``, each on its own CPU KV cache and
  behind its own transfer executor (the environment delays, reorders and fails each worker's transfers
  independently). Their ``ModelRunnerOutput`` are merged by vLLM's own ``KVOutputAggregator``.
* **Weight updates**: ``reset_prefix_cache(reset_connector=True)`` mid-run.
* **Hybrid models**: ``groups`` gives the KV cache groups (full attention, sliding windows, blocks of several
  sizes); vLLM's ``HybridKVCacheCoordinator`` then frees a window's old blocks while requests run.
* **The model runner's call order**: each worker's connector calls come from vLLM's own model-runner code
  (``KVConnectorModelRunnerMixin._get_kv_connector_output``) around a stand-in forward pass, which writes
  content-addressed bytes into the blocks it computes; copies run late, when the environment says, as on a GPU's
  copy stream. With ``check_bytes`` every store must read, and every load must bring back, its key's bytes.

Everything vLLM-side is vLLM's real class: ``Request`` with a block hasher, ``SchedulerOutput`` from the
scheduler, ``ModelRunnerOutput``, ``KVConnectorOutput``, ``DraftTokenIds``. The shadow monitor checks the scheduler
side every step.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

from attrs import define

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from kvoffload.impl.testing import LayeredKV  # noqa: E402
from kvoffload.impl.vllm import KVOffloadConnector  # noqa: E402
from kvoffload.impl.testing.harness import BLOCK_SIZE, make_scheduler  # noqa: E402
from kvoffload.spec.executor import Executor  # noqa: E402
from kvoffload.spec.groups import FULL_ATTENTION, Group  # noqa: E402
from kvoffload.spec.types import group_key  # noqa: E402

VOCAB = 512
PARTIAL = 1  # the bytes of a block whose tokens are not all computed yet


def content(key: Any) -> int:
    """The bytes a block holds once computed, from its tier key (vLLM's chained block hash, and its group)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=6).digest(), "little")


@define
class CheckedExecutor(Executor):
    """The world's executor (a copy runs when the environment says, as on a GPU's copy stream); with ``checking``,
    it checks the bytes every store reads as it runs and every load brings back: its key's content (one GPU block
    per offload block)."""

    checking: bool = False
    checked: int = 0  # copies checked

    def execute(self, job: Any, fail: bool = False) -> None:
        if self.checking and job.kind == "store" and not (fail or self.fail_next):
            self.check(job, "store read")
        super().execute(job, fail)
        if self.checking and job.kind == "load" and job.success:
            self.check(job, "load brought back")

    def check(self, job: Any, what: str) -> None:
        self.checked += len(job.copies)
        for block, key, _sub in job.copies:
            assert self.kv.holds(block, content(key)), f"{job.kind} job {job.job_id} of {job.req_id}: {what} " \
                f"other bytes than its key's in GPU block {block}"


class Worker:
    """One worker: our connector's worker side on its own KV cache, its transfers timed by the environment."""

    def __init__(self, scheduler: Any, rnd: random.Random, delay: int, failures: float, reorder: bool,
                 connector_class: type = KVOffloadConnector, check_bytes: bool = False) -> None:
        self.rnd, self.failures, self.reorder = rnd, failures, reorder
        self.vllm_config = scheduler.vllm_config
        self.connector = connector_class(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config)
        self.kv = LayeredKV(scheduler.kv_cache_config.num_blocks, shape="fused", block_size=BLOCK_SIZE)
        self.connector.register_kv_caches(self.kv.caches)
        # The environment, not a thread, decides when this worker's copies run, complete or fail.
        self.executor = self.connector.offload.executor = CheckedExecutor(delay=delay, kv=self.kv,
                                                                          checking=check_bytes)
        self.failed = 0  # transfers this worker failed

    def execute(self, scheduler_output: Any, forward: Callable[[LayeredKV], None]) -> KVConnectorOutput:
        """One forward pass, with vLLM's own model-runner code around it: ``execute_model`` calls
        ``handle_preemptions`` before the pass (``tests/vllm/test_call_order.py`` reads that from vLLM), then the
        runner's context manager binds the metadata, starts the loads after the pass (ours are all asynchronous),
        waits for the saves and collects the results. Meanwhile the environment moves this worker's copies on."""
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector  # as a worker process registers its connector
        try:
            self.connector.handle_preemptions(scheduler_output.kv_connector_metadata)
            with (set_forward_context(None, self.vllm_config),
                  KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as output):
                forward(self.kv)
                self.move_transfers()  # the copy stream runs on after the pass wrote the step's KV
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        return output

    def move_transfers(self) -> None:
        """Execute, fail or release a few of this worker's jobs, in its own order (if it reorders at all); then a
        step passes, and jobs ``delay`` steps old complete."""
        for _ in range(self.rnd.randrange(3) if self.reorder else 0):
            if self.executor.jobs:
                fail = self.rnd.random() < self.failures
                self.failed += fail
                self.executor.advance(self.rnd.randrange(64), fail)
        self.executor.tick()


class Engine:
    """The engine core's loop over a real scheduler and ``workers`` workers."""

    def __init__(self, model: Path, seed: int, *, async_scheduling: bool = False, spec_tokens: int = 0,
                 workers: int = 1, num_blocks: int = 48, tier_bytes: int = 512 << 10, delay: int = 2,
                 failures: float = 0.2, reorder: bool = True, groups: tuple[Group, ...] = FULL_ATTENTION,
                 worker_class: type = KVOffloadConnector) -> None:
        self.rnd = random.Random(seed)
        self.scheduler = make_scheduler(model, num_blocks, "KVOffloadConnector", "kvoffload.impl.vllm_connector",
                                        {"tier_bytes": tier_bytes, "verify": True}, async_scheduling=async_scheduling,
                                        num_spec_tokens=spec_tokens, world_size=workers, log_stats=True,
                                        groups=groups)
        self.connector = self.scheduler.connector
        # The bytes are defined where every computed block has its hash when the pass writes it (no placeholders,
        # no drafts) and one GPU block is one offload block: there each copy is checked against its key.
        self.check_bytes = not async_scheduling and not spec_tokens and self.connector.config.k == 1 and all(
            size == self.scheduler.hash_block_size for size in self.connector.config.block_sizes)
        self.workers = [Worker(self.scheduler, random.Random(self.rnd.random()), delay, failures, reorder,
                               worker_class, self.check_bytes) for _ in range(workers)]
        self.aggregator = KVOutputAggregator.from_connector(self.connector, workers)
        self.depth = 2 if async_scheduling else 1  # vLLM's max_concurrent_batches
        self.async_scheduling, self.spec_tokens = async_scheduling, spec_tokens
        self.batches: deque[tuple[Any, ModelRunnerOutput]] = deque()  # scheduled and executed, output not applied
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.scheduler.hash_block_size, sha256)  # as the engine core hashes
        self.systems = [[self.rnd.randrange(VOCAB) for _ in range(BLOCK_SIZE * self.rnd.randrange(2, 6))]
                        for _ in range(3)]
        self.next_id = 0
        self.counts: Counter[str] = Counter()  # what the run went through (steps, drafts, resets, engine hits)

    # ---- requests ----
    def add_request(self, prompt: list[int] | None = None, max_tokens: int | None = None) -> str:
        if prompt is None:
            prompt = self.rnd.choice(self.systems) + [self.rnd.randrange(VOCAB)
                                                      for _ in range(self.rnd.randrange(1, 20))]
        params = SamplingParams(max_tokens=max_tokens or self.rnd.randrange(1, 24), temperature=0)
        req_id, self.next_id = f"req-{self.next_id}", self.next_id + 1
        self.scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=self.hasher))
        return req_id

    # ---- the engine core ----
    def step(self) -> None:
        """``step`` (sync) or ``step_with_batch_queue`` (async): schedule and execute a batch; apply the oldest
        batch's output once the queue is full, or once nothing is left to schedule."""
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            self.batches.appendleft((scheduler_output, self.execute(scheduler_output)))
            self.counts["steps"] += 1
            if len(self.batches) < self.depth:
                return
        if self.batches:
            self.apply(*self.batches.pop())

    def execute(self, scheduler_output: Any) -> ModelRunnerOutput:
        """Every worker runs the batch; vLLM's aggregator merges their outputs into rank 0's."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [self.sample(scheduler_output, req_id) for req_id in req_ids]
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        writes = self.computed_blocks(scheduler_output)

        def forward(kv: LayeredKV) -> None:
            for block, bytes_ in writes:
                kv.write(block, bytes_)
        outputs = [ModelRunnerOutput(req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled,
                                     kv_connector_output=worker.execute(scheduler_output, forward))
                   for worker in self.workers]
        return self.aggregator.aggregate(outputs)

    def computed_blocks(self, scheduler_output: Any) -> list[tuple[int, int]]:
        """What the forward pass writes: every block holding a scheduled position, in every group, gets its key's
        bytes if its last token is computed now (and hashed), else bytes that no key has."""
        writes = []
        hash_size = self.scheduler.hash_block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # the scheduler advanced it past the scheduled tokens
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for g, (table, size) in enumerate(zip(tables, self.connector.config.block_sizes)):
                for i in range((end - n) // size, -(-end // size)):
                    last = (i + 1) * size // hash_size - 1  # the block's last hash
                    full = (i + 1) * size <= end and last < len(request.block_hashes)
                    writes.append((table[i], content(group_key(request.block_hashes[last], g)) if full else PARTIAL))
        return writes

    def sample(self, scheduler_output: Any, req_id: str) -> list[int]:
        """Tokens sampled for a request: none for a prefill chunk, else its accepted drafts (a random number of
        them; async drafts are placeholders, so their values are drawn here) and one more."""
        if self.scheduler.requests[req_id].is_prefill_chunk:
            return []
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
        accepted = self.rnd.randint(0, len(drafts))
        self.counts["drafts"] += len(drafts)
        self.counts["rejected_drafts"] += len(drafts) - accepted
        return [t if t >= 0 else self.rnd.randrange(VOCAB) for t in drafts[:accepted]] + [self.rnd.randrange(VOCAB)]

    def apply(self, scheduler_output: Any, output: ModelRunnerOutput) -> None:
        engine_outputs = self.scheduler.update_from_output(scheduler_output, output)
        for engine_output in engine_outputs.values():
            stats = engine_output.scheduler_stats and engine_output.scheduler_stats.connector_prefix_cache_stats
            if stats:  # what vLLM itself admitted from the connector
                self.counts["engine_connector_hits"] += stats.hits + stats.preempted_hits
        if self.spec_tokens and not self.async_scheduling:
            self.propose_drafts(scheduler_output)

    def propose_drafts(self, scheduler_output: Any) -> None:
        """Sync mode's ``post_step``: the ngram proposer's drafts (0..k tokens) for every decoding request."""
        req_ids, drafts = [], []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING and not request.is_prefill_chunk:
                req_ids.append(req_id)
                drafts.append([self.rnd.randrange(VOCAB) for _ in range(self.rnd.randint(0, self.spec_tokens))])
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    # ---- the environment ----
    def weight_update(self) -> None:
        """An RL loop's weight update: every running request preempted, the GPU prefix cache and the connector's
        tier dropped. vLLM refuses the preemption while a load holds blocks; the caches are reset anyway."""
        self.apply_batches_in_flight()
        try:
            self.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        except RuntimeError:
            self.scheduler.reset_prefix_cache(reset_connector=True)
        self.counts["weight_updates"] += 1

    def drop_gpu_cache(self) -> None:
        """Preempt everyone and drop the GPU prefix cache (the tier stays): the next hits come from the tier.
        vLLM refuses while a load holds blocks (later then)."""
        self.apply_batches_in_flight()
        try:
            self.scheduler.reset_prefix_cache(reset_running_requests=True)
        except RuntimeError:
            pass

    def apply_batches_in_flight(self) -> None:
        """Before a cache reset: vLLM 0.33 refuses one while a preempted request's batch is still in flight (its
        blocks are held until then), so the batches in flight are applied first, as an engine idle enough to take
        the call has applied them. (vLLM 0.32 freed them at once; there, this changes only the order.)"""
        while self.batches:
            self.apply(*self.batches.pop())

    def refuse_next_store(self) -> None:
        """The tier's allocator refuses one live request's next store (in the connector and its shadow alike)."""
        if self.scheduler.requests:
            req_id = self.rnd.choice(sorted(self.scheduler.requests))
            self.connector.offload.refuse_next_store(req_id)
            self.connector.shadow.spec.refuse_next_store(req_id)

    def run(self, steps: int, weight_updates: float = 0.01) -> None:
        for _ in range(steps):
            if self.rnd.random() < 0.5 and len(self.scheduler.requests) < 12:
                self.add_request()
            if self.rnd.random() < 0.04 and self.scheduler.requests:
                self.scheduler.finish_requests(self.rnd.choice(list(self.scheduler.requests)),
                                               RequestStatus.FINISHED_ABORTED)
            if self.rnd.random() < 0.05:
                self.drop_gpu_cache()
            if self.rnd.random() < weight_updates:
                self.weight_update()
            if self.rnd.random() < 0.1:
                self.refuse_next_store()
            self.step()

    def in_flight(self) -> bool:
        return bool(self.scheduler.requests or self.batches or any(w.executor.jobs for w in self.workers))

    def drain(self, max_steps: int = 60) -> None:
        """Abort everything and let every transfer land and every batch's output be applied."""
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        for _ in range(max_steps):
            if not self.in_flight():
                return
            if not (self.scheduler.has_requests() or self.batches):  # vLLM's engine would idle: nobody polls them
                raise AssertionError("transfers in flight, but the engine has no request left to step for")
            for worker in self.workers:
                worker.executor.drain()
            self.step()
        raise AssertionError(f"not drained after {max_steps} steps: {list(self.scheduler.requests)}")

    def figures(self) -> dict[str, Any]:
        stats = self.connector.stats()
        return {**{key: stats[key] for key in ("lookups", "hit_tokens", "stored_blocks", "loaded_blocks",
                                                "failed_stores", "failed_loads", "alloc_failures")},
                **self.counts, "worker_failures": [w.failed for w in self.workers], "shadow": stats["shadow"],
                "bytes_checked": sum(w.executor.checked for w in self.workers)}
