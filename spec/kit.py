"""The conformance kit: drive any connector through the world with Hypothesis and check the invariants.

    from kvoffload.spec.kit import Scenario, run_conformance
    coverage = run_conformance(MyConnector, Scenario(Config(tier_blocks=2)), level="invariants", profile="pr")
    print(coverage)

``factory(config)`` returns an adapter: the ``Connector`` method set plus ``capabilities``, a set of names from
``kvoffload.spec.types`` (OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES). A rule or invariant that needs a
capability the adapter does not declare is skipped, and every skip is reported with its reason (a warning, and in
the returned ``Coverage``). Level "exact" also runs the spec connector in a twin world fed the same rules and
requires identical worlds and observations after every engine step. A failure is raised shrunk, with the spec
version in its message; with ``trace=`` its program is also written as JSON Lines (replay: ``kvoffload.spec.trace``).

The public API is this module's ``__all__`` and ``kvoffload.spec.trace``; it changes only with ``SPEC_VERSION``.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, cast

from attrs import define, field, fields, frozen
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from . import invariants
from .config import Config
from .connector import SpecConnector
from .invariants import SPEC_VERSION, Violation
from .types import (CAPABILITIES, CAPABILITY_METHODS, FENCED_FREES, OBSERVE, REFUSE_STORE, RESET, TRANSFER_FAILURES,
                    Refusable)
from .world import Executor, ListKV, World

__all__ = ["SPEC_VERSION", "ConformanceMachine", "Coverage", "Level", "Scenario", "SkippedRule", "capabilities_of",
           "load_profile", "make_machine", "max_tokens", "prompts", "run_conformance"]

Level = Literal["invariants", "exact"]

# ---- Hypothesis profiles: the one place settings live --------------------------------------------------------
_COMMON: dict[str, Any] = dict(deadline=None, report_multiple_bugs=False,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
_NO_EXPLAIN = [p for p in Phase if p is not Phase.explain]  # explaining a stateful failure costs minutes
settings.register_profile("pr", derandomize=True, max_examples=60, stateful_step_count=40, phases=_NO_EXPLAIN,
                          **_COMMON)
settings.register_profile("nightly", max_examples=2000, stateful_step_count=80, **_COMMON)
settings.register_profile("mutation", derandomize=True, database=None, max_examples=200, stateful_step_count=60,
                          phases=[Phase.generate], **_COMMON)
PROFILE_ENV = "HYPOTHESIS_PROFILE"


def load_profile(name: str | None = None) -> settings:
    """Load the named profile (default: $HYPOTHESIS_PROFILE, else "pr") and return it."""
    name = name or os.environ.get(PROFILE_ENV, "pr")
    settings.load_profile(name)
    return settings.get_profile(name)


# ---- public strategies -------------------------------------------------------------------------------------
SHARED_PREFIXES = ((), (0, 1, 0, 1, 2, 2), (1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1))


def prompts() -> st.SearchStrategy[list[int]]:
    """Prompts over a 3-token alphabet, often behind a shared prefix, so prefix hits are common."""
    return st.builds(lambda head, tail: [*head, *tail], st.sampled_from(SHARED_PREFIXES),
                     st.lists(st.integers(0, 2), min_size=1, max_size=8))


def max_tokens() -> st.SearchStrategy[int]:
    return st.integers(1, 10)


@frozen
class Scenario:
    """One configuration of engine, tier and environment."""

    config: Config = Config()
    delay: int = 0  # steps the environment may hold a transfer back (0: it completes at submit)
    failures: bool = False  # transfers may fail
    max_live: int = 6  # live requests at most
    broken_loads: bool = False  # a persistent fault: every load fails on the last worker (requests must finish)

    def __str__(self) -> str:
        c = self.config
        cache = "" if c.prefix_caching else " no-prefix-cache"
        timing = f"delay={self.delay}" if self.delay else "immediate"
        modes = "".join((" async" if c.async_scheduling else "", f" spec={c.num_spec_tokens}" * bool(c.num_spec_tokens),
                         f" workers={c.num_workers}" * (c.num_workers > 1), " broken-loads" * self.broken_loads))
        return (f"k={c.k} gpu={c.num_gpu_blocks}{cache} tier={c.tier_blocks} {c.policy} budget={c.token_budget} "
                f"{timing}{' failures' if self.failures else ''}{modes}")


# ---- capabilities and coverage ---------------------------------------------------------------------------
class SkippedRule(UserWarning):
    """A rule or invariant the kit could not run against this adapter: a capability it does not declare."""


def capabilities_of(adapter: Any) -> frozenset[str]:
    """The adapter's declared capabilities, checked: known names, and the methods they promise are there."""
    declared = frozenset(getattr(adapter, "capabilities", ()))
    unknown = declared - set(CAPABILITIES)
    if unknown:
        raise TypeError(f"{type(adapter).__name__} declares unknown capabilities {sorted(unknown)}; "
                        f"known: {', '.join(CAPABILITIES)}")
    missing = [f"{name} needs {method}()" for name, method in CAPABILITY_METHODS.items()
               if name in declared and not callable(getattr(adapter, method, None))]
    if missing:
        raise TypeError(f"{type(adapter).__name__} declares capabilities it lacks: {'; '.join(missing)}")
    return declared


