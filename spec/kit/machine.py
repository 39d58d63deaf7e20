"""The conformance state machine: random batches, preemptions, aborts, store refusals and transfer delays/failures,
applied alike to the adapter's world and (level "exact") to a twin world running the spec connector.

Every rule and check that needs something (a capability, a scenario switch, a state) says so once: ``needs`` on a
rule, ``declare`` for a check. Its precondition and the coverage report's skipped/off/never-held lines come from there.
"""

from __future__ import annotations

import functools
import sys
import sysconfig
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence, TypeVar, cast

from attrs import evolve, fields
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..config import Config
from ..connector import SpecConnector
from ..fleet import Fleet
from ..groups import FULL_ATTENTION
from ..invariants import ConnectorError, Violation
from ..types import (FENCED_FREES, FILES, GROUPS, OBSERVE, PINS, REFUSE_STORE, RESET, SHARED, TRANSFER_FAILURES,
                     KeepsFiles, Refusable)
from ..executor import Executor
from ..memory import ListKV
from ..store import Store
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
DELAYED_FREES = declare("FINISH, SRC ownership", unless=(FENCED_FREES, PINS), note="its stores' bytes are checked")
WEIGHT_UPDATES = declare("reset_prefix_cache(reset_connector=True)", RESET,
                         note="vLLM would serve stale KV after a weight update")
BROKEN_LOADS = declare("broken_loads", TRANSFER_FAILURES, mode="broken_loads")
HYBRID = declare("the model's KV cache groups", GROUPS, mode="hybrid",
                 note="vLLM turns its hybrid manager off: every layer gets full-attention blocks")
SHARED_STORE = declare("the fleet's shared store", SHARED, mode="store",
                       note="every engine keeps its KV to itself: nothing is shared, nothing outlives a restart")
GUARDED: set[str] = set()  # rules behind a precondition


def needs(capability: str | None = None, *, switch: str | None = None, mode: str | None = None,
          state: Callable[[ConformanceMachine], object] | None = None) -> Callable[[Rule], Rule]:
    """A rule's precondition, said once: the capability the adapter must declare, the scenario switch that must be
    on (or the mode it belongs to), the state the worlds must be in. The first two also give the rule its skipped/off
    line in the coverage report; how often the whole precondition held gives its never-held line."""
    def decorate(method: Rule) -> Rule:
        name = method.__name__
        need = declare(name, capability, switch=switch, mode=mode)
        GUARDED.add(name)

        def guard(self: ConformanceMachine) -> bool:
            held = self.allows(need) and (state is None or bool(state(self)))
            self.coverage.enabled[name] += held
            return held
        return precondition(guard)(method)
    return decorate


SPEC_DIR = Path(__file__).resolve().parents[1]  # the kit and the world: never where a connector's bug is
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def raised_at(exc: BaseException) -> str:
    """Where the connector raised ``exc``: the innermost frame of its traceback outside the kit, the world and the
    standard library (else the innermost frame: the world raised on what the connector returned), as ``file:line
    in function``, the file relative to the ``sys.path`` entry that holds it."""
    frames = [(Path(frame.f_code.co_filename).resolve(), line, frame.f_code.co_qualname)
              for frame, line in traceback.walk_tb(exc.__traceback__)]
    if not frames:
        return ""
    path, line, function = next((f for f in reversed(frames) if not f[0].is_relative_to(SPEC_DIR)
                                 and not f[0].is_relative_to(STDLIB)), frames[-1])
    roots = [Path(p).resolve() for p in sys.path if p] + [Path.cwd()]
    root = max((r for r in roots if path.is_relative_to(r)), key=lambda r: len(r.parts), default=None)
    return f"{path.relative_to(root) if root else path}:{line} in {function}"


