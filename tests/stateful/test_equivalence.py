"""Spec, reference: every invariant, and the reference equal to the spec after every rule, on real tensor bytes."""

import pytest

from kvoffload.reference import ReferenceConnector, TensorKV
from kvoffload.spec import SpecConnector
from kvoffload.spec.kit import run_conformance

from .scenarios import SCENARIOS


@pytest.mark.parametrize("name", SCENARIOS)
def test_spec_keeps_its_invariants(name):
    run_conformance(SpecConnector, SCENARIOS[name], level="invariants")


@pytest.mark.parametrize("name", SCENARIOS)
def test_reference_equals_spec(name):
    run_conformance(ReferenceConnector, SCENARIOS[name], level="exact", kv_factory=TensorKV)
