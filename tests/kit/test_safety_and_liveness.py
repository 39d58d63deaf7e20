"""Safety holds at every step, liveness eventually: a cautious connector passes, with its over-delay reported; one
that never releases fails under the liveness heading, not the safety one."""

import pytest

from kvoffload.spec import SpecConnector, Violation
from kvoffload.spec.invariants import LIVENESS, SAFETY
from kvoffload.spec.kit import make_machine, run_conformance

from .connectors import (SCENARIO, DelaysEveryFree, DelaysFrees, ForgetsDelayedFrees, ForgetsTheFence,
                         FreesStoredBlocksTwice, HoldsStoredBlocks, KeepsStoredBlocks, NeverReleases, RaisesAtFinish)


def test_a_connector_that_delays_every_free_is_safe_and_its_delay_is_reported():
    coverage = run_conformance(DelaysEveryFree, SCENARIO, profile="pr")
    assert coverage.invariants["FINISH"] > 0 and coverage.invariants["RELEASE"] > 0
    # every free waited: the HOLD polls at least, one step more where no store was in flight at the finish
    assert coverage.beyond_need and min(coverage.beyond_need) >= DelaysEveryFree.HOLD
    assert "delayed frees: " in str(coverage) and f"steps held beyond need: {min(coverage.beyond_need)} ×" in str(
        coverage)


def test_a_connector_that_delays_only_while_stores_read_releases_each_free_as_soon_as_they_drained():
    coverage = run_conformance(DelaysFrees, SCENARIO, profile="pr")
    assert set(coverage.beyond_need) == {0} and coverage.beyond_need[0] > 0


def test_the_spec_frees_at_once_and_fences_its_stores():
    """The spec connector's protocol (FENCED_FREES): no free is ever delayed, so FINISH does not apply; a store
    still reading a finished request's blocks is flushed before their reuse, which the forward pass checks."""
    coverage = run_conformance(SpecConnector, SCENARIO, profile="pr")
    assert not coverage.beyond_need and "FINISH" not in coverage.invariants
    with pytest.raises(Violation) as unfenced:
        run_conformance(ForgetsTheFence, SCENARIO, profile="pr")
    assert unfenced.value.finding == "SRC" and unfenced.value.kind == "safety"


def test_findings_are_reported_under_their_kind():
    with pytest.raises(Violation) as never:
        run_conformance(NeverReleases, SCENARIO, profile="pr")
    assert never.value.finding == "RELEASE" and never.value.kind == "liveness"
    assert "] liveness · RELEASE: " in str(never.value) and "never released" in str(never.value)
    with pytest.raises(Violation) as forgets:
        run_conformance(ForgetsDelayedFrees, SCENARIO, profile="pr")
    assert forgets.value.finding == "FINISH" and forgets.value.kind == "safety"
    with pytest.raises(Violation) as raises:
        run_conformance(RaisesAtFinish, SCENARIO, profile="pr")
    assert raises.value.kind == "connector error"


def test_every_invariant_has_one_kind():
    assert not set(SAFETY) & set(LIVENESS)
    assert {Violation(name, "").kind for name in SAFETY} == {"safety"}
    assert {Violation(name, "").kind for name in LIVENESS} == {"liveness"}


def test_a_free_waits_for_both_the_connector_and_a_load_in_flight():
    """Found by pr (seed 1) when DelaysEveryFree arrived: a request finished while its load was in flight, the
    connector delayed its free too, and the world released the blocks when the load landed; the connector's later
    finished_sending then named a request with no delayed free (JOBS). Fixed: a delayed free waits for every hold."""
    state = make_machine(DelaysEveryFree, SCENARIO)()
    state.add_requests(batch=[([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 2), ([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0], 1)])
    state.step(n=1)
    state.add_requests(batch=[([0], 1)])
    state.step(n=4)
    state.invariants_hold()
    state.teardown()


def test_a_connector_that_holds_its_stores_blocks_frees_at_once_and_must_free_what_it_held():
    """PINS: the engine's pool is bound to the connector, whose references keep a finished request's blocks from
    reuse until its stores are reported; FINISH does not apply. Holding blocks for good is RELEASE, freeing what it
    did not hold is REF."""
    coverage = run_conformance(HoldsStoredBlocks, SCENARIO, profile="pr")
    assert coverage.invariants["REF"] and coverage.invariants["RELEASE"] and "FINISH" not in coverage.invariants
    assert "declares 'pins'" in coverage.skipped["FINISH, SRC ownership"]
    with pytest.raises(Violation) as keeps:
        run_conformance(KeepsStoredBlocks, SCENARIO, profile="pr")
    assert keeps.value.finding == "RELEASE" and "still holds GPU blocks" in str(keeps.value)
    with pytest.raises(Violation) as twice:
        run_conformance(FreesStoredBlocksTwice, SCENARIO, profile="pr")
    assert twice.value.finding == "REF" and "which it did not hold" in str(twice.value)