class ConformanceMachine(RuleBasedStateMachine):
    """Random batches, preemptions, aborts, store refusals and transfer delays/failures against one adapter."""

    factory: Callable[[Config], Any] = SpecConnector
    kv_factory: Callable[[int], Any] = ListKV
    alongside: tuple[tuple[Callable[[Config], Any], Callable[[int], Any]], ...] = ()  # more adapters, level "exact"
    scenario: Scenario = Scenario()
    level: Level = "invariants"
    coverage: Coverage = Coverage()

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple[str, dict[str, Any]]] = []  # the rules run, with their arguments
        self.failed = False
        self.running = 0  # the fleet a rule is driving (``_each``): a failure there is that adapter's
        self.fleets = [self._fleet(self.factory, self.kv_factory)]
        self.declared = capabilities_of(self.subject.connector)
        for factory, kv_factory in self.alongside:  # the same programs: the same rules and checks must apply
            self.fleets.append(self._fleet(factory, kv_factory))
            if capabilities_of(self.fleets[-1].engines[0].connector) != self.declared:
                raise ValueError(f"{factory!r} declares other capabilities than {self.factory!r}: run it alone")
        self.coverage.skipped, self.coverage.off = skipped_by(self.declared, self.scenario)
        self.coverage.examples += 1
        if self.level == "exact":  # the spec's twin runs the engines the subject gets (hybrid manager, store)
            self.fleets.append(self._fleet(SpecConnector, ListKV, self.subject.grouped, self.subject.store is not None))

    def _fleet(self, factory: Callable[[Config], Any], kv_factory: Callable[[int], Any], grouped: bool | None = None,
               shared: bool | None = None) -> Fleet:
        """The scenario's engines, each built by ``_world``, sharing one store if the scenario has one. A factory
        whose engines share something of their own (vLLM's fs tier: a directory) says so with ``for_fleet()``: the
        factory of one fleet's engines, asked once per fleet."""
        s = self.scenario
        store = Store(s.store, s.store_delay, up=not s.store_dead) if s.store else None
        engines = one_fleet(factory)
        return Fleet(lambda i, w: self._world(engines, kv_factory, grouped, shared, store, s.identity(i), w), s.engines,
                     store)

    def _world(self, factory: Callable[[Config], Any], kv_factory: Callable[[int], Any], grouped: bool | None,
               shared: bool | None, store: Store | None, identity: int, weights: int = 0) -> World:
        """One engine: the adapter's scheduler side and worker 0, then the other workers, each with its shard. A
        hybrid model without GROUPS (or ``grouped`` False) runs as vLLM runs it then: one full-attention group, and
        the connector is configured with that. The fleet's store is attached to a connector that declares SHARED
        (or ``shared``)."""
        config = self.scenario.config
        connector = factory(config)
        declared = capabilities_of(connector)
        grouped = HYBRID.met(declared, self.scenario) if grouped is None else grouped
        shared = SHARED_STORE.met(declared, self.scenario) if shared is None else shared
        if self.scenario.hybrid and not grouped:
            config = evolve(config, groups=FULL_ATTENTION)
            connector = factory(config)
        world = World(config, connector, kv_factory(config.num_gpu_blocks), Executor(self.scenario.delay),
                      observable=OBSERVED.met(declared, self.scenario),
                      fenced=not DELAYED_FREES.met(declared, self.scenario),  # frees at once, stores fenced
                      grouped=grouped, store=store if shared else None, identity=identity, weights=weights)
        for _ in range(config.num_workers - 1):
            world.add_worker(factory(config), kv_factory(config.num_gpu_blocks))
        world.executors[-1].fail_loads = BROKEN_LOADS.met(declared, self.scenario)
        return world

    @property
    def subject(self) -> World:
        """The adapter's first engine."""
        return self.fleets[0].engines[0]

    def _each(self) -> Iterator[Fleet]:
        """Every fleet in turn, the adapters' then the spec twin's, noting which one runs."""
        for running, fleet in enumerate(self.fleets):
            self.running = running
            yield fleet

    def _live(self) -> list[World]:
        return [engine for engine in self.fleets[0].engines if engine.requests]

    def allows(self, need: Need) -> bool:
        """Whether this adapter and scenario give a rule or check what it needs (not the state it needs)."""
        return need.met(self.declared, self.scenario)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Every failure leaves as a Violation carrying the program that caused it; an exception of the connector's
        own becomes a ``ConnectorError`` (RAISED) caused by it."""
        self.running = 0  # until ``_each`` says which fleet runs
        try:
            yield
        except Exception as exc:
            self.failed = True  # teardown must not bury this failure under a second one
            violation = exc if isinstance(exc, Violation) else ConnectorError(exc, raised_at(exc))
            violation.rules_run = len(self.trace)  # the program's length, reported per faulty variant
            violation.adapter = self.running if self.running <= len(self.alongside) else 0  # (the twin's: the first)
            if self.alongside:
                subject = (self.factory, *(factory for factory, _ in self.alongside))[violation.adapter]
                violation.add_note(f"found on {getattr(subject, '__qualname__', subject)!s}, of "
                                   f"{len(self.alongside) + 1} adapters run alongside")
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
            self._add(batch, 0)

    def _add(self, batch: list[tuple[list[int], int]], engine: int) -> None:
        for prompt, limit in batch[:self.scenario.max_live - len(self.fleets[0].engine(engine).requests)]:
            for fleet in self._each():
                fleet.engine(engine).add_request(prompt, limit)

    @rule(n=st.integers(1, 6))
    def step(self, n: int) -> None:
        with self._rule("step", n=n):
            for _ in range(n):
                for fleet in self._each():
                    fleet.step()
                self._compare()  # after every engine step: a difference may not outlive the rule

    @needs(state=lambda self: self._live())
    @rule(i=st.integers(0, 63))
    def abort(self, i: int) -> None:
        """Abort a live request, picked by index (over every engine of a fleet)."""
        with self._rule("abort", i=i):
            for fleet in self._each():
                live = [(engine, req) for engine in fleet.engines for req in engine.requests.values()]
                engine, req = live[i % len(live)]
                engine.abort(req)

    @rule(reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        """vLLM's ``reset_prefix_cache`` (on every engine of a fleet); with ``reset_connector`` (and the adapter's
        'reset') a weight update: every running request is preempted, the GPU prefix cache and the connector reset,
        and old KV is wrong from now on."""
        weights = reset_connector and self.allows(WEIGHT_UPDATES)
        with self._rule("reset_prefix_cache", **({"reset_connector": True} if weights else {})):
            for fleet in self._each():
                for world in fleet.engines:
                    world.update_weights() if weights else world.reset_prefix_cache()

    @needs(REFUSE_STORE, state=lambda self: self._live())
    @rule(i=st.integers(0, 63))
    def refuse_next_store(self, i: int) -> None:
        """The tier refuses the next store allocation made for one live request (picked by index over the fleet),
        as a full tier would: the seed bug's trigger."""
        with self._rule("refuse_next_store", i=i):
            for fleet in self._each():
                live = [(engine, req) for engine in fleet.engines for req in engine.requests]
                engine, req_id = live[i % len(live)]
                cast(Refusable, engine.connector).refuse_next_store(req_id)  # REFUSE_STORE was checked

    @needs(switch="delay", state=lambda self: any(executor.jobs for executor in self.fleets[0].executors()))
    @rule(picks=st.lists(st.tuples(st.integers(0, 63), st.booleans()), min_size=1, max_size=8))
    def advance_transfers(self, picks: list[tuple[int, bool]]) -> None:
        """Move picked transfers (on any worker of any engine) a stage on (execute or fail, then report), in the
        order given."""
        with self._rule("advance_transfers", picks=picks):
            may_fail = self.allows(NEEDS["fail_next_transfer"])  # failures only where that rule injects them
            for fleet in self._each():
                for i, fail in picks:
                    jobs = [(executor, j) for executor in fleet.executors() for j in range(len(executor.jobs))]
                    if jobs:
                        executor, j = jobs[i % len(jobs)]
                        executor.advance(j, fail and may_fail)

    @needs(TRANSFER_FAILURES, switch="failures")
    @rule(worker=st.integers(0, 3))
    def fail_next_transfer(self, worker: int = 0) -> None:
        """The next transfer one worker (of any engine) executes fails (on the others it may succeed)."""
        with self._rule("fail_next_transfer", worker=worker):
            for fleet in self._each():
                executors = list(fleet.executors())
                executors[worker % len(executors)].fail_next = True

    @invariant()
    def invariants_hold(self) -> None:
        with self._guard():
            for fleet in self._each():
                fleet.check()
            self._compare()

    def teardown(self) -> None:
        """Let the live requests finish (PROGRESS), then drain everything (RELEASE, QUIESCE)."""
        try:
            if not self.failed:
                with self._guard():
                    if all(engine.fits() for engine in self.fleets[0].engines):
                        for fleet in self._each():
                            for engine in fleet.engines:
                                engine.run_to_completion()
                        self._compare()
                    for fleet in self._each():
                        for engine in fleet.engines:
                            engine.drain()
                    self._compare()
        finally:
            for stats in self.fleets[0].stats():
                self.coverage.world.update(stats)
            for engine in (*self.fleets[0].retired, *self.fleets[0].engines):
                self.coverage.beyond_need.update(engine.beyond_need)
            if self.fleets[0].store is not None:
                self.coverage.world.update({f"shared_{k}": n for k, n in self.fleets[0].store.counters.items()})

    def _compare(self) -> None:
        """Exact level: each adapter's engines and observations equal the spec's, field by field, and so do the
        records in their stores."""
        if self.level != "exact":
            return
        *adapters, spec = self.fleets
        for running, ours in enumerate(adapters):
            self.running = running
            self._compare_fleets(ours, spec)

    @staticmethod
    def _compare_fleets(ours: Fleet, spec: Fleet) -> None:
        for i, (mine, theirs) in enumerate(zip(ours.engines, spec.engines)):
            engine = f"engine {i}, " if len(ours.engines) > 1 else ""
            views = [(name, a, b) for name, a, b in zip(("requests", "delayed frees", "transfers", "events"),
                                                       mine.snapshot(), theirs.snapshot())]
            if mine.observable:
                seen, expected = mine.observe(), theirs.observe()
                views += [(f.name, getattr(seen, f.name), getattr(expected, f.name)) for f in fields(type(seen))]
            if ours.store is not None and spec.store is not None:
                views.append(("store records", tuple(ours.store.records), tuple(spec.store.records)))
            for name, a, b in views:
                if a != b:
                    raise Violation("EQUIV", f"{engine}step {mine.step_no}: {name} differ\n  connector: {a}\n"
                                             f"  spec:      {b}")


