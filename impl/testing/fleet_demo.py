"""Fleet demo: two vLLM engines (CPU), one after the other, each a fresh process, on one shared-tier directory.

Engine A serves a prefix-heavy workload and exits; every block it stored to its CPU tier went to the directory too.
Engine B starts afterwards with an empty GPU pool and an empty CPU tier, serves the same workload, and gets its
shared prefixes from the directory. Both print vLLM's own prompt-token accounting; the demo checks that B's outputs
equal A's (which computed everything) and that B computed fewer prompt tokens.
Run: ``python -m kvoffload.impl.testing.fleet_demo`` (``make demo-fleet``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from . import preloaded
from .demo import (build_tiny_llama, connector_config, drain, engine_prompt_tokens, make_llm, run_rounds,
                   scheduler_connector, workload)

FIGURES = ("shared_lookups", "shared_got_blocks", "shared_put_blocks", "shared_hits", "shared_stored", "shared_present",
           "shared_quarantined", "shared_dropped")


def serve(model: Path, directory: Path, requests: int, max_tokens: int) -> dict:
    """One engine, in this process: the workload once, on the shared tier in ``directory``."""
    shared = {"backend": "fs", "path": str(directory), "bytes": 1 << 30}
    llm = make_llm(model, connector_config(tier_bytes=64 << 20, offload_block_size=32, shared_tier=shared),
                   log_stats=True)
    outputs = run_rounds(llm, workload(requests, seed=0), rounds=1, max_tokens=max_tokens)
    drain(llm)  # every put counted
    stats = scheduler_connector(llm).stats()
    return {"outputs": outputs, "prompt_tokens": engine_prompt_tokens(llm), **{k: stats[k] for k in FIGURES}}


def start(name: str, model: Path, directory: Path, args: argparse.Namespace) -> dict:
    print(f"engine {name}: a new process on {directory}...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "kvoffload.impl.testing.fleet_demo", "--serve", "--model-dir", str(model),
           "--dir", str(directory), "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
    done = preloaded.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"engine {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/tiny-llama"))
    parser.add_argument("--dir", type=Path, help="the shared-tier directory (default: a new temporary one)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # one engine, in this process
    args = parser.parse_args(argv)
    if args.serve:
        print("RESULT " + json.dumps(serve(args.model_dir, args.dir, args.requests, args.max_tokens)), flush=True)
        return 0
    model = build_tiny_llama(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="kvoffload-fleet-") as scratch:
        directory = args.dir or Path(scratch)
        runs = {name: start(name, model, directory, args) for name in ("A", "B")}
    print("\nFleet demo: engine B starts after engine A exited, on the same shared-tier directory\n")
    rows = [("prompt tokens computed by the engine", "local_compute"), ("  from its GPU prefix cache",
            "local_cache_hit"), ("  from the connector (via the shared tier)", "external_kv_transfer")]
    width = max(len(r[0]) for r in rows + [(f, "") for f in FIGURES])
    print(f"  {'':<{width}}  {'A':>8}  {'B':>8}")
    for label, source in rows:
        print(f"  {label:<{width}}  {runs['A']['prompt_tokens'][source]:>8}  {runs['B']['prompt_tokens'][source]:>8}")
    for figure in FIGURES:
        print(f"  {figure:<{width}}  {int(runs['A'][figure]):>8}  {int(runs['B'][figure]):>8}")
    identical = runs["A"]["outputs"] == runs["B"]["outputs"]
    saved = runs["A"]["prompt_tokens"]["local_compute"] - runs["B"]["prompt_tokens"]["local_compute"]
    served = runs["B"]["prompt_tokens"]["external_kv_transfer"]
    print(f"\noutputs identical: {'yes' if identical else 'NO'}; engine B got {served} prompt tokens from the shared "
          f"tier and computed {saved} fewer than engine A")
    return 0 if identical and served > 0 and saved > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
