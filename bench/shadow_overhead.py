"""Cost of the shadow spec monitor inside a real vLLM engine (CPU, tiny model): engine throughput with
``verify`` off and on, same workload, same process. Last line: ``shadow_overhead=<time with / time without>``.

    python bench/shadow_overhead.py [--requests 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from kvoffload.impl.testing.demo import (BLOCK_SIZE, build_tiny_llama, connector_config, make_llm, run_rounds,
                                      scheduler_connector, workload)


def timed_run(model: Path, verify: bool, prompts: list[list[int]], rounds: int) -> tuple[float, int]:
    llm = make_llm(model, connector_config(tier_bytes=64 << 20, offload_block_size=BLOCK_SIZE, verify=verify))
    run_rounds(llm, prompts[:4], 1, 4)  # warm up
    start = time.perf_counter()
    run_rounds(llm, prompts, rounds, 12)
    seconds = time.perf_counter() - start
    steps = scheduler_connector(llm).shadow.steps if verify else 0
    del llm
    gc.collect()
    return seconds, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="shadow monitor overhead")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/tiny-llama"))
    args = parser.parse_args(argv)
    model = build_tiny_llama(args.model_dir)
    prompts = workload(args.requests, seed=0)
    off, _ = timed_run(model, False, prompts, args.rounds)
    on, steps = timed_run(model, True, prompts, args.rounds)
    print(f"verify off: {off:.2f}s   verify on: {on:.2f}s   ({steps} engine steps checked)")
    print(f"engine steps/s without / with verify: {steps / off:.1f} / {steps / on:.1f}")
    print(f"shadow_overhead={on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
