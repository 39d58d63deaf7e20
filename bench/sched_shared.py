"""Scheduler-side cost of the shared tier: the production connector with a store behind its tier vs without.

The same prefix-heavy decode workload is recorded twice with the spec connector in the world model, without and
with a store (existence checks answered at once), and each trace is replayed through the production connector,
timing only its scheduler-side calls (see ``bench/sched.py``). With the store, every lookup of a new request asks
it, every store that lands is put, and hits come from it too. To each check the replay made, the bench adds what
handing one to the filesystem tier's I/O threads costs the scheduler thread (``FileTier.ask`` on a real directory,
in bursts as a scheduler pass asks; the checks themselves run on the I/O threads while the engine waits for its
forward pass). Last line:
``sched_shared_tier_vs_off=<on/off>``, the worse of the ratios at 256 and 1024 live requests.

    python bench/sched_shared.py [--steps 60] [--live 64 256 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from sched import NAMESPACE, KnownRecords, record_trace, replay  # noqa: E402 - bench/ is the script's own directory

from kvoffload.impl import OffloadConnector
from kvoffload.impl.tiers.fs import FileTier
from kvoffload.spec.store import Store


def ask_seconds(burst: int, keys: int = 16, bursts: int = 200) -> float:
    """What handing one existence check to the filesystem tier costs the asking thread, ``burst`` checks at a time
    (one scheduler pass's), each burst answered before the next (outside the time measured)."""
    with tempfile.TemporaryDirectory() as root:
        tier, best = FileTier(root, NAMESPACE, 4096), float("inf")
        for _ in range(3):
            spent = 0.0
            for i in range(bursts):
                start = time.perf_counter()
                answers = [tier.ask(range(j * keys, j * keys + keys)) for j in range(i * burst, (i + 1) * burst)]
                spent += time.perf_counter() - start
                for answer in answers:
                    answer.result()
            best = min(best, spent / (bursts * burst))
        return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="scheduler-side cost of the shared tier, on vs off")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--live", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args(argv)
    ratios = {}
    print(f"{'live':>6} {'steps':>6} {'off µs/step':>12} {'on µs/step':>11} {'checks/step':>12} {'µs/check':>9} "
          f"{'+checks µs/step':>16} {'on/off':>7}")
    for live in args.live:
        print(f"  recording {args.steps} steps with {live} live requests, without and with a store...",
              file=sys.stderr, flush=True)
        off_trace = record_trace(live, args.steps)
        on_trace = record_trace(live, args.steps, store=Store(1 << 30))
        off = min(replay(OffloadConnector, *off_trace)[0] for _ in range(3))
        store = KnownRecords()
        on = min(replay(OffloadConnector, *on_trace, store=store)[0] for _ in range(3))
        checks = store.checks / args.steps
        ask = ask_seconds(max(1, round(checks)))
        total = on + store.checks * ask
        ratios[live] = total / off
        print(f"{live:>6} {args.steps:>6} {off / args.steps * 1e6:>12.1f} {on / args.steps * 1e6:>11.1f} "
              f"{checks:>12.1f} {ask * 1e6:>9.1f} {total / args.steps * 1e6:>16.1f} {total / off:>7.2f}", flush=True)
    for live, ratio in ratios.items():
        print(f"sched_shared_tier_vs_off_{live}={ratio:.3f}")
    worst = max((ratios[n] for n in (256, 1024) if n in ratios), default=max(ratios.values()))
    print(f"sched_shared_tier_vs_off={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
