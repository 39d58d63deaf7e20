"""Run one prefix-heavy workload through a real vLLM engine in a fresh process; print a JSON line with the
outputs and, when a connector is configured, its counters and events. Used by test_engine.py."""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--connector", default="", help="module:Class, empty for none")
    parser.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    parser.add_argument("--gpu-blocks", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reset-connector", action="store_true",
                        help="between rounds, reset the connector too (a weight update)")
    parser.add_argument("--kv-events", action="store_true", help="the engine publishes KV cache events")
    parser.add_argument("--max-file-bytes", type=int, help="no file may grow past this (as on a full disk: EFBIG)")
    parser.add_argument("--kill-between-rounds", type=int, help="SIGKILL this process after the first round")
    parser.add_argument("--load-failure-policy", default="recompute", choices=("recompute", "fail"),
                        help="vLLM's kv_load_failure_policy ('fail': a request whose load failed ends with an error)")
    args = parser.parse_args()

    from vllm.config import KVTransferConfig

    from kvoffload.impl.testing.demo import drain, has_state, make_llm, run_rounds, scheduler_connector, workload

    config = None
    if args.connector:
        module, cls = args.connector.split(":")
        config = KVTransferConfig(kv_connector=cls, kv_role="kv_both", kv_connector_module_path=module,
                                  kv_connector_extra_config=json.loads(args.extra),
                                  kv_load_failure_policy=args.load_failure_policy)
    # a model with recurrent state gets vLLM's aligned blocks (256 tokens), and documents of several of them
    llm = make_llm(args.model, config, num_gpu_blocks=args.gpu_blocks, kv_events=args.kv_events,
                   max_model_len=4096 if has_state(args.model) else 1024)
    prompts = workload(12, seed=1, block_size=llm.llm_engine.vllm_config.cache_config.block_size)
    if args.max_file_bytes:  # once the engine is built (it writes its compile caches at start-up)
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.max_file_bytes, args.max_file_bytes))
    intervals = []  # every interval's stats vLLM's scheduler took from the connector: the whole run, summed
    if config is not None:
        take = scheduler_connector(llm).get_kv_connector_stats
        scheduler_connector(llm).get_kv_connector_stats = lambda: intervals.append(take()) or intervals[-1]
    try:
        if args.reset_connector:
            outputs = run_rounds(llm, prompts, rounds=1, max_tokens=8)
            result = {"reset": llm.reset_prefix_cache(reset_connector=True)}
            drain(llm)  # the first round's puts end (they may outlive the reset) and are counted before the second
            before = dict(scheduler_connector(llm).stats())
            outputs += run_rounds(llm, prompts, rounds=args.rounds - 1, max_tokens=8)
            result |= {"outputs": outputs, "stats_before_reset": before}
        elif args.kill_between_rounds:
            outputs = run_rounds(llm, prompts, rounds=1, max_tokens=8)
            os.kill(args.kill_between_rounds, signal.SIGKILL)
            result = {"outputs": outputs + run_rounds(llm, prompts, rounds=args.rounds - 1, max_tokens=8)}
        else:
            result = {"outputs": run_rounds(llm, prompts, rounds=args.rounds, max_tokens=8)}
        if config is not None:
            began = time.perf_counter()
            drain(llm)  # every transfer reported: the counters are the whole run's
            result["drain_seconds"] = time.perf_counter() - began
    except Exception as exc:  # noqa: BLE001 - reported to the test, with whatever the connector saw
        result = {"error": f"{type(exc).__name__}: {exc}"}
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result["kv_cache_groups"] = [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups]
    if config is not None:
        connector = scheduler_connector(llm)
        result["stats"] = connector.stats()
        intervals.append(connector.get_kv_connector_stats())
        logged = [stats for stats in intervals if stats is not None]
        result["interval"] = functools.reduce(lambda a, b: a.aggregate(b), logged).data if logged else {}
        result["events"] = [(type(e).__name__, getattr(e, "medium", None), getattr(e, "group_idx", None))
                            for e in getattr(connector, "recorded", [])]
        # what the adapter derived from the engine's KV cache config, beside what the engine's scheduler runs with
        result["derived"] = {"retention_interval": connector.config.retention_interval,
                             "checkpoint_alignment": connector.config.checkpoint_alignment,
                             "engine_retention_interval": scheduler.kv_cache_config.prefix_cache_retention_interval}
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)
