"""Time to first token on vLLM's CPU engine: recompute, the engine's own prefix-cache hit, a hit from our CPU tier,
and a hit from the shared tier (a directory another engine wrote), one request at a time, over a sweep of document
lengths, and the first ask of a document while the connector stores it (CPU tier) or puts it too (shared tier); see
``kvoffload.impl.testing.ttft`` for how each is measured. Each way runs in its own engine process, one after the
other in this run, but the engine without a connector and those with a CPU tier (loading asynchronously, loading
synchronously under vLLM's "fail" policy, and putting into the shared tier too) take turns, document by document: a
CPU-tier hit's ratios to recompute and to the engine's own hit, and a first ask's while its KV is stored or put, are
medians over documents of ratios timed side by side; the shared hits' ratios are of medians at the same length.
Every hit's first token is checked against recompute's, and every prefix-cache reset against vLLM's answer; a way
whose engine never hit (its figures would be recompute's) fails the run. Last line, at ``--at`` tokens:
``ttft_tier_vs_recompute=… ttft_tier_vs_gpu_hit=… ttft_sync_vs_gpu_hit=… ttft_sync_vs_own_hit=…
ttft_shared_vs_recompute=… ttft_storing_vs_recompute=… ttft_putting_vs_recompute=…`` (``sync_vs_own``: against the
hit from the same engine's prefix cache, asked before its reset: no second process in the ratio).
Goals at every length: a CPU-tier hit ≤ 0.05 × recompute (2048 tokens) and ≤ 1.05 × the engine's own hit (issue
41: synchronously); a shared-tier hit ≤ 0.1 × recompute. With ``--redis``, the shared tier on a Redis server (a
real redis-server on a loopback port) as well: ``ttft_redis_vs_recompute=… ttft_redis_vs_tier=…`` join the last
line; with ``--mooncake``, on a Mooncake Store pool (a real master and store node on loopback ports):
``ttft_mooncake_vs_recompute=… ttft_mooncake_vs_tier=…``. With ``--hybrid``, a hybrid
linear-attention model of the same size (Qwen3-Next style: gated delta nets with recurrent state, and attention) at
``--hybrid-lengths`` (multiples of its 256-token blocks, from 512), recompute, its own hit and a CPU-tier hit
taking turns as above: ``ttft_hybrid_tier_vs_recompute=… ttft_hybrid_tier_vs_gpu_hit=…`` (at the longest) join the
last line.

    python bench/ttft.py [--lengths 512 1024 2048 4096] [--docs 4] [--at 2048] [--redis] [--mooncake] [--hybrid]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kvoffload.impl.testing.ttft import (STORES, build_prefill_llama, build_prefill_qwen3_next, medians,
                                         mismatches, paired, run_ways)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time to first token: recompute, GPU hit, CPU-tier hit, shared hit")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="document lengths in tokens (multiples of 32)")
    parser.add_argument("--docs", type=int, default=4, help="documents measured per length")
    parser.add_argument("--at", type=int, default=2048, help="the length the last line reports")
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/prefill-llama"))
    parser.add_argument("--redis", action="store_true", help="a Redis hit too (needs redis-server)")
    parser.add_argument("--mooncake", action="store_true", help="a Mooncake Store hit too (needs kvoffload[mooncake])")
    parser.add_argument("--hybrid", action="store_true", help="a hybrid linear-attention model's hits too")
    parser.add_argument("--hybrid-lengths", type=int, nargs="+", default=[512, 1024, 2048],
                        help="its document lengths (multiples of 256, from 512)")
    args = parser.parse_args(argv)
    if args.at not in args.lengths or any(n <= 0 or n % 32 for n in args.lengths):
        parser.error(f"--lengths must be positive multiples of 32 and include --at {args.at}")
    if any(n <= 256 or n % 256 for n in args.hybrid_lengths):  # a hit ends a block before the prompt's last token
        parser.error("--hybrid-lengths must be multiples of 256 (the hybrid model's blocks) from 512")
    model = build_prefill_llama(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="kvoffload-ttft-") as directory:
        fs = {"backend": "fs", "path": directory, "bytes": 16 << 30}
        # taking turns (only the writer's connector takes the shared tier); the reader starts on what it left
        runs = run_ways(("none", "tier", "sync", "writer"), model, args.lengths, args.docs, fs)
        runs |= run_ways(("shared",), model, args.lengths, args.docs, fs)
    stores = [store for store in STORES if getattr(args, store)]
    for store in stores:
        with shared_store(store) as shared:
            for way in (f"{store}_writer", store):
                runs |= run_ways((way,), model, args.lengths, args.docs, shared)
    ttft = medians(runs)
    print(f"\n{'tokens':>7} {'recompute':>10} {'gpu hit':>8} {'cpu tier':>9} {'sync':>8} {'shared':>8} "
          f"{'storing':>8} {'putting':>8}   {'tier/recomp':>11} {'tier/gpu':>8} {'sync/gpu':>8} {'sync/own':>8} "
          f"{'sync/tier':>9} {'stor/recomp':>11} {'put/recomp':>10} {'shared/recomp':>13}"
          f"   (ms, medians of {args.docs}; sync/own: against the same engine's own hit)")
    for n in args.lengths:
        row = [ttft[f"{kind}/{n}"] for kind in ("recompute", "gpu_hit", "cpu_tier", "cpu_tier_sync", "shared_tier",
                                                "recompute_storing", "recompute_putting")]
        print(f"{n:>7} " + " ".join(f"{s * 1e3:>{w}.1f}" for s, w in zip(row, (10, 8, 9, 8, 8, 8, 8)))
              + f"   {paired(runs, 'cpu_tier', 'recompute', n):>11.3f} {paired(runs, 'cpu_tier', 'gpu_hit', n):>8.2f}"
              f" {paired(runs, 'cpu_tier_sync', 'gpu_hit', n):>8.2f}"
              f" {paired(runs, 'cpu_tier_sync', 'gpu_hit_sync', n):>8.2f}"
              f" {paired(runs, 'cpu_tier_sync', 'cpu_tier', n):>9.2f}"
              f" {paired(runs, 'recompute_storing', 'recompute', n):>11.3f}"
              f" {paired(runs, 'recompute_putting', 'recompute', n):>10.3f} {row[4] / row[0]:>13.3f}")
    wrong, resets = mismatches(runs), runs["tier"]["reset_steps"]
    print(f"\nfirst tokens identical to recompute: {'yes' if not wrong else 'NO: ' + '; '.join(wrong)}")
    print(f"prefix-cache resets: {len(resets)}, each confirmed by vLLM after {min(resets)}-{max(resets)} extra "
          f"engine steps")
    print(f"connector, CPU-tier engine: {runs['tier']['stats']}")
    print(f"connector, CPU-tier engine with synchronous loads: {runs['sync']['stats']}")
    print(f"connector, writing engine: {runs['writer']['stats']}")
    print(f"connector, shared-tier engine: {runs['shared']['stats']}")
    at, store_figures = args.at, ""
    for store in stores:
        print(f"\n{'tokens':>7} {store + ' hit':>13} {'putting':>8}   {store + '/recomp':>15} {store + '/tier':>13}")
        for n in args.lengths:
            hit, putting = ttft[f"{store}_tier/{n}"], ttft[f"{store}_recompute_putting/{n}"]
            print(f"{n:>7} {hit * 1e3:>13.1f} {putting * 1e3:>8.1f}   {hit / ttft[f'recompute/{n}']:>15.3f} "
                  f"{hit / ttft[f'cpu_tier/{n}']:>13.2f}")
        print(f"connector, {store} reader: {runs[store]['stats']}")
        store_figures += (f" ttft_{store}_vs_recompute={ttft[f'{store}_tier/{at}'] / ttft[f'recompute/{at}']:.3f}"
                          f" ttft_{store}_vs_tier={ttft[f'{store}_tier/{at}'] / ttft[f'cpu_tier/{at}']:.3f}")
    hybrid_figures, hybrid_wrong = hybrid(args) if args.hybrid else ("", [])
    wrong += unexercised(runs, ("tier", "hit_tokens"), ("sync", "sync_loaded_blocks"), ("shared", "shared_got_blocks"),
                         *((store, "shared_got_blocks") for store in stores))
    print(f"ttft_tier_vs_recompute={paired(runs, 'cpu_tier', 'recompute', at):.3f} "
          f"ttft_tier_vs_gpu_hit={paired(runs, 'cpu_tier', 'gpu_hit', at):.3f} "
          f"ttft_sync_vs_gpu_hit={paired(runs, 'cpu_tier_sync', 'gpu_hit', at):.3f} "
          f"ttft_sync_vs_own_hit={paired(runs, 'cpu_tier_sync', 'gpu_hit_sync', at):.3f} "
          f"ttft_shared_vs_recompute={ttft[f'shared_tier/{at}'] / ttft[f'recompute/{at}']:.3f} "
          f"ttft_storing_vs_recompute={paired(runs, 'recompute_storing', 'recompute', at):.3f} "
          f"ttft_putting_vs_recompute={paired(runs, 'recompute_putting', 'recompute', at):.3f}"
          + store_figures + hybrid_figures)
    return 1 if wrong or hybrid_wrong else 0


def unexercised(runs: dict[str, Any], *ways: tuple[str, str]) -> list[str]:
    """The ways whose engine never did what they measure (its counter stayed 0): their figures would be
    recompute's under another name. Printed, and the run fails."""
    missed = [f"the {way} engine's {counter} stayed 0" for way, counter in ways if not runs[way]["stats"].get(counter)]
    for line in missed:
        print(f"NOT MEASURED: {line}")
    return missed