def skipped_by(declared: frozenset[str], scenario: Scenario) -> tuple[dict[str, str], dict[str, str]]:
    """What this adapter cannot be checked for (capabilities it does not declare), and what this scenario turns off
    (a choice, not a gap), each with its reason."""
    unsupported, off = {}, {}
    if OBSERVE not in declared:
        unsupported["TRACK, REF, CURSOR"] = "the adapter does not declare 'observe' (no tracked tables, cursors, tier)"
    if REFUSE_STORE not in declared:
        unsupported["refuse_next_store"] = "the adapter does not declare 'refuse_store'"
    if FENCED_FREES in declared:
        unsupported["FINISH, SRC ownership"] = "the adapter declares 'fenced_frees' (its stores' bytes are checked)"
    if RESET not in declared:
        unsupported["reset_prefix_cache(reset_connector=True)"] = ("the adapter does not declare 'reset' (vLLM "
                                                                   "would serve stale KV after a weight update)")
    if not scenario.failures:
        off["fail_next_transfer"] = "the scenario has failures=False"
    elif TRANSFER_FAILURES not in declared:
        unsupported["fail_next_transfer"] = "the adapter does not declare 'transfer_failures'"
    if scenario.broken_loads and TRANSFER_FAILURES not in declared:
        unsupported["broken_loads"] = "the adapter does not declare 'transfer_failures'"
    if not scenario.delay:
        off["advance_transfers"] = "the scenario completes transfers at submit (delay=0)"
    return unsupported, off


@define
class Coverage:
    """What one kit run exercised: how often each rule ran, which preconditions never held, what was skipped and
    why, how often each invariant was evaluated, and what the worlds went through (steps, preemptions, hits...)."""

    rules: Counter[str] = field(factory=Counter)
    enabled: Counter[str] = field(factory=Counter)  # precondition evaluations that held, per guarded rule
    guarded: set[str] = field(factory=set)  # rules behind a precondition
    skipped: dict[str, str] = field(factory=dict)  # needs a capability the adapter does not declare (warned)
    off: dict[str, str] = field(factory=dict)  # turned off by the scenario
    invariants: Counter[str] = field(factory=Counter)
    world: Counter[str] = field(factory=Counter)
    examples: int = 0

    def never_held(self) -> list[str]:
        return sorted(r for r in self.guarded if not self.enabled[r] and r not in {*self.skipped, *self.off})

    def __str__(self) -> str:
        lines = [f"kvoffload kit coverage (spec {SPEC_VERSION}): {self.examples} programs, "
                 f"{sum(self.rules.values())} rules, {self.world['steps']} engine steps"]
        lines.append("  rules:      " + ", ".join(f"{r} {n}" for r, n in sorted(self.rules.items())))
        lines.append("  invariants: " + ", ".join(f"{i} {n}" for i, n in sorted(self.invariants.items())))
        lines.append("  world:      " + ", ".join(f"{k} {n}" for k, n in self.world.items() if k != "checks"))
        lines += [f"  never held: {r} (its precondition was always false)" for r in self.never_held()]
        lines += [f"  skipped:    {r}: {why}" for r, why in self.skipped.items()]
        lines += [f"  off:        {r}: {why}" for r, why in self.off.items()]
        return "\n".join(lines)


_GUARDED: set[str] = set()  # rules behind a precondition


def _when(name: str, predicate: Callable[[Any], Any]) -> Callable[[ConformanceMachine], bool]:
    """The precondition of rule ``name``, counting how often it held, for the coverage report."""
    _GUARDED.add(name)

    def guard(self: ConformanceMachine) -> bool:
        held = bool(predicate(self))
        self.coverage.enabled[name] += held
        return held
    return guard


