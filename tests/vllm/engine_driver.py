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

Everything vLLM-side is vLLM's real class: ``Request`` with a block hasher, ``SchedulerOutput`` from the
scheduler, ``ModelRunnerOutput``, ``KVConnectorOutput``, ``DraftTokenIds``. The shadow monitor checks the scheduler
side every step.
"""

from __future__ import annotations

import os
import random
from collections import Counter, deque
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvoffload.impl.testing import LayeredKV  # noqa: E402
from kvoffload.impl.vllm_connector import KVOffloadConnector  # noqa: E402
from kvoffload.impl.testing.harness import BLOCK_SIZE, make_scheduler  # noqa: E402
from kvoffload.spec.groups import FULL_ATTENTION, Group  # noqa: E402
from kvoffload.spec.world import Executor  # noqa: E402

VOCAB = 512


class Worker:
    """One worker: our connector's worker side on its own KV cache, its transfers timed by the environment."""

    def __init__(self, scheduler: Any, rnd: random.Random, delay: int, failures: float, reorder: bool) -> None:
        self.rnd, self.failures, self.reorder = rnd, failures, reorder
        self.connector = KVOffloadConnector(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config)
        kv = LayeredKV(scheduler.kv_cache_config.num_blocks, shape="fused", block_size=BLOCK_SIZE)
        self.connector.register_kv_caches(kv.caches)
        # The environment, not a thread, decides when this worker's copies run, complete or fail.
        self.executor = self.connector.offload.executor = Executor(delay=delay)
        self.failed = 0  # transfers this worker failed

    def execute(self, scheduler_output: Any) -> KVConnectorOutput:
        """The connector calls of one forward pass, in the model runner's order."""
        connector, metadata = self.connector, scheduler_output.kv_connector_metadata
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv(None)
        connector.wait_for_save()
        self.move_transfers()
        results = connector.get_transfer_results(scheduler_output.finished_req_ids)
        output = KVConnectorOutput(finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=connector.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.clear_connector_metadata()
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
                 failures: float = 0.2, reorder: bool = True, groups: tuple[Group, ...] = FULL_ATTENTION) -> None:
        self.rnd = random.Random(seed)
        self.scheduler = make_scheduler(model, num_blocks, "KVOffloadConnector", "kvoffload.impl.vllm_connector",
                                        {"tier_bytes": tier_bytes, "verify": True}, async_scheduling=async_scheduling,
                                        num_spec_tokens=spec_tokens, world_size=workers, log_stats=True,
                                        groups=groups)
        self.connector = self.scheduler.connector
        self.workers = [Worker(self.scheduler, random.Random(self.rnd.random()), delay, failures, reorder)
                        for _ in range(workers)]
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
        outputs = [ModelRunnerOutput(req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled,
                                     kv_connector_output=worker.execute(scheduler_output))
                   for worker in self.workers]
        return self.aggregator.aggregate(outputs)

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
                **self.counts, "worker_failures": [w.failed for w in self.workers], "shadow": stats["shadow"]}
