"""The conformance kit: drive any connector through the world with Hypothesis and check the invariants.

    from kvoffload.spec.kit import Scenario, run_conformance
    run_conformance(MyConnector, Scenario(Config(tier_blocks=2)), level="invariants")

``factory(config)`` returns an object with the ``Connector`` method set. Optional capabilities, found by name:
``observe()`` (tracked tables, cursors, tier, jobs: enables TRACK, REF, CURSOR and the exact level) and
``refuse_next_store()`` (fault injection into the tier's allocator). Level "exact" also runs the spec connector in
a twin world fed the same rules and requires identical worlds and observations after every rule.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal

from attrs import fields, frozen
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from .config import Config
from .connector import SpecConnector
from .invariants import SPEC_VERSION, Violation
from .world import Executor, ListKV, World

Level = Literal["invariants", "exact"]

# ---- Hypothesis profiles: the one place settings live --------------------------------------------------------
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
               report_multiple_bugs=False)
_NO_EXPLAIN = [p for p in Phase if p is not Phase.explain]  # explaining a stateful failure costs minutes
settings.register_profile("pr", derandomize=True, max_examples=60, stateful_step_count=40, phases=_NO_EXPLAIN,
                          **_COMMON)
settings.register_profile("nightly", max_examples=2000, stateful_step_count=80, **_COMMON)
settings.register_profile("mutation", derandomize=True, database=None, max_examples=200, stateful_step_count=60,
                          phases=[Phase.generate], **_COMMON)
PROFILE_ENV = "HYPOTHESIS_PROFILE"


def load_profile(name: str | None = None) -> settings:
    """Load the named profile (default: $HYPOTHESIS_PROFILE, else "pr") and return it."""
    settings.load_profile(name or os.environ.get(PROFILE_ENV, "pr"))
    return settings.default


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

    def __str__(self) -> str:
        c = self.config
        cache = "" if c.prefix_caching else " no-prefix-cache"
        timing = f"delay={self.delay}" if self.delay else "immediate"
        return (f"k={c.k} gpu={c.num_gpu_blocks}{cache} tier={c.tier_blocks} {c.policy} budget={c.token_budget} "
                f"{timing}{' failures' if self.failures else ''}")


# ---- the state machine -------------------------------------------------------------------------------------
class ConformanceMachine(RuleBasedStateMachine):
    """Random batches, preemptions, aborts, store refusals and transfer delays/failures against one connector."""

    factory: Callable[[Config], Any] = SpecConnector
    kv_factory: Callable[[int], Any] = ListKV
    scenario: Scenario = Scenario()
    level: Level = "invariants"

    def __init__(self) -> None:
        super().__init__()
        self.rules_run, self.failed = 0, False
        self.worlds = [self._world(self.factory, self.kv_factory)]
        if self.level == "exact":
            self.worlds.append(self._world(SpecConnector, ListKV))

    def _world(self, factory: Callable[[Config], Any], kv_factory: Callable[[int], Any]) -> World:
        config = self.scenario.config
        connector = factory(config)
        return World(config, connector, kv_factory(config.num_gpu_blocks), Executor(self.scenario.delay),
                     observable=hasattr(connector, "observe"))

    @property
    def subject(self) -> World:
        return self.worlds[0]

    @contextmanager
    def _rule(self) -> Iterator[None]:
        self.rules_run += 1
        try:
            yield
        except Exception as exc:
            self.failed = True  # teardown must not bury this failure under a second one
            exc.kvoffload_rules_run = self.rules_run  # the program's length, reported per faulty variant
            if not isinstance(exc, Violation):
                exc.add_note(f"[kvoffload spec {SPEC_VERSION}] raised by the connector after {self.rules_run} rules")
            raise

    @rule(batch=st.lists(st.tuples(prompts(), max_tokens()), min_size=1, max_size=4))
    def add_requests(self, batch: list[tuple[list[int], int]]) -> None:
        with self._rule():
            for prompt, max_tokens in batch[:self.scenario.max_live - len(self.subject.requests)]:
                for world in self.worlds:
                    world.add_request(prompt, max_tokens)

    @rule(n=st.integers(1, 6))
    def step(self, n: int) -> None:
        with self._rule():
            for _ in range(n):
                for world in self.worlds:
                    world.step()
                self._compare()  # after every engine step: a difference may not outlive the rule

    @precondition(lambda self: self.subject.requests)
    @rule(i=st.integers(0, 63))
    def abort(self, i: int) -> None:
        with self._rule():
            for world in self.worlds:
                live = list(world.requests.values())
                world.abort(live[i % len(live)])

    @rule()
    def reset_prefix_cache(self) -> None:
        with self._rule():
            for world in self.worlds:
                world.reset_prefix_cache()

    @precondition(lambda self: hasattr(self.subject.connector, "refuse_next_store"))
    @rule()
    def refuse_next_store(self) -> None:
        with self._rule():
            for world in self.worlds:
                world.connector.refuse_next_store()

    @precondition(lambda self: self.scenario.delay and self.subject.executor.jobs)
    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.booleans()), min_size=1, max_size=8))
    def advance_transfers(self, picks: list[tuple[int, bool]]) -> None:
        """Move picked transfers a stage on (execute or fail, then report), in the order given."""
        with self._rule():
            for world in self.worlds:
                for i, fail in picks:
                    if world.executor.jobs:
                        world.executor.advance(i, fail and self.scenario.failures)

    @precondition(lambda self: self.scenario.failures)
    @rule()
    def fail_next_transfer(self) -> None:
        with self._rule():
            for world in self.worlds:
                world.executor.fail_next = True

    @invariant()
    def invariants_hold(self) -> None:
        with self._rule():
            for world in self.worlds:
                world.check()
            self._compare()

    def teardown(self) -> None:
        if self.failed:
            return
        with self._rule():
            for world in self.worlds:
                world.drain()
            self._compare()

    def _compare(self) -> None:
        """Exact level: the subject's world and observations equal the spec's, field by field."""
        if len(self.worlds) < 2:
            return
        mine, spec = self.worlds
        views = [(name, a, b) for name, a, b in zip(("requests", "delayed frees", "transfers", "events"),
                                                   mine.snapshot(), spec.snapshot())]
        if mine.observable:
            ours, theirs = mine.connector.observe(), spec.connector.observe()
            views += [(f.name, getattr(ours, f.name), getattr(theirs, f.name)) for f in fields(type(ours))]
        for name, a, b in views:
            if a != b:
                raise Violation("EQUIV", f"step {mine.step_no}: {name} differ\n  connector: {a}\n  spec:      {b}")


def make_machine(factory: Callable[[Config], Any], scenario: Scenario = Scenario(), level: Level = "invariants",
                 kv_factory: Callable[[int], Any] = ListKV, name: str | None = None) -> type[ConformanceMachine]:
    """A ConformanceMachine subclass bound to one connector and one scenario (its ``TestCase`` runs it in pytest)."""
    attrs = dict(factory=staticmethod(factory), kv_factory=staticmethod(kv_factory), scenario=scenario, level=level)
    return type(name or f"Conformance_{getattr(factory, '__name__', 'connector')}", (ConformanceMachine,), attrs)


def run_conformance(factory: Callable[[Config], Any], scenario: Scenario = Scenario(), level: Level = "invariants",
                    kv_factory: Callable[[int], Any] = ListKV, profile: str | None = None,
                    **overrides: Any) -> None:
    """Run the kit against ``factory``; raises the (shrunk) failure, with the spec version in its message."""
    base = load_profile(profile) if profile else settings.default
    machine = make_machine(factory, scenario, level, kv_factory)
    run_state_machine_as_test(machine, settings=settings(base, **overrides))
