"""Time to first token on vLLM's CPU engine: recompute, the engine's own prefix-cache hit, a hit from our CPU tier,
and a hit from the shared tier (a directory another engine wrote), one request at a time, over a sweep of document
lengths, and the first ask of a document while the connector stores it (CPU tier) or puts it too (shared tier); see
``kvoffload.impl.testing.ttft`` for how each is measured. Each way runs in its own engine process, one after the
other in this run; the ratios are of medians at the same length. Every hit's first token is checked against
recompute's, and every prefix-cache reset against vLLM's answer. Last line, at ``--at`` tokens:
``ttft_tier_vs_recompute=… ttft_tier_vs_gpu_hit=… ttft_shared_vs_recompute=… ttft_storing_vs_recompute=…
ttft_putting_vs_recompute=…``.
Goals at 2048 tokens: a CPU-tier hit ≤ 0.05 × recompute and ≤ 1.1 × the engine's own hit; a shared-tier hit
≤ 0.2 × recompute.

    python bench/ttft.py [--lengths 512 1024 2048 4096] [--docs 4] [--at 2048]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvoffload.impl.testing.ttft import WAYS, build_prefill_llama, medians, mismatches, run_way


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time to first token: recompute, GPU hit, CPU-tier hit, shared hit")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="document lengths in tokens (multiples of 32)")
    parser.add_argument("--docs", type=int, default=4, help="documents measured per length")
    parser.add_argument("--at", type=int, default=2048, help="the length the last line reports")
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/prefill-llama"))
    args = parser.parse_args(argv)
    if args.at not in args.lengths or any(n <= 0 or n % 32 for n in args.lengths):
        parser.error(f"--lengths must be positive multiples of 32 and include --at {args.at}")
    model = build_prefill_llama(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="kvoffload-ttft-") as directory:
        runs = {way: run_way(way, model, args.lengths, args.docs, Path(directory)) for way in WAYS}
    ttft = medians(runs)
    print(f"\n{'tokens':>7} {'recompute':>10} {'gpu hit':>8} {'cpu tier':>9} {'shared':>8} {'storing':>8} "
          f"{'putting':>8}   {'tier/recomp':>11} {'tier/gpu':>8} {'shared/recomp':>13}   (ms, medians of {args.docs})")
    for n in args.lengths:
        row = [ttft[f"{kind}/{n}"] for kind in ("recompute", "gpu_hit", "cpu_tier", "shared_tier",
                                                "recompute_storing", "recompute_putting")]
        print(f"{n:>7} " + " ".join(f"{s * 1e3:>{w}.1f}" for s, w in zip(row, (10, 8, 9, 8, 8, 8)))
              + f"   {row[2] / row[0]:>11.3f} {row[2] / row[1]:>8.2f} {row[3] / row[0]:>13.3f}")
    wrong, resets = mismatches(runs), runs["tier"]["reset_steps"]
    print(f"\nfirst tokens identical to recompute: {'yes' if not wrong else 'NO: ' + '; '.join(wrong)}")
    print(f"prefix-cache resets: {len(resets)}, each confirmed by vLLM after {min(resets)}-{max(resets)} extra "
          f"engine steps")
    print(f"connector, CPU-tier engine: {runs['tier']['stats']}")
    print(f"connector, writing engine: {runs['writer']['stats']}")
    print(f"connector, shared-tier engine: {runs['shared']['stats']}")
    at = args.at
    print(f"ttft_tier_vs_recompute={ttft[f'cpu_tier/{at}'] / ttft[f'recompute/{at}']:.3f} "
          f"ttft_tier_vs_gpu_hit={ttft[f'cpu_tier/{at}'] / ttft[f'gpu_hit/{at}']:.3f} "
          f"ttft_shared_vs_recompute={ttft[f'shared_tier/{at}'] / ttft[f'recompute/{at}']:.3f} "
          f"ttft_storing_vs_recompute={ttft[f'recompute_storing/{at}'] / ttft[f'recompute/{at}']:.3f} "
          f"ttft_putting_vs_recompute={ttft[f'recompute_putting/{at}'] / ttft[f'recompute/{at}']:.3f}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
