"""``run_conformance``: the kit against one adapter in one scenario, under a Hypothesis profile."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hypothesis import seed, settings
from hypothesis.stateful import run_state_machine_as_test

from .. import invariants
from ..config import Config
from ..invariants import Violation
from ..memory import ListKV
from .coverage import Coverage
from .machine import Level, make_machine
from .profiles import get_profile, project_independent, seed_schedule
from .scenario import DEFAULT_SCENARIO, Scenario, SkippedRule
from .trace import UnreplayableTrace, write_trace


@contextmanager
def _noting_seed(s: int | None, seeds: tuple[int, ...]) -> Iterator[None]:
    try:
        yield
    except Violation as exc:
        if s is not None:
            exc.add_note(f"found under seed {s} of the profile's seed schedule {seeds}")
        raise


def run_conformance(factory: Callable[[Config], Any], scenario: Scenario = DEFAULT_SCENARIO,
                    level: Level = "invariants", kv_factory: Callable[[int], Any] = ListKV, profile: str | None = None,
                    trace: str | os.PathLike[str] | None = None,
                    alongside: Sequence[tuple[Callable[[Config], Any], Callable[[int], Any]]] = (),
                    **overrides: Any) -> Coverage:
    """Run the kit against ``factory`` and return what it exercised. A failure is raised shrunk as a ``Violation``
    (an exception of the connector's own as ``ConnectorError``), with the spec version in its message; with
    ``trace`` its program is written there as JSON Lines first. ``profile`` ("pr", "nightly", "mutation" or any
    registered name) is used for this run only; without it, Hypothesis' current default. A profile with a seed
    schedule (pr) runs its programs split over those seeds, one after the other. ``alongside``: more adapters, each
    with its KV factory, through the same programs and against the same spec twin (level "exact"; they declare what
    ``factory`` declares): one run, one spec, where separate runs would each run the spec again. A failure names the
    adapter it was found on, and its trace replays that adapter alone."""
    base = get_profile(profile) if profile else settings.default
    assert base is not None, "Hypothesis loads a settings profile on import"
    machine = make_machine(factory, scenario, level, kv_factory, alongside=alongside)
    checked_before = Counter(invariants.CHECKED)
    seeds = seed_schedule(base)
    if seeds:  # the profile's programs, split over its seeds
        overrides["max_examples"] = -(-overrides.get("max_examples", base.max_examples) // len(seeds))
    try:
        for s in seeds or (None,):
            with project_independent(), _noting_seed(s, seeds):
                run_state_machine_as_test(machine if s is None else seed(s)(machine),
                                          settings=settings(base, **overrides))
    except Violation as exc:
        if trace is not None and exc.trace is not None:
            try:
                write_trace(Path(trace), machine, exc)
            except UnreplayableTrace as problem:  # the finding still reaches the caller, the problem as its note
                exc.add_note(f"no trace written to {trace}: {problem}")
            else:
                exc.add_note(f"program written to {trace}; replay: python -m kvoffload.spec.kit.trace {trace}")
        raise
    finally:
        machine.coverage.invariants.update(Counter(invariants.CHECKED) - checked_before)
    for what, why in machine.coverage.skipped.items():
        warnings.warn(SkippedRule(f"kvoffload kit skipped {what}: {why}"), stacklevel=2)
    return machine.coverage
