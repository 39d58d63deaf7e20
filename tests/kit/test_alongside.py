"""Adapters run alongside: one exact run drives several adapters through the same programs against one spec twin. A
failure names the adapter it was found on, and its trace replays that adapter alone."""

import pytest

from kvoffload.spec import SpecConnector, Violation
from kvoffload.spec.kit import run_conformance
from kvoffload.spec.kit.profiles import FIND_ONLY
from kvoffload.spec.kit.trace import read_trace, replay
from kvoffload.spec.memory import ListKV

from .connectors import SCENARIO, DelaysFrees, RaisesAtFinish


def test_a_failure_names_the_adapter_alongside_it_was_found_on_and_replays_it_alone(tmp_path):
    path = tmp_path / "alongside.jsonl"
    with pytest.raises(Violation) as caught:
        run_conformance(SpecConnector, SCENARIO, level="exact", profile="pr", phases=FIND_ONLY, trace=path,
                        alongside=[(SpecConnector, ListKV), (RaisesAtFinish, ListKV)])
    violation = caught.value
    assert violation.invariant == "RAISED" and violation.adapter == 2
    assert "found on RaisesAtFinish, of 3 adapters run alongside" in violation.__notes__
    header, program = read_trace(path)
    assert header["adapter"] == "tests.kit.connectors:RaisesAtFinish" and header["level"] == "exact"
    assert len(program) == violation.rules_run
    with pytest.raises(Violation) as again:
        replay(path)
    assert str(again.value).splitlines()[0] == str(violation).splitlines()[0]


def test_the_first_adapters_failure_is_its_own():
    with pytest.raises(Violation) as caught:
        run_conformance(RaisesAtFinish, SCENARIO, level="exact", profile="pr", phases=FIND_ONLY,
                        alongside=[(SpecConnector, ListKV)])
    violation = caught.value
    assert violation.adapter == 0 and "found on RaisesAtFinish, of 2 adapters run alongside" in violation.__notes__


def test_adapters_alongside_declare_the_same_capabilities():
    """Their programs are the first's: a rule one of them cannot take would be skipped for all, or run on one."""
    with pytest.raises(ValueError, match="declares other capabilities"):
        run_conformance(SpecConnector, SCENARIO, level="exact", max_examples=1, alongside=[(DelaysFrees, ListKV)])


def test_adapters_alongside_share_the_twin_of_the_exact_level():
    with pytest.raises(ValueError, match="level 'exact'"):
        run_conformance(SpecConnector, SCENARIO, alongside=[(SpecConnector, ListKV)])