@contextmanager
def shared_store(store: str) -> Iterator[dict[str, Any]]:
    """A real server of the named backend on loopback ports, for the run: the ``shared_tier`` entry reaching it."""
    if store == "redis":
        from kvoffload.impl.testing.redis_server import PASSWORD, USER, RedisServer

        with RedisServer() as server:
            yield {"backend": "redis", "url": server.url, "username": USER, "password": PASSWORD}
        return
    from kvoffload.impl.testing.mooncake_master import MooncakeMaster

    os.environ.setdefault("MC_RPC_TIMEOUT_MS", "1000")  # the engines' Mooncake calls, bounded as an operator would
    with MooncakeMaster(node_bytes=1 << 30) as master:
        yield master.settings()


def hybrid(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The hybrid model's table (recompute, its own hit and a CPU-tier hit, side by side), its last-line figures at
    its longest length, and its hits whose first token differs from recompute's."""
    model = build_prefill_qwen3_next(args.model_dir.with_name("prefill-qwen3-next"))
    runs = run_ways(("none", "tier"), model, args.hybrid_lengths, args.docs)
    ttft, wrong = medians(runs), mismatches(runs)
    print(f"\nhybrid linear-attention model (6 gated-delta-net layers, 2 attention layers)\n{'tokens':>7} "
          f"{'recompute':>10} {'gpu hit':>8} {'cpu tier':>9}   {'tier/recomp':>11} {'tier/gpu':>8}")
    for n in args.hybrid_lengths:
        print(f"{n:>7} " + " ".join(f"{ttft[f'{kind}/{n}'] * 1e3:>{w}.1f}" for kind, w in
                                    (("recompute", 10), ("gpu_hit", 8), ("cpu_tier", 9)))
              + f"   {paired(runs, 'cpu_tier', 'recompute', n):>11.3f} {paired(runs, 'cpu_tier', 'gpu_hit', n):>8.2f}")
    print(f"first tokens identical to recompute: {'yes' if not wrong else 'NO: ' + '; '.join(wrong)}")
    print(f"connector, hybrid CPU-tier engine: {runs['tier']['stats']}")
    wrong += unexercised(runs, ("tier", "hit_tokens"))
    at = max(args.hybrid_lengths)
    return (f" ttft_hybrid_tier_vs_recompute={paired(runs, 'cpu_tier', 'recompute', at):.3f}"
            f" ttft_hybrid_tier_vs_gpu_hit={paired(runs, 'cpu_tier', 'gpu_hit', at):.3f}"), wrong


if __name__ == "__main__":
    sys.exit(main())