class FleetMachine(ConformanceMachine):
    """The conformance machine for a fleet: requests routed to any engine, one engine's weight update, crashes and
    restarts, and what happens to a shared store's records."""

    @rule(batch=st.lists(st.tuples(prompts(), max_tokens()), min_size=1, max_size=4), engine=st.integers(1, 3))
    def route_requests(self, batch: list[tuple[list[int], int]], engine: int) -> None:
        """New requests, routed to another engine than the first (``add_requests`` routes to the first)."""
        with self._rule("route_requests", batch=batch, engine=engine):
            self._add(batch, engine)

    @needs(RESET)
    @rule(engine=st.integers(0, 3))
    def update_weights_of(self, engine: int) -> None:
        """One engine's weights are updated (the others keep theirs): from now on it shares no record with them,
        and none of its old records is served to it."""
        with self._rule("update_weights_of", engine=engine):
            for fleet in self._each():
                fleet.engine(engine).update_weights()

    @needs(mode="restarts")
    @rule(engine=st.integers(0, 3))
    def restart_engine(self, engine: int) -> None:
        """One engine crashes and starts again: its requests and transfers die with it, its GPU pool and tier come
        back empty; the store keeps what it had."""
        with self._rule("restart_engine", engine=engine):
            for fleet in self._each():
                fleet.restart(engine)

    @needs(SHARED, mode="store")
    @rule(i=st.integers(0, 63), how=st.sampled_from(["vanish", "torn", "flipped"]))
    def damage_record(self, i: int, how: str) -> None:
        """A record vanishes (another replica evicted it, a TTL expired), is torn (its writer was killed
        mid-write) or has a bit flipped; one that a get in flight is about to read, if there is one (the race
        between an existence check and its get)."""
        with self._rule("damage_record", i=i, how=how):
            for fleet in self._each():
                store = cast(Store, fleet.store)
                getting = frozenset(key for executor in fleet.executors() for job in executor.jobs
                                    if job.kind == "get" and not job.executed for _b, key, _s in job.copies)
                store.vanish(i, getting) if how == "vanish" else store.damage(i, how == "torn", getting)

    @needs(SHARED, mode="store")
    @rule(event=st.sampled_from(["outage", "restart", "restart-empty", "answer", "break"]), i=st.integers(0, 63))
    def store_event(self, event: str, i: int = 0) -> None:
        """The store is unreachable for a few steps, restarts with or without its records, answers one existence
        check early (picked by index), or breaks the connection after ``i % 4`` records of the next put or get."""
        with self._rule("store_event", event=event, **({"i": i} if event in ("answer", "break") else {})):
            for fleet in self._each():
                store = cast(Store, fleet.store)
                if event == "outage":
                    store.outage(4)
                elif event == "answer":
                    store.answer_early(i)
                elif event == "break":
                    store.break_connection(i % 4)
                else:
                    store.restart(keep=event == "restart")


