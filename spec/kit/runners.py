"""``run_conformance``: the kit against one adapter in one scenario, under a Hypothesis profile."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from .. import invariants
from ..config import Config
from ..invariants import Violation
from ..world import ListKV
from .coverage import Coverage
from .machine import Level, make_machine
from .profiles import get_profile, project_independent
from .scenario import DEFAULT_SCENARIO, Scenario, SkippedRule
from .trace import UnreplayableTrace, write_trace


def run_conformance(factory: Callable[[Config], Any], scenario: Scenario = DEFAULT_SCENARIO,
                    level: Level = "invariants", kv_factory: Callable[[int], Any] = ListKV, profile: str | None = None,
                    trace: str | os.PathLike[str] | None = None, **overrides: Any) -> Coverage:
    """Run the kit against ``factory`` and return what it exercised. A failure is raised shrunk as a ``Violation``
    (an exception of the connector's own as ``ConnectorError``), with the spec version in its message; with
    ``trace`` its program is written there as JSON Lines first. ``profile`` ("pr", "nightly", "mutation" or any
    registered name) is used for this run only; without it, Hypothesis' current default."""
    base = get_profile(profile) if profile else settings.default
    machine = make_machine(factory, scenario, level, kv_factory)
    checked_before = Counter(invariants.CHECKED)
    try:
        with project_independent():
            run_state_machine_as_test(machine, settings=settings(base, **overrides))
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
