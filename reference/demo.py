"""Demo: a prefix-heavy workload through the world model with the reference connector, checked step by step.

The reference runs on real tensors while the spec connector runs the same workload in a twin world; after every
step the two must agree exactly and every invariant must hold. Run: ``python -m kvoffload.reference.demo``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from kvoffload.spec import Config, Executor, ListKV, SpecConnector, World
from kvoffload.spec.invariants import CHECKED, Violation

from .connector import ReferenceConnector, TensorKV

SYSTEM_PROMPTS = [[t % 3 for t in range(s, s + 16)] for s in range(4)]  # 4 long shared prefixes


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rnd = random.Random(seed)
    return [(rnd.choice(SYSTEM_PROMPTS) + [rnd.randrange(3) for _ in range(rnd.randint(1, 8))], rnd.randint(2, 10))
            for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay", type=int, default=2, help="steps a transfer may stay in flight")
    args = parser.parse_args(argv)

    config = Config(num_gpu_blocks=40, block_size=2, offload_block_size=4, tier_blocks=10, token_budget=32)
    reference = ReferenceConnector(config)
    worlds = [World(config, reference, TensorKV(config.num_gpu_blocks), Executor(args.delay), observable=True),
              World(config, SpecConnector(config), ListKV(config.num_gpu_blocks), Executor(args.delay),
                    observable=True)]
    pending = workload(args.requests, args.seed)
    rnd = random.Random(args.seed + 1)
    violations, start = [], time.perf_counter()
    try:
        while pending or worlds[0].requests:
            for _ in range(min(len(pending), 8 - len(worlds[0].requests))):
                prompt, max_tokens = pending.pop()
                for world in worlds:
                    world.add_request(prompt, max_tokens)
            if rnd.random() < 0.05:  # the operator resets the engine's prefix cache: hits must come from the tier
                for world in worlds:
                    world.reset_prefix_cache()
            for world in worlds:
                world.step()
                world.check()
            if worlds[0].snapshot() != worlds[1].snapshot() or \
                    worlds[0].observe() != worlds[1].observe():
                raise Violation("EQUIV", f"step {worlds[0].step_no}: reference and spec diverged")
            if worlds[0].step_no % 100 == 0:
                print(f"  step {worlds[0].step_no}: {worlds[0].stats['finished']}/{args.requests} requests done",
                      file=sys.stderr, flush=True)
        for world in worlds:
            world.drain()
    except Violation as violation:
        violations.append(violation)
    ref = worlds[0]
    rows = [
        ("steps", ref.stats["steps"]),
        ("requests", ref.stats["requests"]),
        ("engine prefix-cache hits (blocks)", ref.stats["engine_hit_blocks"]),
        ("blocks stored to the tier", ref.stats["blocks_stored"]),
        ("tier hits (tokens)", ref.stats["tier_hit_tokens"]),
        ("blocks loaded from the tier", ref.stats["blocks_loaded"]),
        ("store allocation failures", reference.tier.refusals),
        ("preemptions", ref.stats["preemptions"]),
        ("invariants checked", sum(CHECKED.values())),
        ("violations", len(violations)),
        ("seconds", f"{time.perf_counter() - start:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nkvoffload demo — reference connector vs spec, prefix-heavy workload")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for found in violations:
        print(f"\n{found}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
