"""The conformance state machine: random batches, preemptions, aborts, store refusals and transfer delays/failures,
applied alike to the adapter's world and (level "exact") to a twin world running the spec connector.

Every rule and check that needs something (a capability, a scenario switch, a state) says so once: ``needs`` on a
rule, ``declare`` for a check. Its precondition and the coverage report's skipped/off/never-held lines come from there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, TypeVar, cast

from attrs import evolve, fields
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..config import Config
from ..connector import SpecConnector
from ..groups import FULL_ATTENTION
from ..invariants import ConnectorError, Violation
from ..types import FENCED_FREES, GROUPS, OBSERVE, REFUSE_STORE, RESET, TRANSFER_FAILURES, Refusable
from ..executor import Executor
from ..memory import ListKV
from ..world import World
from .coverage import Coverage
from .scenario import DEFAULT_SCENARIO, NEEDS, Need, Scenario, capabilities_of, declare, skipped_by
from .strategies import max_tokens, prompts

Level = Literal["invariants", "exact"]
Rule = TypeVar("Rule", bound=Callable[..., None])

# What the checks beside the rules need (each rule says what it needs with ``needs``).
# Precisely what is lost without observe(): the checks on the connector's own state. TRACK and CURSOR may still run
# on what it emits (black-box mode checks each job's blocks), and are then counted on the invariants line.
OBSERVED = declare("TRACK, REF, CURSOR on the connector's own state", OBSERVE,
                   note="no tracked tables, cursors, tier to read")
DELAYED_FREES = declare("FINISH, SRC ownership", unless=FENCED_FREES, note="its stores' bytes are checked")
WEIGHT_UPDATES = declare("reset_prefix_cache(reset_connector=True)", RESET,
                         note="vLLM would serve stale KV after a weight update")
BROKEN_LOADS = declare("broken_loads", TRANSFER_FAILURES, mode="broken_loads")
HYBRID = declare("the model's KV cache groups", GROUPS, mode="hybrid",
                 note="vLLM turns its hybrid manager off: every layer gets full-attention blocks")
GUARDED: set[str] = set()  # rules behind a precondition


def needs(capability: str | None = None, *, switch: str | None = None,
          state: Callable[[ConformanceMachine], object] | None = None) -> Callable[[Rule], Rule]:
    """A rule's precondition, said once: the capability the adapter must declare, the scenario switch that must be
    on, the state the worlds must be in. The first two also give the rule its skipped/off line in the coverage
    report; how often the whole precondition held gives its never-held line."""
    def decorate(method: Rule) -> Rule:
        name = method.__name__
        need = declare(name, capability, switch=switch)
        GUARDED.add(name)

        def guard(self: ConformanceMachine) -> bool:
            held = self.allows(need) and (state is None or bool(state(self)))
            self.coverage.enabled[name] += held
            return held
        return precondition(guard)(method)
    return decorate


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
        if self.level == "exact":  # the spec's twin runs the engine the subject gets (hybrid manager on or off)
            self.worlds.append(self._world(SpecConnector, ListKV, grouped=self.subject.grouped))

    def _world(self, factory: Callable[[Config], Any], kv_factory: Callable[[int], Any],
               grouped: bool | None = None) -> World:
        """One engine: the adapter's scheduler side and worker 0, then the other workers, each with its shard. A
        hybrid model without GROUPS (or ``grouped`` False) runs as vLLM runs it then: one full-attention group, and
        the connector is configured with that."""
        config = self.scenario.config
        connector = factory(config)
        declared = capabilities_of(connector)
        grouped = HYBRID.met(declared, self.scenario) if grouped is None else grouped
        if self.scenario.hybrid and not grouped:
            config = evolve(config, groups=FULL_ATTENTION)
            connector = factory(config)
        world = World(config, connector, kv_factory(config.num_gpu_blocks), Executor(self.scenario.delay),
                      observable=OBSERVED.met(declared, self.scenario),
                      fenced=not DELAYED_FREES.met(declared, self.scenario),  # frees at once, stores fenced
                      grouped=grouped)
        for _ in range(config.num_workers - 1):
            world.add_worker(factory(config), kv_factory(config.num_gpu_blocks))
        world.executors[-1].fail_loads = BROKEN_LOADS.met(declared, self.scenario)
        return world

    @property
    def subject(self) -> World:
        return self.worlds[0]

    def allows(self, need: Need) -> bool:
        """Whether this adapter and scenario give a rule or check what it needs (not the state it needs)."""
        return need.met(self.declared, self.scenario)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Every failure leaves as a Violation carrying the program that caused it; an exception of the connector's
        own becomes a ``ConnectorError`` (RAISED) caused by it."""
        try:
            yield
        except Exception as exc:
            self.failed = True  # teardown must not bury this failure under a second one
            violation = exc if isinstance(exc, Violation) else ConnectorError(exc)
            violation.rules_run = len(self.trace)  # the program's length, reported per faulty variant
            violation.trace = list(self.trace)  # the last run Hypothesis raises from is the shrunk one
            violation.coverage = self.coverage
            if violation is exc:
                raise
            raise violation from exc

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

    @needs(state=lambda self: self.subject.requests)
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
        weights = reset_connector and self.allows(WEIGHT_UPDATES)
        with self._rule("reset_prefix_cache", **({"reset_connector": True} if weights else {})):
            for world in self.worlds:
                world.update_weights() if weights else world.reset_prefix_cache()

    @needs(REFUSE_STORE, state=lambda self: self.subject.requests)
    @rule(i=st.integers(0, 63))
    def refuse_next_store(self, i: int) -> None:
        """The tier refuses the next store allocation made for one live request (picked by index), as a full tier
        would: the seed bug's trigger."""
        with self._rule("refuse_next_store", i=i):
            for world in self.worlds:
                live = list(world.requests)
                cast(Refusable, world.connector).refuse_next_store(live[i % len(live)])  # REFUSE_STORE was checked

    @needs(switch="delay", state=lambda self: any(self.subject.in_flight()))
    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.booleans()), min_size=1, max_size=8))
    def advance_transfers(self, picks: list[tuple[int, bool]]) -> None:
        """Move picked transfers (on any worker) a stage on (execute or fail, then report), in the order given."""
        with self._rule("advance_transfers", picks=picks):
            may_fail = self.allows(NEEDS["fail_next_transfer"])  # failures only where that rule injects them
            for world in self.worlds:
                for i, fail in picks:
                    world.advance(i, fail and may_fail)

    @needs(TRANSFER_FAILURES, switch="failures")
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
        """Let the live requests finish (PROGRESS), then drain everything (RELEASE, QUIESCE)."""
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
            self.coverage.beyond_need.update(self.subject.beyond_need)

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


def make_machine(factory: Callable[[Config], Any], scenario: Scenario = DEFAULT_SCENARIO, level: Level = "invariants",
                 kv_factory: Callable[[int], Any] = ListKV, name: str | None = None) -> type[ConformanceMachine]:
    """A ConformanceMachine subclass bound to one adapter and one scenario (its ``TestCase`` runs it in pytest).

    Every such machine is named ``Conformance`` unless ``name`` says otherwise: a derandomized profile seeds
    Hypothesis from the machine's name, and the programs a profile runs must not depend on what the factory is
    called (the trace names the adapter)."""
    attrs = dict(factory=staticmethod(factory), kv_factory=staticmethod(kv_factory), scenario=scenario, level=level,
                 coverage=Coverage(guarded=set(GUARDED)))
    return type(name or "Conformance", (ConformanceMachine,), attrs)
