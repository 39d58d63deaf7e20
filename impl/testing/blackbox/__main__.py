"""The hunt: a vLLM connector through the kit over a grid of configurations, one line per configuration.

``python -m kvoffload.impl.testing.blackbox [--connector vllm|ours|tiering|tiering-fleet|tiering-backpressure|
simple-cpu|simple-cpu-lazy] [--past-known] [--examples N] [--groups 4,full ...] [--first]``, against the installed
vLLM (``--first``: stop at the first finding; the summary says how long it took to find).
``tiering`` is vLLM's ``TieringOffloadingSpec`` with its fs tier on a directory of its own, ``tiering-fleet`` three
engines with their fs tiers on one directory, ``tiering-backpressure`` one on a slow disk with vLLM's back-pressure
detector (each with file faults: a file removed or torn between its lookup and its read, a slow file job),
``simple-cpu`` vLLM's ``SimpleCPUOffloadConnector`` (``-lazy``: with ``lazy_offload``; it copies one GPU block per
CPU block and needs the GPU prefix cache, so its grid has neither chunks nor ``prefix_caching`` off, and one
eviction policy: its own).
``--groups`` runs models of several KV cache groups: each argument lists a model's groups, a sliding window's size
in tokens or ``full``, each optionally with ``@`` and its own block size (``8@4,full``)."""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from kvoffload.spec import Config, ConfigError, Group, Violation
from kvoffload.spec.groups import parse_groups
from kvoffload.spec.kit import Scenario, run_conformance

from . import (BlackBox, kvoffload_connector, release, vllm_offloading_connector, vllm_offloading_past_known,
               vllm_simple_cpu_connector, vllm_simple_cpu_lazy, vllm_simple_cpu_lazy_past_known,
               vllm_tiering_backpressure, vllm_tiering_connector, vllm_tiering_fleet, vllm_tiering_fleet_past_known,
               vllm_tiering_past_known)
from .tiering import clean_up

Factory = Callable[[Config], BlackBox]
FACTORIES: dict[str, tuple[Factory, Factory]] = {  # --connector: (as it is, short of its known divergences)
    "vllm": (vllm_offloading_connector, vllm_offloading_past_known),
    "ours": (kvoffload_connector, kvoffload_connector),
    "tiering": (vllm_tiering_connector, vllm_tiering_past_known),
    "tiering-fleet": (vllm_tiering_fleet, vllm_tiering_fleet_past_known),
    "tiering-backpressure": (vllm_tiering_backpressure, vllm_tiering_backpressure),
    "simple-cpu": (vllm_simple_cpu_connector, vllm_simple_cpu_connector),
    "simple-cpu-lazy": (vllm_simple_cpu_lazy, vllm_simple_cpu_lazy_past_known),
}