# ---- what a failure carries ---------------------------------------------------------------------------------
def _record(exc: BaseException, **found: Any) -> None:
    """Attach the kit's findings to the exception it lets through, whatever its type, as ``kvoffload_<name>``."""
    for name, value in found.items():
        setattr(exc, f"kvoffload_{name}", value)


def recorded(exc: BaseException, name: str) -> Any:
    """A finding ``_record`` attached: ``rules_run``, ``trace`` (the program) or ``coverage``."""
    return getattr(exc, f"kvoffload_{name}")


# ---- the state machine -------------------------------------------------------------------------------------
class ConformanceMachine(RuleBasedStateMachine):
    """Random batches, preemptions, aborts, store refusals and transfer delays/failures against one adapter."""

    factory: Callable[[Config], Any] = SpecConnector
    kv_factory: Callable[[int], Any] = ListKV
    scenario: Scenario = Scenario()
    level: Level = "invariants"
    coverage: Coverage = Coverage()

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple[str, dict[str, Any]]] = []  # the rules run, with their arguments
        self.failed = False
        self.worlds = [self._world(self.factory, self.kv_factory)]
        self.declared = capabilities_of(self.subject.connector)
        self.coverage.skipped, self.coverage.off = skipped_by(self.declared, self.scenario)
        self.coverage.examples += 1
        if self.level == "exact":
            self.worlds.append(self._world(SpecConnector, ListKV))

    def _world(self, factory: Callable[[Config], Any], kv_factory: Callable[[int], Any]) -> World:
        """One engine: the adapter's scheduler side and worker 0, then the other workers, each with its shard."""
        config = self.scenario.config
        connector = factory(config)
        declared = capabilities_of(connector)
        world = World(config, connector, kv_factory(config.num_gpu_blocks), Executor(self.scenario.delay),
                      observable=OBSERVE in declared, fenced=FENCED_FREES in declared)
        for _ in range(config.num_workers - 1):
            world.add_worker(factory(config), kv_factory(config.num_gpu_blocks))
        world.executors[-1].fail_loads = self.scenario.broken_loads and TRANSFER_FAILURES in declared
        return world

    @property
    def subject(self) -> World:
        return self.worlds[0]

    def can(self, capability: str) -> bool:
        return capability in self.declared

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self.failed = True  # teardown must not bury this failure under a second one
            _record(exc, rules_run=len(self.trace),  # the program's length, reported per faulty variant
                    trace=list(self.trace),  # the last run Hypothesis raises from is the shrunk one
                    coverage=self.coverage)
            if not isinstance(exc, Violation):
                exc.add_note(f"[kvoffload spec {SPEC_VERSION}] raised by the connector after {len(self.trace)} rules")
            raise

    @contextmanager
    def _rule(self, name: str, **args: Any) -> Iterator[None]:
        self.trace.append((name, args))
        self.coverage.rules[name] += 1
        with self._guard():
            yield

    @rule(batch=st.lists(st.tuples(prompts(), max_tokens()), min_size=1, max_size=4))
    def add_requests(self, batch: list[tuple[list[int], int]]) -> None:
        with self._rule("add_requests", batch=batch):
            for prompt, max_tokens in batch[:self.scenario.max_live - len(self.subject.requests)]:
                for world in self.worlds:
                    world.add_request(prompt, max_tokens)

    @rule(n=st.integers(1, 6))
    def step(self, n: int) -> None:
        with self._rule("step", n=n):
            for _ in range(n):
                for world in self.worlds:
                    world.step()
                self._compare()  # after every engine step: a difference may not outlive the rule

    @precondition(_when("abort", lambda self: self.subject.requests))
    @rule(i=st.integers(0, 63))
    def abort(self, i: int) -> None:
        with self._rule("abort", i=i):
            for world in self.worlds:
                live = list(world.requests.values())
                world.abort(live[i % len(live)])

    @rule(reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        """vLLM's ``reset_prefix_cache``; with ``reset_connector`` (and the adapter's 'reset') a weight update: every
        running request is preempted, the GPU prefix cache and the connector reset, and old KV is wrong from now on."""
        weights = reset_connector and self.can(RESET)
        with self._rule("reset_prefix_cache", **({"reset_connector": True} if weights else {})):
            for world in self.worlds:
                world.update_weights() if weights else world.reset_prefix_cache()

    @precondition(_when("refuse_next_store", lambda self: self.can(REFUSE_STORE)))
    @rule()
    def refuse_next_store(self) -> None:
        with self._rule("refuse_next_store"):
            for world in self.worlds:
                cast(Refusable, world.connector).refuse_next_store()  # the precondition checked REFUSE_STORE

    @precondition(_when("advance_transfers", lambda self: self.scenario.delay and any(self.subject.in_flight())))
    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.booleans()), min_size=1, max_size=8))
    def advance_transfers(self, picks: list[tuple[int, bool]]) -> None:
        """Move picked transfers (on any worker) a stage on (execute or fail, then report), in the order given."""
        with self._rule("advance_transfers", picks=picks):
            may_fail = self.scenario.failures and self.can(TRANSFER_FAILURES)
            for world in self.worlds:
                for i, fail in picks:
                    world.advance(i, fail and may_fail)

    @precondition(_when("fail_next_transfer",
                         lambda self: self.scenario.failures and self.can(TRANSFER_FAILURES)))
    @rule(worker=st.integers(0, 3))
    def fail_next_transfer(self, worker: int = 0) -> None:
        """The next transfer one worker executes fails (on the others it may succeed)."""
        with self._rule("fail_next_transfer", worker=worker):
            for world in self.worlds:
                world.executors[worker % len(world.executors)].fail_next = True

    @invariant()
    def invariants_hold(self) -> None:
        with self._guard():
            for world in self.worlds:
                world.check()
            self._compare()

    def teardown(self) -> None:
        """Let the live requests finish (LIVENESS), then drain everything (QUIESCE)."""
        try:
            if not self.failed:
                with self._guard():
                    if self.subject.fits():
                        for world in self.worlds:
                            world.run_to_completion()
                        self._compare()
                    for world in self.worlds:
                        world.drain()
                    self._compare()
        finally:
            self.coverage.world.update(self.subject.stats)

    def _compare(self) -> None:
        """Exact level: the subject's world and observations equal the spec's, field by field."""
        if len(self.worlds) < 2:
            return
        mine, spec = self.worlds
        views = [(name, a, b) for name, a, b in zip(("requests", "delayed frees", "transfers", "events"),
                                                   mine.snapshot(), spec.snapshot())]
        if mine.observable:
            ours, theirs = mine.observe(), spec.observe()
            views += [(f.name, getattr(ours, f.name), getattr(theirs, f.name)) for f in fields(type(ours))]
        for name, a, b in views:
            if a != b:
                raise Violation("EQUIV", f"step {mine.step_no}: {name} differ\n  connector: {a}\n  spec:      {b}")