class FileFaults(ConformanceMachine):
    """The rule of a scenario with file faults. ``make_machine`` adds it only there, so that the programs of every
    other scenario stay what they were."""

    @needs(FILES, mode="file_faults")
    @rule(i=st.integers(0, 63), how=st.sampled_from(["vanish", "torn", "slow"]))
    def file_fault(self, i: int, how: str) -> None:
        """The next file engine ``i`` reads from below its CPU tier vanishes (a cleanup, another replica) or is torn
        (its writer was killed mid-write) between its lookup and its read, or its next file job is slow (a congested
        disk). The world is not told: what the connector cannot read back, it must recompute."""
        with self._rule("file_fault", i=i, how=how):
            cast(KeepsFiles, self.fleets[0].engine(i).connector).file_fault(i, how)


class WeightVersions(ConformanceMachine):
    """The rules of a fleet scenario with weight versions. ``make_machine`` adds them only there, so that the
    programs of every other scenario stay what they were."""

    @initialize(weights=st.lists(st.integers(0, 2), min_size=4, max_size=4))
    def update_before_serving(self, weights: list[int]) -> None:
        """Before their first request, the engines' weights are updated in place and each resets (an RL loop's
        order): every program starts with the engines one update in, on the same weights or on other ones."""
        if not self.allows(WEIGHT_UPDATES):
            return
        with self._rule("update_before_serving", weights=weights):
            for fleet in self._each():
                for engine, w in zip(fleet.engines, weights):
                    engine.update_weights(w)

    @needs(RESET, mode="weight_versions")
    @rule(engine=st.integers(0, 3), weights=st.integers(0, 2))
    def update_weights_to(self, engine: int, weights: int) -> None:
        """One engine's weights are updated in place to ``weights`` (0: its checkpoint's), then it resets: from the
        next step on, it shares records with exactly the engines that hold the same weights."""
        with self._rule("update_weights_to", engine=engine, weights=weights):
            for fleet in self._each():
                fleet.engine(engine).update_weights(weights)

    @needs(mode="restarts")
    @rule(engine=st.integers(0, 3), weights=st.integers(0, 2))
    def restart_engine(self, engine: int, weights: int = 0) -> None:
        """One engine crashes and starts again on the weights its checkpoint holds now: a fine-tune may have been
        redeployed to the same path meanwhile (same model, names and sizes; 0: the checkpoint as it was). It shares
        records with exactly the engines that hold the same weights. (It takes the place of the fleet's restart, so
        that a scenario without restarts runs the programs it ran before.)"""
        with self._rule("restart_engine", engine=engine, **({"weights": weights} if weights else {})):
            for fleet in self._each():
                fleet.restart(engine, weights)


