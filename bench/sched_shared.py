"""Scheduler-side cost of the shared tier: the production connector with a store behind its tier vs without.

The same prefix-heavy decode workload is recorded twice with the spec connector in the world model, without and
with a store, and each trace is replayed through the production connector, side by side, timing only its
scheduler-side calls (see ``bench/sched_vs_reference.py``). With the store, every lookup of a new request asks it,
every store that lands is put, and hits come from it too; each check also goes to a real filesystem tier
(``FileTier`` on a temporary directory), in the time measured, and so does each put the scheduler side learns of:
what the scheduler thread pays for the tier's index (listings run on its I/O threads; an answer that waits for one
is waited for after each plan, as the forward pass would). Last line:
``sched_shared_tier_vs_off=<on/off>``, the worse of the ratios at 256 and 1024 live requests (each the median over
rounds of a ratio timed side by side).

    python bench/sched_shared.py [--steps 60] [--live 64 256 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from sched_vs_reference import NAMESPACE, KnownRecords, paired, record_trace, side_by_side  # noqa: E402 - bench/ is its directory

from kvoffload.impl import OffloadConnector
from kvoffload.impl.tiers.fs import FileTier
from kvoffload.spec.store import Store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="scheduler-side cost of the shared tier, on vs off")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--live", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args(argv)
    ratios = {}
    print(f"{'live':>6} {'steps':>6} {'off µs/step':>12} {'on µs/step':>11} {'checks/step':>12} "
          f"{'on/off':>7}")
    with tempfile.TemporaryDirectory() as root:
        tier = FileTier(root, NAMESPACE, 4096)
        for live in args.live:
            print(f"  recording {args.steps} steps with {live} live requests, without and with a store...",
                  file=sys.stderr, flush=True)
            off_trace = record_trace(live, args.steps)
            on_trace = record_trace(live, args.steps, store=Store(1 << 30))
            rounds = side_by_side([(OffloadConnector, off_trace, None),
                                   (OffloadConnector, on_trace, lambda: KnownRecords(tier))])
            off, on, ratios[live] = paired(rounds)
            store = rounds[0][1].store
            assert store is not None
            print(f"{live:>6} {args.steps:>6} {off / args.steps * 1e6:>12.1f} {on / args.steps * 1e6:>11.1f} "
                  f"{store.checks / args.steps:>12.1f} {ratios[live]:>7.2f}",
                  flush=True)
    for live, ratio in ratios.items():
        print(f"sched_shared_tier_vs_off_{live}={ratio:.3f}")
    worst = max((ratios[n] for n in (256, 1024) if n in ratios), default=max(ratios.values()))
    print(f"sched_shared_tier_vs_off={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
