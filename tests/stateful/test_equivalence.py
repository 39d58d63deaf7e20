"""Spec, reference, production connector: every invariant, and exact equality with the spec after every rule, with
real tensor bytes on the data plane (the production worker in every KV layout vLLM hands out).

One run drives all three through each program: the reference, the production connector alongside it, and at level
"exact" the kit's twin world with the spec connector, which both are compared with and whose invariants are checked
too. Runs of each alone would repeat the spec's work and the programs' (the first test shows they are the same
programs), so there are none.
"""

from functools import partial

import pytest
import torch

from kvoffload.impl import OffloadConnector
from kvoffload.impl.testing import LayeredKV
from kvoffload.reference import ReferenceConnector, TensorKV
from kvoffload.spec import GROUPS, SpecConnector
from kvoffload.spec.kit import run_conformance

from .scenarios import ARC_SCENARIOS, FLEET_SCENARIOS, GPU_MODE_SCENARIOS, HYBRID_SCENARIOS, SCENARIOS, SYNC_SCENARIOS

MODES = {**SCENARIOS, **GPU_MODE_SCENARIOS}

LAYOUTS = [  # cycled over the scenarios so every layout and several dtypes meet the suite
    partial(LayeredKV, shape="kv_first", dtype=torch.bfloat16),
    partial(LayeredKV, shape="fused", dtype=torch.float16),
    partial(LayeredKV, shape="mla", dtype=torch.float32),
    partial(LayeredKV, shape="cross_layer", dtype=torch.float8_e4m3fn),
]


def failed_as_the_policy_says(scenario, coverage) -> None:
    """Requests end with an error only under the "fail" policy, and there, some did: their load failed."""
    assert bool(coverage.world["failed_requests"]) == (scenario.config.load_failure_policy == "fail")


def test_one_run_checks_spec_reference_and_impl_on_the_programs_each_alone_runs():
    """Why nothing here runs alone: in one exact run, the spec's twin, the reference and the production connector
    take the programs (the same examples and world counts) a run of the spec alone takes, and of the production
    connector alone, and each is checked for every invariant: three times what the spec alone checks."""
    scenario = HYBRID_SCENARIOS["hybrid-w4-only-delayed-failures"]
    alone = run_conformance(SpecConnector, scenario, level="invariants", max_examples=12)
    impl = run_conformance(OffloadConnector, scenario, level="exact", kv_factory=LAYOUTS[0], max_examples=12)
    together = run_conformance(ReferenceConnector, scenario, level="exact", max_examples=12, **both(0))
    assert together.examples == impl.examples == alone.examples and alone.world["blocks_loaded"]
    assert together.world == impl.world == alone.world
    assert together.invariants == {name: 3 * n for name, n in alone.invariants.items()}, (alone, together)


def both(i: int) -> dict:
    """The production connector alongside the reference, in the ``i``-th layout: one run, one spec twin."""
    return {"kv_factory": TensorKV, "alongside": [(OffloadConnector, LAYOUTS[i % len(LAYOUTS)])]}


@pytest.mark.parametrize("i, name", list(enumerate(SYNC_SCENARIOS)))
def test_reference_and_impl_equal_spec_with_synchronous_loads(i, name):
    """Hits loaded before the forward pass that reads them; a failed one ends every request that read its blocks."""
    coverage = run_conformance(ReferenceConnector, SYNC_SCENARIOS[name], level="exact", **both(i))
    assert coverage.world["sync_loads"] and coverage.world["blocks_loaded"]
    assert coverage.world["failed_requests"] or not SYNC_SCENARIOS[name].broken_loads


@pytest.mark.parametrize("i, name", list(enumerate(MODES)))
def test_reference_and_impl_equal_spec(i, name):
    coverage = run_conformance(ReferenceConnector, MODES[name], level="exact", **both(i))
    failed_as_the_policy_says(MODES[name], coverage)


@pytest.mark.parametrize("i, name", list(enumerate(ARC_SCENARIOS)))
def test_impl_equals_spec_with_the_arc_policy(i, name):
    """The reference implements LRU only: the production connector runs ARC alone."""
    coverage = run_conformance(OffloadConnector, ARC_SCENARIOS[name], level="exact",
                               kv_factory=LAYOUTS[i % len(LAYOUTS)])
    failed_as_the_policy_says(ARC_SCENARIOS[name], coverage)


@pytest.mark.parametrize("i, name", list(enumerate(HYBRID_SCENARIOS)))
def test_reference_and_impl_equal_spec_in_hybrid_models(i, name):
    """Every group's table, stores and loads, a sliding window's frees (fenced before reuse), hits every group can
    supply, with the engine modes mixed in."""
    scenario = HYBRID_SCENARIOS[name]
    coverage = run_conformance(ReferenceConnector, scenario, level="exact", **both(i))
    assert "the model's KV cache groups" not in coverage.skipped
    assert coverage.world["blocks_stored"] and coverage.world["blocks_loaded"]
    windowed = any(group.reach is not None for group in scenario.config.groups)
    assert bool(coverage.world["window_freed_blocks"]) == windowed
    assert bool(coverage.world["checkpoints"]) == (scenario.config.checkpoint_alignment is not None)
    failed_as_the_policy_says(scenario, coverage)


class WithoutGroups(SpecConnector):
    capabilities = SpecConnector.capabilities - {GROUPS}


def test_a_connector_without_groups_runs_hybrid_models_with_the_hybrid_manager_off():
    """As vLLM does for a connector that is not SupportsHMA: every layer full attention, one group; the coverage
    says so, and the connector still equals the spec, exactly."""
    with pytest.warns(UserWarning, match="the model's KV cache groups"):
        coverage = run_conformance(WithoutGroups, HYBRID_SCENARIOS["hybrid-w4-full-immediate"], level="exact")
    assert "the model's KV cache groups" in coverage.skipped


def test_a_connector_without_groups_keeps_the_window_of_a_model_whose_layers_all_slide():
    """vLLM keeps a model of one attention kind as it is, without SupportsHMA too: the window frees blocks while
    requests run, and the connector gets one table with null blocks in it. Nothing is skipped."""
    coverage = run_conformance(WithoutGroups, HYBRID_SCENARIOS["hybrid-w4-only-delayed-failures"], level="exact")
    assert "the model's KV cache groups" not in coverage.skipped
    assert coverage.world["window_freed_blocks"] and coverage.world["blocks_loaded"]


def _shared_as_expected(name, coverage):
    """The store was used: hits from it, or (dead) none, and every request still finished (PROGRESS ran); hits
    loaded synchronously where the config asks."""
    assert "the fleet's shared store" not in coverage.skipped
    assert coverage.invariants["PROGRESS"] > 0
    if FLEET_SCENARIOS[name].store_dead:
        assert not coverage.world["shared_hits"] and not coverage.world["shared_stored"]
    else:
        assert coverage.world["shared_hits"] > 0 and coverage.world["shared_stored"] > 0
    assert bool(coverage.world["sync_loads"]) == FLEET_SCENARIOS[name].config.sync_loads


@pytest.mark.parametrize("i, name", list(enumerate(FLEET_SCENARIOS)))
def test_reference_and_impl_equal_spec_in_fleets(i, name):
    _shared_as_expected(name, run_conformance(ReferenceConnector, FLEET_SCENARIOS[name], level="exact", **both(i)))
