"""Every known bug, re-created as a faulty reference variant, is caught by the kit in the active profile."""

import time

import pytest

from kvoffload.reference import TensorKV
from kvoffload.spec.kit import run_conformance

from .faulty import VARIANTS
from .scenarios import HUNT


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
def test_variant_is_caught(variant, record_property):
    start = time.perf_counter()
    with pytest.raises(Exception) as caught:
        run_conformance(variant, HUNT, level="exact", kv_factory=TensorKV)
    seconds = time.perf_counter() - start
    rules = getattr(caught.value, "kvoffload_rules_run", None)
    record_property("time_to_failure_s", round(seconds, 2))
    record_property("shrunk_rules", rules)
    print(f"{variant.__name__}: caught in {seconds:.1f}s, shrunk program {rules} rules: "
          f"{str(caught.value).splitlines()[0]}")
    assert rules is not None, "the failure must come from the conformance machine"