def make_machine(factory: Callable[[Config], Any], scenario: Scenario = Scenario(), level: Level = "invariants",
                 kv_factory: Callable[[int], Any] = ListKV, name: str | None = None) -> type[ConformanceMachine]:
    """A ConformanceMachine subclass bound to one adapter and one scenario (its ``TestCase`` runs it in pytest)."""
    attrs = dict(factory=staticmethod(factory), kv_factory=staticmethod(kv_factory), scenario=scenario, level=level,
                 coverage=Coverage(guarded=set(_GUARDED)))
    return type(name or f"Conformance_{getattr(factory, '__name__', 'connector')}", (ConformanceMachine,), attrs)


def run_conformance(factory: Callable[[Config], Any], scenario: Scenario = Scenario(), level: Level = "invariants",
                    kv_factory: Callable[[int], Any] = ListKV, profile: str | None = None,
                    trace: str | os.PathLike[str] | None = None, **overrides: Any) -> Coverage:
    """Run the kit against ``factory`` and return what it exercised. A failure is raised shrunk, with the spec
    version in its message; with ``trace`` its program is written there as JSON Lines first."""
    base = load_profile(profile) if profile else settings.default
    machine = make_machine(factory, scenario, level, kv_factory)
    checked_before = Counter(invariants.CHECKED)
    try:
        run_state_machine_as_test(machine, settings=settings(base, **overrides))
    except Exception as exc:
        if trace is not None and hasattr(exc, "kvoffload_trace"):
            from .trace import write_trace  # the trace module builds on this one
            write_trace(Path(trace), machine, exc)
            exc.add_note(f"program written to {trace}; replay: python -m kvoffload.spec.trace {trace}")
        raise
    finally:
        machine.coverage.invariants.update(Counter(invariants.CHECKED) - checked_before)
    for what, why in machine.coverage.skipped.items():
        warnings.warn(SkippedRule(f"kvoffload kit skipped {what}: {why}"), stacklevel=2)
    return machine.coverage
