"""Spec, reference, production connector: every invariant, and exact equality with the spec after every rule, with
real tensor bytes on the data plane (the production worker in every KV layout vLLM hands out)."""

from functools import partial

import pytest
import torch

from kvoffload.impl import OffloadConnector
from kvoffload.impl.testing import LayeredKV
from kvoffload.reference import ReferenceConnector, TensorKV
from kvoffload.spec import SpecConnector
from kvoffload.spec.kit import run_conformance

from .scenarios import ARC_SCENARIOS, GPU_MODE_SCENARIOS, SCENARIOS

ALL = {**SCENARIOS, **GPU_MODE_SCENARIOS, **ARC_SCENARIOS}

LAYOUTS = [  # cycled over the scenarios so every layout and several dtypes meet the suite
    partial(LayeredKV, shape="kv_first", dtype=torch.bfloat16),
    partial(LayeredKV, shape="fused", dtype=torch.float16),
    partial(LayeredKV, shape="mla", dtype=torch.float32),
    partial(LayeredKV, shape="cross_layer", dtype=torch.float8_e4m3fn),
]


@pytest.mark.parametrize("name", ALL)
def test_spec_keeps_its_invariants(name):
    run_conformance(SpecConnector, ALL[name], level="invariants")


@pytest.mark.parametrize("name", [*SCENARIOS, *GPU_MODE_SCENARIOS])
def test_reference_equals_spec(name):
    run_conformance(ReferenceConnector, {**SCENARIOS, **GPU_MODE_SCENARIOS}[name], level="exact", kv_factory=TensorKV)


@pytest.mark.parametrize("i, name", list(enumerate(ALL)))
def test_impl_equals_spec(i, name):
    run_conformance(OffloadConnector, ALL[name], level="exact", kv_factory=LAYOUTS[i % len(LAYOUTS)])
