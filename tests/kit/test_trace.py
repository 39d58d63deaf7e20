"""A failing run's JSON Lines trace replays to the same failure, in this process and from the command line."""

import json
import subprocess
import sys

import pytest

from kvoffload.spec import SpecConnector, Violation
from kvoffload.spec.invariants import ConnectorError
from kvoffload.spec.kit import run_conformance
from kvoffload.spec.kit.trace import read_trace, replay

from .connectors import SCENARIO, ForgetsDelayedFrees, RaisesAtFinish


@pytest.fixture(scope="module")
def failure(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "forgets.jsonl"
    with pytest.raises(Violation) as caught:
        run_conformance(ForgetsDelayedFrees, SCENARIO, profile="pr", trace=path)
    return path, caught.value


def test_the_trace_is_the_shrunk_program(failure):
    path, violation = failure
    header, program = read_trace(path)
    assert header["adapter"] == "tests.kit.connectors:ForgetsDelayedFrees"
    assert header["failure"] == f"Violation: {str(violation).splitlines()[0]}"
    assert [name for name, _ in program] == [name for name, _ in violation.trace]
    assert len(program) == violation.rules_run > 0
    assert all(json.loads(line) for line in path.read_text().splitlines())  # one JSON object per line
    assert any(str(path) in note for note in violation.__notes__)


def test_replay_raises_the_same_failure(failure):
    path, violation = failure
    with pytest.raises(Violation) as again:
        replay(path)
    assert str(again.value) == str(violation)
    assert again.value.invariant == violation.invariant == "FINISH"


def test_replay_from_the_command_line(failure):
    path, violation = failure
    done = subprocess.run([sys.executable, "-m", "kvoffload.spec.kit.trace", str(path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert str(violation).splitlines()[0] in done.stderr


def test_replay_against_a_fixed_connector_passes(failure):
    path, _ = failure
    replay(path, adapter=SpecConnector)


def test_an_exception_of_the_connector_is_a_violation_that_replays(tmp_path):
    """Nothing is pinned on the connector's own exception: the kit reports a ConnectorError (RAISED) caused by it."""
    path = tmp_path / "raises.jsonl"
    with pytest.raises(ConnectorError) as caught:
        run_conformance(RaisesAtFinish, SCENARIO, profile="pr", trace=path)
    error = caught.value
    assert isinstance(error.__cause__, IndexError) and not hasattr(error.__cause__, "rules_run")
    assert error.finding == "RAISED IndexError" and "the connector raised IndexError: slot out of range" in str(error)
    assert error.rules_run == len(error.trace) > 0 and error.coverage.examples > 0
    assert read_trace(path)[0]["failure"] == f"ConnectorError: {str(error).splitlines()[0]}"
    with pytest.raises(ConnectorError) as again:
        replay(path)
    assert str(again.value) == str(error)
