"""Capabilities an adapter does not declare become skipped rules with a visible reason; coverage says what ran."""

import warnings

import pytest
from attrs import evolve

from kvoffload.spec import OBSERVE, Config, SpecConnector
from kvoffload.spec.groups import Group
from kvoffload.spec.kit import Scenario, SkippedRule, capabilities_of, make_machine, run_conformance
from kvoffload.spec.kit.scenario import NEEDS, skipped_by

from .connectors import SCENARIO, DelaysFrees, Undeclared


def test_undeclared_capabilities_are_skipped_with_reasons():
    with pytest.warns(SkippedRule) as warned:
        coverage = run_conformance(Undeclared, SCENARIO, profile="pr", max_examples=10)
    messages = [str(w.message) for w in warned]
    assert any("refuse_next_store" in m and "'refuse_store'" in m for m in messages)
    assert any("TRACK, REF, CURSOR" in m and "'observe'" in m for m in messages)
    assert any("fail_next_transfer" in m and "'transfer_failures'" in m for m in messages)
    assert coverage.rules["refuse_next_store"] == coverage.rules["fail_next_transfer"] == 0
    assert coverage.invariants["CONTENT"] > 0 and coverage.invariants["TRACK"] == 0
    assert "skipped:    refuse_next_store: the adapter does not declare 'refuse_store'" in str(coverage)


def test_a_full_adapter_exercises_every_rule():
    """The spec connector with the other free protocol (delayed frees): every rule and every check runs."""
    coverage = run_conformance(DelaysFrees, SCENARIO, profile="pr", max_examples=30)
    assert coverage.skipped == {}
    assert coverage.never_held() == []
    assert all(coverage.rules[r] > 0 for r in ("add_requests", "step", "abort", "reset_prefix_cache",
                                                "refuse_next_store", "advance_transfers", "fail_next_transfer"))
    assert all(coverage.invariants[i] > 0 for i in ("TRACK", "SRC", "CONTENT", "REF", "CURSOR", "JOBS", "FINISH"))
    assert coverage.world["steps"] > 0 and coverage.examples >= 30


class NeverStores(SpecConnector):
    def _store(self, req, computed, full):
        return None  # no transfer is ever in flight, so there is nothing to advance


def test_a_precondition_that_never_holds_is_reported():
    coverage = run_conformance(NeverStores, SCENARIO, profile="pr", max_examples=10)
    assert coverage.never_held() == ["advance_transfers"]
    assert "never held: advance_transfers (its precondition was always false)" in str(coverage)


class Claims(SpecConnector):
    capabilities = frozenset({OBSERVE, "teleport"})


class ClaimsRefusals:
    capabilities = frozenset({"refuse_store"})


def test_unknown_or_unbacked_capabilities_are_errors():
    with pytest.raises(TypeError, match="unknown capabilities \\['teleport'\\]"):
        make_machine(Claims, SCENARIO)()
    with pytest.raises(TypeError, match="refuse_store needs refuse_next_store"):
        capabilities_of(ClaimsRefusals())


def test_what_the_scenario_turns_off_is_reported_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        coverage = run_conformance(DelaysFrees, Scenario(), profile="pr", max_examples=5)
    assert set(coverage.off) == {"advance_transfers", "fail_next_transfer"} and not coverage.skipped
    assert "off:        advance_transfers: the scenario completes transfers at submit (delay=0)" in str(coverage)


def test_skips_come_from_what_each_rule_and_check_declares():
    everything = Scenario(Config(groups=(Group(4), Group())), delay=1, failures=True, broken_loads=True, engines=2,
                          store=8, restarts=True, file_faults=True, weight_versions=True)
    skipped, off = skipped_by(frozenset(), everything)
    assert set(skipped) == {name for name, need in NEEDS.items() if need.capability} and not off
    assert NEEDS["refuse_next_store"].capability == "refuse_store"
    assert set(skipped_by(frozenset(), Scenario())[1]) == {name for name, need in NEEDS.items() if need.switch}


def test_file_faults_are_a_rule_of_their_scenario_only():
    """Other scenarios' programs stay what they were: the rule is not in their machine at all. Where the scenario
    asks for file faults, an adapter that keeps no files has the rule skipped, with the reason."""
    assert not hasattr(make_machine(DelaysFrees, SCENARIO), "file_fault")
    faults = evolve(SCENARIO, file_faults=True)
    assert hasattr(make_machine(DelaysFrees, faults), "file_fault")
    assert hasattr(make_machine(DelaysFrees, evolve(faults, engines=2)), "route_requests")
    with pytest.warns(SkippedRule, match="file_fault: the adapter does not declare 'files'"):
        coverage = run_conformance(DelaysFrees, faults, profile="pr", max_examples=5)
    assert coverage.rules["file_fault"] == 0 and "file_faults" not in str(coverage.off)


def test_file_faults_are_checked_at_the_invariants_level():
    with pytest.raises(ValueError, match="file faults change what the connector can load"):
        make_machine(DelaysFrees, evolve(SCENARIO, file_faults=True), level="exact")
