"""Many requests at once on vLLM's CPU engine, with and without our connector: throughput (generated tokens per
second of the whole batch) and mean time to first token, over one shared document (each request finds it in our
CPU tier, or computes it) and over documents of their own (no hit possible: the connector only stores). See
``kvoffload.impl.testing.convoy``. The two engines run in processes of their own and take turns, round by round
(the first to go alternates), so a machine that slows down slows both; ratios are medians over rounds of each
round's ours / none. Every output is compared between the ways, and the shared document must come from the tier
once a round (the other requests share what that load brought: it fails otherwise). Last line:
``convoy_throughput_vs_none=… convoy_ttft_vs_none=… nohit_throughput_vs_none=…`` (the worst over ``--requests``).
Goals: a convoy at least as fast as no connector (throughput ≥ 1.0, TTFT ≤ 1.0), and no more than 2 % of
throughput lost where no hit is possible (≥ 0.98).

    python bench/convoy.py [--requests 16 32] [--document 1024] [--rounds 3] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvoffload.impl.testing.convoy import WAYS, WORKLOADS
from kvoffload.impl.testing.engine_process import EngineProcess
from kvoffload.impl.testing.ttft import build_prefill_llama


def engine(way: str, model: Path, requests: int, document: int) -> EngineProcess:
    """One way's engine process, asked for a round at a time."""
    return EngineProcess(way, "kvoffload.impl.testing.convoy", way, str(model), str(requests), str(document))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="many requests at once: throughput and TTFT, ours vs none")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 32], help="requests submitted together")
    parser.add_argument("--document", type=int, default=1024, help="tokens of each document (a multiple of 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/prefill-llama"))
    args = parser.parse_args(argv)
    if args.document <= 0 or args.document % 32 or min(args.requests) < 1 or args.rounds < 1:
        parser.error("--document must be a positive multiple of 32; --requests and --rounds at least 1")
    model = build_prefill_llama(args.model_dir)
    engines = {way: engine(way, model, max(args.requests), args.document) for way in WAYS}
    worst: dict[str, float] = {}
    wrong = []
    print(f"\n{'requests':>8} {'workload':>8} {'none tok/s':>10} {'ours tok/s':>10} {'ratio':>6}   "
          f"{'none TTFT':>9} {'ours TTFT':>9} {'ratio':>6}   {'hit tokens':>10} {'copies':>6}  (ms, medians of "
          f"{args.rounds}; copies: the share of our batch spent copying into the tier)")
    try:
        for n in args.requests:
            for kind in WORKLOADS:
                rounds = []
                for r in range(args.rounds):
                    print(f"  {n} requests, {kind}, round {r + 1}...", file=sys.stderr, flush=True)
                    run = {}
                    for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                        time.sleep(0.5)  # the other engine's OpenMP threads stop spinning
                        run[way] = engines[way].ask({"kind": kind, "requests": n, "round": r,
                                                     "max_tokens": args.max_tokens})
                    if run["none"]["outputs"] != run["ours"]["outputs"]:
                        wrong.append(f"{n} requests, {kind}, round {r}")
                    if n > 1 and kind == "shared" and run["ours"]["hit_tokens"] >= 2 * args.document:
                        wrong.append(f"{n} requests, shared, round {r}: the document loaded from the tier more than "
                                     f"once ({run['ours']['hit_tokens']} tokens), not shared by the engine's cache")
                    rounds.append(run)
                row = summarize(rounds)
                if kind == "shared" and not row["hit_tokens"]:  # its figures would be recompute's
                    wrong.append(f"{n} requests, shared: no hit from the CPU tier")
                print(f"{n:>8} {kind:>8} {row['none_tps']:>10.0f} {row['ours_tps']:>10.0f} {row['tps_ratio']:>6.3f}   "
                      f"{row['none_ttft'] * 1e3:>9.1f} {row['ours_ttft'] * 1e3:>9.1f} {row['ttft_ratio']:>6.3f}   "
                      f"{row['hit_tokens']:>10} {row['store_share']:>6.1%}", flush=True)
                for name, value, pick in ((f"{kind}_tps", row["tps_ratio"], min),
                                          (f"{kind}_ttft", row["ttft_ratio"], max)):
                    worst[name] = pick(worst.get(name, value), value)
    finally:
        for process in engines.values():
            process.close()
    print(f"\noutputs identical with and without the connector, and the shared document loaded once: "
          f"{'yes' if not wrong else 'NO: ' + '; '.join(wrong)}")
    print(f"convoy_throughput_vs_none={worst['shared_tps']:.3f} convoy_ttft_vs_none={worst['shared_ttft']:.3f} "
          f"nohit_throughput_vs_none={worst['unique_tps']:.3f} nohit_ttft_vs_none={worst['unique_ttft']:.3f}")
    return 1 if wrong else 0


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Medians over rounds: each way's throughput and mean TTFT, and each round's ours / none."""
    def tps(result: dict[str, Any]) -> float:
        return result["tokens"] / result["seconds"]

    def ttft(result: dict[str, Any]) -> float:
        return statistics.mean(result["ttft"])
    return {"none_tps": statistics.median(tps(r["none"]) for r in rounds),
            "ours_tps": statistics.median(tps(r["ours"]) for r in rounds),
            "tps_ratio": statistics.median(tps(r["ours"]) / tps(r["none"]) for r in rounds),
            "none_ttft": statistics.median(ttft(r["none"]) for r in rounds),
            "ours_ttft": statistics.median(ttft(r["ours"]) for r in rounds),
            "ttft_ratio": statistics.median(ttft(r["ours"]) / ttft(r["none"]) for r in rounds),
            "hit_tokens": int(statistics.median(r["ours"]["hit_tokens"] for r in rounds)),
            "store_share": statistics.median(r["ours"]["store_seconds"] / r["ours"]["seconds"] for r in rounds)}


if __name__ == "__main__":
    sys.exit(main())
