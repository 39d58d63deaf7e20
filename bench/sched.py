"""Scheduler-side cost of the production connector vs the reference, on one recorded world-model trace.

For each number of live requests, the world model runs a prefix-heavy decode workload with the spec connector and
records every scheduler-side call (lookups, allocations, batches, transfer results, finishes). The trace is then
replayed through the reference and the production connector in this process, timing only the connector's own
calls. Prints µs per step and µs per changed block (GPU block ids the batch hands the connector); last line:
``sched_ratio_vs_reference=<impl/reference>``, the worse of the ratios at 256 and 1024 live requests.
``--groups`` runs a hybrid model instead (KV cache groups as ``str(Group)`` writes them: ``512,full@32``).

    python bench/sched.py [--steps 60] [--live 16 64 256 1024] [--groups 512,full]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Sequence

from attrs import define, evolve, field

from kvoffload.impl import OffloadConnector
from kvoffload.reference import ReferenceConnector

from kvoffload.spec import Config, Executor, ListKV, SpecConnector, World
from kvoffload.spec.groups import FULL_ATTENTION, Group, parse_groups
from kvoffload.spec.records import Namespace
from kvoffload.spec.store import Store

NAMESPACE = Namespace("bench", "w", "int64", "spec", 16, 16, "chained", "0")

REQUEST_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished")
CALLS = (*REQUEST_CALLS, "build_connector_meta", "update_connector_output")


@define
class ReplayRequest:
    """What a connector reads from a request, rebuilt call by call from the trace."""

    req_id: str
    block_hashes: list[int]
    num_tokens: int = 0
    num_computed_tokens: int = 0


class Recorder:
    """Wraps the spec connector and writes down each scheduler-side call with the request state it saw."""

    def __init__(self, connector: SpecConnector, world: World) -> None:
        self.connector, self.world, self.trace = connector, world, []
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.connector, name)
        if name not in CALLS:
            return attr

        def record(*args: Any) -> Any:
            stored = (args[0].req_id, *args[1:]) if name in REQUEST_CALLS else args
            self.trace.append((name, self._requests(), stored))
            return attr(*args)
        return record

    def _requests(self) -> dict[str, tuple[int, int, int]]:
        return {r.req_id: (len(r.block_hashes), r.num_tokens, r.num_computed_tokens)
                for r in self.world.requests.values()}


def record_trace(live: int, steps: int, groups: tuple[Group, ...] = FULL_ATTENTION, seed: int = 0,
                 store: Store | None = None) -> tuple[Config, list, int, dict[str, list[int]]]:
    """The whole trace, and where its last ``steps`` steps (the measured part) begin; with ``store``, the engine's
    tier is backed by it (the spec connector's puts reach it one step after they are planned)."""
    config = Config(num_gpu_blocks=live * 40 * len(groups), block_size=16, offload_block_size=16,
                    tier_blocks=live * 24 * len(groups), token_budget=live + 4096, groups=groups)
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(3) for _ in range(256)] for _ in range(8)]
    connector = SpecConnector(config)
    world = World(config, connector, ListKV(config.num_gpu_blocks), Executor(delay=1), grouped=config.hybrid,
                  store=store)
    recorder = Recorder(connector, world)
    world.connector = recorder
    hashes: dict[str, list[int]] = {}

    def top_up() -> None:
        while len(world.requests) < live:
            prompt = rnd.choice(prefixes)[:rnd.randrange(32, 256)] + [rnd.randrange(3) for _ in range(16)]
            req = world.add_request(prompt, rnd.randrange(32, 160))
            hashes[req.req_id] = req.block_hashes  # the live list: complete at the end

    for _ in range(steps * 3):  # warm up until the batch is mostly decodes; then measure `steps` steps
        top_up()
        world.step()
    measured_from = len(recorder.trace)
    for _ in range(steps):
        top_up()
        world.step()
    return config, recorder.trace, measured_from, hashes


