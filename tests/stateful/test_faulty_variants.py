"""Every known bug, re-created as a faulty reference variant, is caught by the kit in the active profile. The
question is whether it is caught and by what, so the first failing program is not shrunk (shrinking cost 5-300x the
search; the kit's shrinking is tested in tests/kit)."""

import time
from contextlib import nullcontext

import pytest

from kvoffload.impl.testing import LayeredKV
from kvoffload.reference import TensorKV
from kvoffload.spec import ListKV, SpecConnector, Violation
from kvoffload.spec.kit import make_machine, run_conformance
from kvoffload.spec.kit.profiles import FIND_ONLY

from .faulty import (FLEET_VARIANTS, GPU_MODE_VARIANTS, HYBRID_PRODUCTION_VARIANTS, HYBRID_VARIANTS, SYNC_VARIANTS,
                     VARIANTS, StoresWhatAFailedRequestComputed)
from .scenarios import FLEET_SCENARIOS, GPU_MODE_SCENARIOS, HYBRID_SCENARIOS, SCENARIOS, SYNC_SCENARIOS

CASES = [(v, SCENARIOS[name], TensorKV) for v, name in VARIANTS.items()] + [
    (v, GPU_MODE_SCENARIOS[name], LayeredKV) for v, name in GPU_MODE_VARIANTS.items()] + [
    (v, HYBRID_SCENARIOS[name], ListKV) for v, name in HYBRID_VARIANTS.items()] + [
    (v, HYBRID_SCENARIOS[name], LayeredKV) for v, name in HYBRID_PRODUCTION_VARIANTS.items()]


@pytest.mark.parametrize("variant, scenario, kv", CASES, ids=[v.__name__ for v, _s, _k in CASES])
def test_variant_is_caught(variant, scenario, kv, record_property):
    start = time.perf_counter()
    with pytest.raises(Violation) as caught:
        run_conformance(variant, scenario, level="exact", kv_factory=kv, phases=FIND_ONLY)
    seconds = time.perf_counter() - start
    rules = caught.value.rules_run
    record_property("time_to_failure_s", round(seconds, 2))
    record_property("rules", rules)
    print(f"{variant.__name__} [{scenario}]: caught in {seconds:.1f}s, program of {rules} rules: "
          f"{str(caught.value).splitlines()[0]}")
    assert rules is not None, "the failure must come from the conformance machine"
    # a variant that no longer fits the connector it patches fails on its own mistake, not on the bug it re-creates
    assert caught.value.finding not in ("RAISED TypeError", "RAISED AttributeError"), caught.value


@pytest.mark.parametrize("variant", SYNC_VARIANTS, ids=[v.__name__ for v in SYNC_VARIANTS])
def test_sync_load_variant_is_caught_by_its_invariant(variant):
    name, invariant = SYNC_VARIANTS[variant]
    with pytest.raises(Violation) as caught:
        run_conformance(variant, SYNC_SCENARIOS[name], level="invariants", phases=FIND_ONLY)
    print(f"{variant.__name__} [{SYNC_SCENARIOS[name]}]: program of {caught.value.rules_run} rules: "
          f"{str(caught.value).splitlines()[0]}")
    assert caught.value.invariant == invariant, caught.value


@pytest.mark.parametrize("connector, caught", [(SpecConnector, False), (StoresWhatAFailedRequestComputed, True)])
def test_what_a_failed_request_computed_is_never_served(connector, caught):
    """A prompt's first half is stored; the prompt comes, its synchronous load fails, and it computes its second
    half from garbage, stores it and ends with an error; a second ask recomputes the first half and stores it; a third
    hits the whole prompt in the tier. Its second half must not be the garbage (CONTENT)."""
    state = make_machine(connector, SYNC_SCENARIOS["k1-sync-immediate-failures-no-prefix-cache"])()
    prompt = [0, 1, 2, 0, 1, 1, 2, 2, 0]
    state.add_requests(batch=[(prompt[:5], 1)])
    state.step(n=3)
    state.fail_next_transfer(worker=0)  # the next transfer is the prompt's synchronous load
    state.add_requests(batch=[(prompt, 1)])
    state.step(n=1)
    assert state.subject.stats["failed_requests"] == 1
    state.add_requests(batch=[(prompt, 1)])
    state.step(n=3)
    state.add_requests(batch=[(prompt, 2)])
    with pytest.raises(Violation, match="CONTENT") if caught else nullcontext():
        state.step(n=3)
        state.invariants_hold()
    state.teardown()


@pytest.mark.parametrize("variant", FLEET_VARIANTS, ids=[v.__name__ for v in FLEET_VARIANTS])
def test_fleet_variant_is_caught_by_its_invariant(variant):
    """The shared store's known bugs, caught without the spec's twin: by the invariant each one breaks."""
    name, invariant = FLEET_VARIANTS[variant]
    with pytest.raises(Violation) as caught:
        run_conformance(variant, FLEET_SCENARIOS[name], level="invariants", kv_factory=LayeredKV,
                        phases=FIND_ONLY)
    print(f"{variant.__name__} [{FLEET_SCENARIOS[name]}]: program of {caught.value.rules_run} rules: "
          f"{str(caught.value).splitlines()[0]}")
    assert caught.value.invariant == invariant, caught.value
