"""Many requests at once on vLLM's CPU engine, with and without our connector: throughput (generated tokens per
second of the whole batch) and mean time to first token, over one shared document (each request finds it in our
CPU tier, or computes it) and over documents of their own (no hit possible: the connector only stores). See
``kvoffload.impl.testing.convoy``. Each way is an engine in a process of its own, and each round starts a fresh pair
(the first started and the first asked alternate): two identical engine processes differ by a few percent for a
whole run, so a figure that kept one pair would carry that pair's bias; across fresh pairs it averages out. The two
take turns, so a machine that slows down slows both; ratios are medians over rounds of each round's ours / none.
Every output is compared between the ways, and the shared document must come from the tier once a round (the other
requests share what that load brought: it fails otherwise). Last line: ``convoy_throughput_vs_none=…
convoy_ttft_vs_none=… nohit_throughput_vs_none=…`` (the worst over ``--requests``). Goals: a convoy at least as fast
as no connector (throughput ≥ 1.0, TTFT ≤ 1.0), and no more than 2 % of throughput lost where no hit is possible
(≥ 0.98). ``--same none`` runs no connector in both processes: what the harness itself reads as a difference.

    python bench/convoy.py [--requests 16 32] [--document 1024] [--rounds 5] [--max-tokens 16] [--same none]
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
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each on a fresh pair of engine processes")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/prefill-llama"))
    parser.add_argument("--same", choices=WAYS, help="run this way in both processes (the harness's own noise)")
    args = parser.parse_args(argv)
    if args.document <= 0 or args.document % 32 or min(args.requests) < 1 or args.rounds < 1:
        parser.error("--document must be a positive multiple of 32; --requests and --rounds at least 1")
    model = build_prefill_llama(args.model_dir)
    runs: dict[tuple[int, str], list[dict[str, dict[str, Any]]]] = {(n, kind): [] for n in args.requests
                                                                     for kind in WORKLOADS}
    wrong = []
    for r in range(args.rounds):
        order = WAYS if r % 2 == 0 else WAYS[::-1]
        engines: dict[str, EngineProcess] = {}
        try:
            for way in order:
                engines[way] = engine(args.same or way, model, max(args.requests), args.document)
            for (n, kind), rounds in runs.items():
                print(f"  round {r + 1}: {n} requests, {kind}...", file=sys.stderr, flush=True)
                run = {}
                for way in order:
                    time.sleep(0.5)  # the other engine's OpenMP threads stop spinning
                    run[way] = engines[way].ask({"kind": kind, "requests": n, "round": r,
                                                 "max_tokens": args.max_tokens})
                wrong += check(run, n, kind, r, args.document, args.same)
                rounds.append(run)
        finally:
            for process in engines.values():
                process.close()
    worst: dict[str, float] = {}
    print(f"\n{'requests':>8} {'workload':>8} {'none tok/s':>10} {'ours tok/s':>10} {'ratio':>6}   "
          f"{'none TTFT':>9} {'ours TTFT':>9} {'ratio':>6}   {'hit tokens':>10} {'copies':>6}   {'rounds':>11}  "
          f"(ms, medians of {args.rounds} rounds; copies: the share of our batch spent copying into the tier; "
          f"rounds: the lowest and highest throughput ratio of a round)"
          + (f"; both ways are {args.same!r}" if args.same else ""))
    for (n, kind), rounds in runs.items():
        row = summarize(rounds)
        if kind == "shared" and not row["hit_tokens"] and args.same is None:  # its figures would be recompute's
            wrong.append(f"{n} requests, shared: no hit from the CPU tier")
        print(f"{n:>8} {kind:>8} {row['none_tps']:>10.0f} {row['ours_tps']:>10.0f} {row['tps_ratio']:>6.3f}   "
              f"{row['none_ttft'] * 1e3:>9.1f} {row['ours_ttft'] * 1e3:>9.1f} {row['ttft_ratio']:>6.3f}   "
              f"{row['hit_tokens']:>10} {row['store_share']:>6.1%}   {row['tps_low']:.3f}-{row['tps_high']:.3f}",
              flush=True)
        for name, value, pick in ((f"{kind}_tps", row["tps_ratio"], min), (f"{kind}_ttft", row["ttft_ratio"], max)):
            worst[name] = pick(worst.get(name, value), value)
    print(f"\noutputs identical with and without the connector, and the shared document loaded once: "
          f"{'yes' if not wrong else 'NO: ' + '; '.join(wrong)}")
    print(f"convoy_throughput_vs_none={worst['shared_tps']:.3f} convoy_ttft_vs_none={worst['shared_ttft']:.3f} "
          f"nohit_throughput_vs_none={worst['unique_tps']:.3f} nohit_ttft_vs_none={worst['unique_ttft']:.3f}")
    return 1 if wrong else 0


def check(run: dict[str, dict[str, Any]], n: int, kind: str, r: int, document: int, same: str | None) -> list[str]:
    """What is wrong with one round's pair of results: outputs that differ, a shared document loaded twice."""
    wrong = []
    if run["none"]["outputs"] != run["ours"]["outputs"]:
        wrong.append(f"{n} requests, {kind}, round {r}")
    if same is None and n > 1 and kind == "shared" and run["ours"]["hit_tokens"] >= 2 * document:
        wrong.append(f"{n} requests, shared, round {r}: the document loaded from the tier more than once "
                     f"({run['ours']['hit_tokens']} tokens), not shared by the engine's cache")
    return wrong


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Medians over rounds: each way's throughput and mean TTFT, and each round's ours / none."""
    def tps(result: dict[str, Any]) -> float:
        return result["tokens"] / result["seconds"]

    def ttft(result: dict[str, Any]) -> float:
        return statistics.mean(result["ttft"])
    ratios = [tps(r["ours"]) / tps(r["none"]) for r in rounds]
    return {"none_tps": statistics.median(tps(r["none"]) for r in rounds),
            "ours_tps": statistics.median(tps(r["ours"]) for r in rounds),
            "tps_ratio": statistics.median(ratios), "tps_low": min(ratios), "tps_high": max(ratios),
            "none_ttft": statistics.median(ttft(r["none"]) for r in rounds),
            "ours_ttft": statistics.median(ttft(r["ours"]) for r in rounds),
            "ttft_ratio": statistics.median(ttft(r["ours"]) / ttft(r["none"]) for r in rounds),
            "hit_tokens": int(statistics.median(r["ours"].get("hit_tokens", 0) for r in rounds)),  # (none: --same)
            "store_share": statistics.median(r["ours"].get("store_seconds", 0.0) / r["ours"]["seconds"]
                                             for r in rounds)}


if __name__ == "__main__":
    sys.exit(main())
