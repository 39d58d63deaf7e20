"""Scheduler-side cost of our connector vs vLLM 0.32's own OffloadingConnector (its real CPU manager), each
driven by vLLM's real Scheduler (no model) through the same prefix-heavy workload, in this process. Only the time
spent inside each connector's scheduler-side methods counts; transfers complete at once (their worker side is not
needed). Last line: ``sched_ratio_vs_vllm=<ours/theirs>`` at 256 live requests.

    python bench/sched_vs_vllm.py [--live 64 256 1024] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvoffload.impl import OffloadConnector  # noqa: E402
from kvoffload.impl.testing import LayeredKV  # noqa: E402
from kvoffload.impl.vllm_connector import KVOffloadWorkerMetadata  # noqa: E402
from kvoffload.impl.testing.demo import build_tiny_llama  # noqa: E402
from kvoffload.impl.testing.harness import BLOCK_SIZE, make_scheduler  # noqa: E402
from kvoffload.spec.executor import Executor  # noqa: E402

TIMED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "take_events")


class Timed:
    """Wraps a connector's scheduler-side methods and adds up the seconds spent inside them."""

    def __init__(self, connector) -> None:
        self.seconds, self.on = 0.0, False
        for name in TIMED:
            setattr(connector, name, self._wrap(getattr(connector, name), name == "take_events"))

    def _wrap(self, method, drains: bool):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = list(method(*args, **kwargs)) if drains else method(*args, **kwargs)
            if self.on:
                self.seconds += time.perf_counter() - start
            return result
        return timed


def ours_worker(scheduler):
    worker = OffloadConnector(scheduler.connector.config)
    executor = Executor(delay=0)
    worker.register_kv_caches(LayeredKV(scheduler.connector.config.num_gpu_blocks, shape="fused"), executor)

    def complete(so):
        meta = so.kv_connector_metadata
        worker.handle_preemptions(meta.plan)
        worker.start_load_kv(meta.plan)
        worker.wait_for_save(meta.plan)
        done = worker.get_finished(frozenset(so.finished_req_ids))
        return KVConnectorOutput(finished_sending=set(done.finished_sending) or None,
                                 finished_recving=set(done.finished_recving) or None,
                                 kv_connector_worker_meta=KVOffloadWorkerMetadata(done.job_results))
    return complete


def theirs_worker(scheduler):
    def complete(so):
        meta = so.kv_connector_metadata
        jobs = {**meta.load_jobs, **meta.store_jobs}
        return KVConnectorOutput(finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
                                 kv_connector_worker_meta=OffloadingWorkerMetadata({job_id: 1 for job_id in jobs}))
    return complete


def run(model: Path, ours: bool, live: int, steps: int, seed: int = 0) -> tuple[float, int]:
    tier_bytes = live * 64 * 16 * 1024  # room for 64 blocks of 16 KiB per live request
    if ours:
        scheduler = make_scheduler(model, live * 24, "KVOffloadConnector", "kvoffload.impl.vllm_connector",
                                   {"tier_bytes": tier_bytes}, max_num_seqs=live, max_num_batched_tokens=live + 2048)
    else:
        scheduler = make_scheduler(model, live * 24, "OffloadingConnector", None, {"cpu_bytes_to_use": tier_bytes},
                                   max_num_seqs=live, max_num_batched_tokens=live + 2048)
    complete = (ours_worker if ours else theirs_worker)(scheduler)
    timer = Timed(scheduler.connector)
    rnd = random.Random(seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    systems = [[rnd.randrange(512) for _ in range(BLOCK_SIZE * rnd.randrange(4, 12))] for _ in range(8)]
    next_id = 0
    for step in range(steps * 3):
        timer.on = step >= steps * 2  # warm up until the batch is mostly decodes
        while len(scheduler.requests) < live:
            prompt = rnd.choice(systems) + [rnd.randrange(512) for _ in range(rnd.randrange(1, 48))]
            scheduler.add_request(Request(f"req-{next_id}", prompt, SamplingParams(max_tokens=rnd.randrange(32, 128)),
                                          None, block_hasher=hasher))
            next_id += 1
        so = scheduler.schedule()
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sampled = [[rnd.randrange(512)] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
                   else [] for r in req_ids]
        scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=complete(so)))
    return timer.seconds, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="scheduler-side cost, ours vs vLLM's OffloadingConnector")
    parser.add_argument("--live", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/tiny-llama"))
    args = parser.parse_args(argv)
    model = build_tiny_llama(args.model_dir)
    ratios = {}
    print(f"{'live':>6} {'ours µs/step':>13} {'vLLM µs/step':>13} {'ours/vLLM':>10}")
    for live in args.live:
        print(f"  {live} live requests...", file=sys.stderr, flush=True)
        ours, steps = run(model, True, live, args.steps)
        theirs, _ = run(model, False, live, args.steps)
        ratios[live] = ours / theirs
        print(f"{live:>6} {ours / steps * 1e6:>13.1f} {theirs / steps * 1e6:>13.1f} {ratios[live]:>10.3f}", flush=True)
    for live, ratio in ratios.items():
        print(f"sched_ratio_vs_vllm_{live}={ratio:.3f}")
    print(f"sched_ratio_vs_vllm={ratios.get(256, next(iter(ratios.values()))):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
