"""vLLM's real Scheduler (no model) with our connector on its scheduler side, and our production worker side on
CPU tensors behind a transfer executor that delays, reorders and fails transfers. Real ``Request``,
``SchedulerOutput`` and ``ModelRunnerOutput`` objects; the shadow spec monitor checks every step."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvoffload.impl import OffloadConnector  # noqa: E402
from kvoffload.impl.testing import LayeredKV  # noqa: E402
from kvoffload.impl.testing.harness import BLOCK_SIZE, make_scheduler  # noqa: E402
from kvoffload.impl.vllm.connector import KVOffloadWorkerMetadata  # noqa: E402
from kvoffload.spec.executor import Executor  # noqa: E402

class Driver:
    """One engine: the real scheduler, our worker side, and an environment that decides transfer timing."""

    def __init__(self, model: Path, seed: int, num_blocks: int = 48, tier_bytes: int = 96 << 10,
                 delay: int = 2, failures: bool = True,
                 kv_load_failure_policy: Literal["recompute", "fail"] = "recompute") -> None:
        self.rnd, self.failures = random.Random(seed), failures
        self.scheduler = make_scheduler(model, num_blocks, "KVOffloadConnector", "kvoffload.impl.vllm_connector",
                                        {"tier_bytes": tier_bytes, "verify": True},
                                        kv_load_failure_policy=kv_load_failure_policy)
        self.connector = self.scheduler.connector
        self.worker = OffloadConnector(self.connector.config)
        self.executor = Executor(delay=delay)
        self.worker.register_kv_caches(LayeredKV(num_blocks, shape="fused", block_size=BLOCK_SIZE), self.executor)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.systems = [[self.rnd.randrange(512) for _ in range(BLOCK_SIZE * self.rnd.randrange(2, 6))]
                        for _ in range(3)]
        self.next_id = self.steps = 0
        self.failed_requests = 0  # ended with an error: their load failed under the "fail" policy

    def add_request(self) -> None:
        prompt = self.rnd.choice(self.systems) + [self.rnd.randrange(512) for _ in range(self.rnd.randrange(1, 20))]
        params = SamplingParams(max_tokens=self.rnd.randrange(1, 24), temperature=0)
        self.scheduler.add_request(Request(f"req-{self.next_id}", prompt, params, None, block_hasher=self.hasher))
        self.next_id += 1

    def step(self) -> None:
        if self.rnd.random() < 0.15 and self.scheduler.requests:  # the tier refuses one request's next store
            req_id = self.rnd.choice(sorted(self.scheduler.requests))  # (in the connector and its shadow alike)
            self.connector.offload.refuse_next_store(req_id)
            self.connector.shadow.spec.refuse_next_store(req_id)
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.worker.handle_preemptions(meta.plan)
        self.worker.start_load_kv(meta.plan)
        self.worker.wait_for_save(meta.plan)
        for _ in range(self.rnd.randrange(3)):  # the environment moves transfers on in its own order
            if self.executor.jobs:
                self.executor.advance(self.rnd.randrange(64), self.failures and self.rnd.random() < 0.3)
        self.executor.tick()
        done = self.worker.get_finished(frozenset(so.finished_req_ids))
        kv_output = KVConnectorOutput(finished_sending=set(done.finished_sending) or None,
                                      finished_recving=set(done.finished_recving) or None,
                                      kv_connector_worker_meta=KVOffloadWorkerMetadata(done.job_results),
                                      invalid_block_ids=self.worker.get_block_ids_with_load_errors())
        delivered = self.scheduler.update_from_output(so, self.model_output(so, kv_output))
        self.failed_requests += sum(o.finish_reason == FinishReason.ERROR for out in delivered.values()
                                    for o in out.outputs)
        self.steps += 1

    def model_output(self, so: Any, kv_output: KVConnectorOutput) -> ModelRunnerOutput:
        """One sampled token for every request whose known tokens are all computed after this step."""
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            sampled.append([self.rnd.randrange(512)] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_output)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.rnd.random() < 0.5 and len(self.scheduler.requests) < 12:
                self.add_request()
            if self.rnd.random() < 0.05 and self.scheduler.requests:  # abort someone
                self.scheduler.finish_requests(self.rnd.choice(list(self.scheduler.requests)),
                                               RequestStatus.FINISHED_ABORTED)
            if self.rnd.random() < 0.05:  # preempt everyone and drop the GPU prefix cache: hits come from the tier
                try:
                    self.scheduler.reset_prefix_cache(reset_running_requests=True)
                except RuntimeError:  # vLLM refuses while a load or a delayed free holds blocks; later then
                    pass
            self.step()

    def drain(self, max_steps: int = 50) -> None:
        """Abort everything and let every transfer land."""
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        for _ in range(max_steps):
            if not (self.scheduler.requests or self.executor.jobs):
                return
            self.executor.drain()
            self.step()
