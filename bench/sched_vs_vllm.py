"""Scheduler-side cost of our connector vs vLLM 0.32's own OffloadingConnector (its real CPU manager), each
driven by vLLM's real Scheduler (no model) through the same prefix-heavy workload, in this process. Only the time
spent inside each connector's scheduler-side methods counts; transfers complete at once (their worker side is not
needed). The two run side by side, a step each in turn. Last line: ``sched_ratio_vs_vllm=<ours/theirs>``, the worse
of the ratios at 256 and 1024 live requests.

    python bench/sched_vs_vllm.py [--live 64 256 1024] [--steps 60] [--groups 512,full]

``--groups`` runs a hybrid model instead (KV cache groups as ``str(Group)`` writes them), whose tables vLLM's hybrid
KV cache manager keeps one per group.
"""

from __future__ import annotations

import argparse
import gc
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
from kvoffload.impl.vllm.connector import KVOffloadWorkerMetadata  # noqa: E402
from kvoffload.impl.testing.demo import build_tiny_llama  # noqa: E402
from kvoffload.impl.testing.harness import BLOCK_SIZE, make_scheduler  # noqa: E402
from kvoffload.spec.executor import Executor  # noqa: E402
from kvoffload.spec.groups import FULL_ATTENTION, Group, parse_groups  # noqa: E402

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


class Run:
    """One connector behind vLLM's real Scheduler, fed the workload a step at a time (``step``), so that two runs
    can take turns: a machine that slows down then slows both alike."""

    def __init__(self, model: Path, ours: bool, live: int, steps: int, groups: tuple[Group, ...],
                 seed: int = 0) -> None:
        tier_bytes = live * 64 * 16 * 1024 * len(groups)  # room for 64 blocks of 16 KiB per live request and group
        connector, module, extra = (("KVOffloadConnector", "kvoffload.impl.vllm_connector", {"tier_bytes": tier_bytes})
                                    if ours else ("OffloadingConnector", None, {"cpu_bytes_to_use": tier_bytes}))
        self.scheduler = make_scheduler(model, live * 24 * len(groups), connector, module, extra, max_num_seqs=live,
                                        max_num_batched_tokens=live + 2048, groups=groups)
        self.complete = (ours_worker if ours else theirs_worker)(self.scheduler)
        self.timer = Timed(self.scheduler.connector)
        self.live, self.steps, self.step_no, self.next_id = live, steps, 0, 0
        self.rnd = random.Random(seed)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.systems = [[self.rnd.randrange(512) for _ in range(BLOCK_SIZE * self.rnd.randrange(4, 12))]
                        for _ in range(8)]

    @property
    def done(self) -> bool:
        return self.step_no == self.steps * 3

    def step(self) -> None:
        scheduler, rnd = self.scheduler, self.rnd
        self.timer.on = self.step_no >= self.steps * 2  # warm up until the batch is mostly decodes
        self.step_no += 1
        while len(scheduler.requests) < self.live:
            prompt = rnd.choice(self.systems) + [rnd.randrange(512) for _ in range(rnd.randrange(1, 48))]
            scheduler.add_request(Request(f"req-{self.next_id}", prompt,
                                          SamplingParams(max_tokens=rnd.randrange(32, 128)), None,
                                          block_hasher=self.hasher))
            self.next_id += 1
        so = scheduler.schedule()
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sampled = [[rnd.randrange(512)] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
                   else [] for r in req_ids]
        scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=self.complete(so)))


def side_by_side(model: Path, live: int, steps: int, groups: tuple[Group, ...]) -> tuple[float, float]:
    """Our connector's and vLLM's seconds inside their scheduler-side methods over the measured steps, each run
    taking a step in turn. The garbage collector runs between steps, not inside them: both schedulers' requests
    live in this process, and a full collection walks all of them in whichever call allocates next."""
    init_none_hash(sha256)
    ours, theirs = Run(model, True, live, steps, groups), Run(model, False, live, steps, groups)
    gc.disable()
    try:
        while not ours.done:
            ours.step()
            theirs.step()
            if not ours.step_no % 16:
                gc.collect()
    finally:
        gc.enable()
    return ours.timer.seconds, theirs.timer.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="scheduler-side cost, ours vs vLLM's OffloadingConnector")
    parser.add_argument("--live", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/tiny-llama"))
    parser.add_argument("--groups", type=parse_groups, default=FULL_ATTENTION,
                        help="the model's KV cache groups, e.g. 512,full (default: full)")
    args = parser.parse_args(argv)
    model = build_tiny_llama(args.model_dir)
    ratios = {}
    print(f"{'live':>6} {'ours µs/step':>13} {'vLLM µs/step':>13} {'ours/vLLM':>10}")
    for live in args.live:
        print(f"  {live} live requests...", file=sys.stderr, flush=True)
        ours, theirs = side_by_side(model, live, args.steps, args.groups)
        steps = args.steps
        ratios[live] = ours / theirs
        print(f"{live:>6} {ours / steps * 1e6:>13.1f} {theirs / steps * 1e6:>13.1f} {ratios[live]:>10.3f}", flush=True)
    for live, ratio in ratios.items():
        print(f"sched_ratio_vs_vllm_{live}={ratio:.3f}")
    worst = max((ratios[n] for n in (256, 1024) if n in ratios), default=max(ratios.values()))
    print(f"sched_ratio_vs_vllm={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