def one_fleet(factory: Callable[[Config], Any]) -> Callable[[Config], Any]:
    """The factory of one fleet's engines: ``for_fleet()`` of a factory that has one (its engines share something
    of their own: vLLM's fs tier, a directory), given the keyword arguments a ``functools.partial`` of it binds."""
    if isinstance(factory, functools.partial) and hasattr(factory.func, "for_fleet"):
        return cast(Callable[[Config], Any], factory.func.for_fleet(*factory.args, **factory.keywords))
    return cast(Callable[[Config], Any], factory.for_fleet()) if hasattr(factory, "for_fleet") else factory


def make_machine(factory: Callable[[Config], Any], scenario: Scenario = DEFAULT_SCENARIO, level: Level = "invariants",
                 kv_factory: Callable[[int], Any] = ListKV, name: str | None = None,
                 alongside: Sequence[tuple[Callable[[Config], Any], Callable[[int], Any]]] = ()
                 ) -> type[ConformanceMachine]:
    """A ConformanceMachine subclass bound to one adapter and one scenario (its ``TestCase`` runs it in pytest).

    Every such machine is named ``Conformance`` unless ``name`` says otherwise: a derandomized profile seeds
    Hypothesis from the machine's name, and the programs a profile runs must not depend on what the factory is
    called (the trace names the adapter).

    ``alongside``: more adapters, each with its KV factory, driven through the same programs beside the first and
    compared with the same spec twin (level "exact" only: the spec runs once for all of them)."""
    if alongside and level != "exact":
        raise ValueError("adapters run alongside share the spec's twin: run them at level 'exact'")
    base: type[ConformanceMachine] = FleetMachine if scenario.engines > 1 or scenario.store else ConformanceMachine
    if scenario.file_faults:
        if level == "exact":  # the spec's twin keeps no files: it would load what the subject must recompute
            raise ValueError("file faults change what the connector can load: check them at level 'invariants'")
        base = type(base.__name__, (FileFaults, base), {}) if base is FleetMachine else FileFaults
    if scenario.weight_versions:
        base = type(base.__name__, (WeightVersions, base), {})
    guarded = {rule for rule in GUARDED if hasattr(base, rule) and NEEDS[rule].met_mode(scenario)}
    attrs = dict(factory=staticmethod(factory), kv_factory=staticmethod(kv_factory), alongside=tuple(alongside),
                 scenario=scenario, level=level, coverage=Coverage(guarded=guarded))
    return type(name or "Conformance", (base,), attrs)