def main(argv: list[str] | None = None) -> int:
    """Run the hunt; 1 if any configuration failed."""
    parser = argparse.ArgumentParser(description="vLLM connectors through the kvoffload kit, in black-box mode")
    parser.add_argument("--connector", choices=tuple(FACTORIES), default="vllm",
                        help="vLLM's OffloadingConnector, our KVOffloadConnector, vLLM's tiering with its fs tier "
                             "(one engine, three on one directory, or one on a slow disk with back-pressure), or "
                             "vLLM's SimpleCPUOffloadConnector (eager or lazy)")
    parser.add_argument("--past-known", action="store_true",
                        help="drive vLLM's connector short of its known divergences (one reset between steps; for "
                             "tiering, files wiped at a reset, a CPU tier that holds a prefix whole, and in a fleet "
                             "no weight updates; for lazy SimpleCPU, a CPU tier as large as the GPU's), so that they "
                             "do not hide other findings")
    parser.add_argument("--profile", default="nightly", help="Hypothesis profile (pr, nightly, mutation)")
    parser.add_argument("--examples", type=int, default=150, help="programs per configuration")
    parser.add_argument("--chunk-blocks", type=int, nargs="+", default=[1, 2, 3], help="GPU blocks per CPU chunk")
    parser.add_argument("--groups", type=parse_groups, nargs="+", default=[parse_groups("full")],
                        help="models to run, each its KV cache groups: e.g. full (the default), 4,full, 4")
    parser.add_argument("--traces", type=Path, default=Path("kvoffload-traces"))
    parser.add_argument("--first", action="store_true", help="stop at the first finding (its program is shrunk and "
                                                              "written as always)")
    args = parser.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # the hunt's own lines, not vLLM's warnings
    factory = FACTORIES[args.connector][args.past_known]
    tiering = args.connector.startswith("tiering")
    # Past tiering's known starvations: a CPU tier that holds the longest lookup of a program whole (a resumed
    # request of 30 tokens: 14 blocks of 2), and where vLLM's LRU starves a waiting promotion, ARC.
    tiers = (15, 16, 24) if tiering and args.past_known else (1, 3, 8)
    simple = args.connector.startswith("simple-cpu")
    policies: tuple[str, ...] = ("lru", "arc")
    if simple:
        policies = ("lru",)
    elif tiering and args.past_known and release().lru_starves:
        policies = ("arc",)
    grid: list[tuple[Config, int]] = []
    refused: Counter[str] = Counter()  # why the model cannot run a configuration: how many
    for groups, k, delay, tier, prefix_caching, policy in itertools.product(
            args.groups, (1,) if simple else args.chunk_blocks, (0, 1, 3), tiers, (True,) if simple else (True, False),
            policies):
        try:
            grid.append((_config(groups, k, tier, prefix_caching, policy), delay))
        except ConfigError as error:  # a model with recurrent state needs the prefix cache, one GPU block a chunk
            refused[str(error)] += 1
    for reason, count in refused.items():
        print(f"{count} configurations not run: {reason}")
    gc.freeze()  # what is alive now (vLLM, the kit) is never garbage: each configuration's collection skips it
    try:
        n, findings, first = _run(grid, factory, args, tiering)
    finally:
        gc.unfreeze()
    for kind, lines in sorted(findings.items()):
        print(f"{kind} findings:", *lines, sep="\n  ")
    if first is not None:
        print(f"first finding after {first:.0f} s")
    failed = sum(map(len, findings.values()))
    print(f"{n - failed} of {n} configurations passed" + (f" ({len(grid) - n} not run: --first)" if n < len(grid)
                                                           else ""))
    return 1 if failed else 0


def _run(grid: list, factory: Factory, args: argparse.Namespace,
         tiering: bool) -> tuple[int, dict[str, list[str]], float | None]:
    """Each configuration of the grid, a line each: how many ran, the findings by kind, and the seconds to the
    first finding (its shrink included)."""
    findings: dict[str, list[str]] = {}  # by kind: safety, liveness, connector error, ...
    began, first = time.perf_counter(), None  # first: seconds to the first finding (its shrink included)
    for n, (config, delay) in enumerate(grid, 1):
        scenario = Scenario(config, delay=delay, failures=args.connector == "ours",
                            engines=3 if args.connector == "tiering-fleet" else 1, file_faults=tiering)
        start = time.perf_counter()
        trace = args.traces / f"{args.connector}-{n}.jsonl"
        try:
            coverage = run_conformance(factory, scenario, profile=args.profile, trace=trace,
                                       max_examples=args.examples)
            verdict = f"ok   {coverage.world['steps']} steps, {coverage.world['blocks_loaded']} blocks loaded"
        except Violation as found:  # a finding: report it and go on with the grid
            verdict = f"FAIL {str(found).splitlines()[0]} (program: {trace})"
            findings.setdefault(found.kind, []).append(f"[{n}] {found.finding}: {trace}")
            first = time.perf_counter() - began if first is None else first
        print(f"[{n}/{len(grid)}] {scenario}: {verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
        clean_up()  # its engines are gone: their files go now, not all at exit
        if findings and args.first:
            break
    return n, findings, first


def _config(groups: tuple[Group, ...], k: int, tier: int, prefix_caching: bool, policy: str) -> Config:
    return Config(num_gpu_blocks=9 * (len(groups) + 1), offload_block_size=2 * k, tier_blocks=tier,
                  prefix_caching=prefix_caching, policy=policy, groups=groups)  # groups share the GPU pool


if __name__ == "__main__":
    import sys
    import warnings

    warnings.simplefilter("ignore", category=UserWarning)  # skipped rules are listed once per run otherwise
    sys.exit(main())