class KnownRecords:
    """The store as the scheduler side sees it, in the replay: which records exist, each check answered at once so
    that the replay follows its trace, and counted (a backend's hand-off of a check to its I/O threads is measured
    apart, by ``bench/sched_shared.py``). Not the world's ``Store``: its sealed records, held in this process, would
    slow every garbage collection the timed calls run, which no production scheduler process pays."""

    def __init__(self) -> None:
        self.names: set[tuple[int, int]] = set()  # (epoch, key)
        self.checks = 0  # in the measured steps

    def open(self, namespace: Namespace, payload_len: int) -> KnownRecords.View:
        return KnownRecords.View(self, namespace.epoch)

    @define
    class View:
        records: KnownRecords
        epoch: int
        counters: Counter[str] = field(factory=Counter)

        def exists(self, keys: Sequence[int]) -> list[bool]:
            return [(self.epoch, key) in self.records.names for key in keys]

        def ask(self, keys: Sequence[int]) -> Future[list[bool]]:
            self.records.checks += 1
            answer: Future[list[bool]] = Future()
            answer.set_result(self.exists(keys))
            return answer

        def put(self, records: Sequence[tuple[int, bytes]]) -> list[str]:
            self.records.names.update((self.epoch, key) for key, _payload in records)
            return ["stored"] * len(records)


def replay(connector_class: type, config: Config, trace: list, measured_from: int,
           hashes: dict[str, list[int]], store: KnownRecords | None = None) -> tuple[float, int]:
    """Seconds spent inside the connector's scheduler side over the measured steps, and changed blocks seen. With
    a ``store``, the trace was recorded with one, and the replay fills it with each plan's puts as the world's
    workers did (outside the time measured)."""
    connector = connector_class(config)
    if store is not None:
        connector.attach_shared_tier(store.open, NAMESPACE)  # type: ignore[arg-type] # the scheduler side only
    requests: dict[str, ReplayRequest] = {}
    spent, changed = 0.0, 0
    for i, (name, states, recorded) in enumerate(trace):
        for req_id, (n_hashes, n_tokens, n_computed) in states.items():
            req = requests.get(req_id) or requests.setdefault(req_id, ReplayRequest(req_id, []))
            if len(req.block_hashes) < n_hashes:
                req.block_hashes.extend(hashes[req_id][len(req.block_hashes):n_hashes])
            req.num_tokens, req.num_computed_tokens = n_tokens, n_computed
        args = (requests[recorded[0]], *recorded[1:]) if name in REQUEST_CALLS else recorded
        method = getattr(connector, name)
        measured = i >= measured_from
        if store is not None and i == measured_from:
            store.checks = 0  # count the measured steps' only
        if measured and name == "build_connector_meta":
            changed += sum(len(table) for s in args[0].scheduled for table in s.group_block_ids or (s.block_ids or (),))
        start = time.perf_counter()
        result = method(*args)
        spent += (time.perf_counter() - start) * measured
        if store is not None and name == "build_connector_meta":
            for put in result.puts:  # as the workers would, before the next step's lookups
                store.open(evolve(NAMESPACE, epoch=put.epoch), 0).put([(key, b"") for key in put.keys])
    return spent, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="scheduler-side cost, production vs reference")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--live", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--groups", type=parse_groups, default=FULL_ATTENTION,
                        help="the model's KV cache groups, e.g. 512,full@32 (default: full)")
    args = parser.parse_args(argv)
    ratios = {}
    print(f"{'live':>6} {'steps':>6} {'changed':>8} {'ref µs/step':>12} {'impl µs/step':>13} "
          f"{'ref µs/blk':>11} {'impl µs/blk':>12} {'impl/ref':>9}")
    for live in args.live:
        print(f"  recording {args.steps} steps with {live} live requests...", file=sys.stderr, flush=True)
        config, trace, measured_from, hashes = record_trace(live, args.steps, args.groups)
        ref, changed = min(replay(ReferenceConnector, config, trace, measured_from, hashes) for _ in range(3))
        impl, _ = min(replay(OffloadConnector, config, trace, measured_from, hashes) for _ in range(3))
        ratios[live] = impl / ref
        steps = args.steps
        print(f"{live:>6} {steps:>6} {changed:>8} {ref / steps * 1e6:>12.1f} {impl / steps * 1e6:>13.1f} "
              f"{ref / changed * 1e6:>11.2f} {impl / changed * 1e6:>12.2f} {impl / ref:>9.2f}", flush=True)
    for live, ratio in ratios.items():
        print(f"sched_ratio_vs_reference_{live}={ratio:.3f}")
    worst = max((ratios[n] for n in (256, 1024) if n in ratios), default=max(ratios.values()))
    print(f"sched_ratio_vs_reference={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
