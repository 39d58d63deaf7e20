"""Stores that pay for themselves: hit rate and time to first token under each admission policy, on vLLM's CPU engine
with a CPU tier smaller than the documents asked for (half the requests over a few hot documents, half over documents
asked once); see ``kvoffload.impl.testing.admission``. Each policy runs in its own engine process, one after the
other, the same prompts in the same order, and every first token is checked against recompute's (no connector).
Last line: ``admission_hit_rate=<threshold 2>/<every block> admission_ttft_vs_every_block=<threshold 2 / every
block> admission_stores_vs_every_block=…`` (mean TTFT; blocks written to the tier).

    python bench/admission.py [--requests 60] [--hot 4] [--document 512] [--tier-documents 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvoffload.impl.testing import preloaded
from kvoffload.impl.testing.admission import POLICIES
from kvoffload.impl.testing.ttft import build_prefill_llama


def run_policy(policy: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"{policy}: a new engine process...", file=sys.stderr, flush=True)
    done = preloaded.run([sys.executable, "-m", "kvoffload.impl.testing.admission", policy, str(model),
                          str(args.requests), str(args.hot), str(args.document), str(args.tier_documents)],
                         stdout=subprocess.PIPE, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the {policy!r} engine failed (exit status {done.returncode}); its log is above")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hit rate and TTFT under each admission policy")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--hot", type=int, default=4, help="documents asked again and again")
    parser.add_argument("--document", type=int, default=512, help="tokens per document (a multiple of 32)")
    parser.add_argument("--tier-documents", type=int, default=5, help="documents the CPU tier holds")
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/prefill-llama"))
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                        help="the policies to run (those of the last line always run)")
    args = parser.parse_args(argv)
    if args.document <= 0 or args.document % 32 or min(args.requests, args.hot, args.tier_documents) < 1:
        parser.error("--document must be a positive multiple of 32; --requests, --hot, --tier-documents at least 1")
    model = build_prefill_llama(args.model_dir)
    runs = {policy: run_policy(policy, model, args) for policy in POLICIES
            if policy in {*args.policies, "none", "every block", "threshold 2"}}
    truth = runs["none"]["tokens"]
    print(f"\n{'policy':>12} {'hit rate':>9} {'stored':>7} {'left out':>9} {'evicted':>8} {'mean TTFT':>10} "
          f"{'median':>7}   (ms; {args.requests} requests, {args.hot} hot documents of {args.document} tokens, "
          f"a tier of {args.tier_documents})")
    for policy, run in runs.items():
        hits = run.get("hit_tokens", 0) / run["prompt_tokens"]
        print(f"{policy:>12} {hits:>9.3f} {run.get('stored_blocks', 0):>7} {run.get('unadmitted_blocks', 0):>9} "
              f"{run.get('evictions', 0):>8} {statistics.mean(run['seconds']) * 1e3:>10.1f} "
              f"{statistics.median(run['seconds']) * 1e3:>7.1f}")
    wrong = [policy for policy, run in runs.items() if run["tokens"] != truth]
    print(f"\nfirst tokens identical to recompute: {'yes' if not wrong else 'NO: ' + ', '.join(wrong)}")
    every, two = runs["every block"], runs["threshold 2"]
    print(f"admission_hit_rate={two['hit_tokens'] / two['prompt_tokens']:.3f}/"
          f"{every['hit_tokens'] / every['prompt_tokens']:.3f} "
          f"admission_ttft_vs_every_block={statistics.mean(two['seconds']) / statistics.mean(every['seconds']):.3f} "
          f"admission_stores_vs_every_block={two['stored_blocks'] / max(every['stored_blocks'], 1):.3f}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
