"""A failing run's JSON Lines trace replays to the same failure, in this process and from the command line."""

import functools
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.spec import Config, SpecConnector, Violation
from kvoffload.spec.invariants import ConnectorError
from kvoffload.spec.kit import run_conformance
from kvoffload.spec.kit.machine import make_machine
from kvoffload.spec.kit.profiles import FIND_ONLY
from kvoffload.spec.kit.trace import UnreplayableTrace, read_trace, replay, write_trace

from .connectors import SCENARIO, AssertsAtFinish, AssertsAtLookup, ForgetsDelayedFrees, RaisesAtFinish, asserts_past

pytestmark = pytest.mark.xdist_group("trace")  # one worker: its module fixtures run once (tests/conftest.py)


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


def test_a_trace_naming_the_kv_by_its_home_before_spec_0_7_replays(failure, tmp_path):
    """Spec 0.7 split the world model into modules: ``ListKV`` moved from ``spec.world`` to ``spec.memory``."""
    path, violation = failure
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["kv"] == "kvoffload.spec.memory:ListKV"
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join([json.dumps({**header, "kv": "kvoffload.spec.world:ListKV"}), *lines[1:]]) + "\n")
    with pytest.raises(Violation) as again:
        replay(old)
    assert str(again.value).splitlines()[0] == str(violation).splitlines()[0]


def test_replay_from_the_command_line(failure):
    path, violation = failure
    done = subprocess.run([sys.executable, "-m", "kvoffload.spec.kit.trace", str(path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert str(violation).splitlines()[0] in done.stderr


def test_replay_against_a_fixed_connector_passes(failure):
    path, _ = failure
    replay(path, adapter=SpecConnector)


def line_of(cls, text: str) -> int:
    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_two_asserts_of_the_connector_are_told_apart_by_where_they_were_raised():
    """Two bugs that both raise AssertionError: each finding names its own file, line and function."""
    found = []
    for connector in (AssertsAtFinish, AssertsAtLookup):
        with pytest.raises(ConnectorError) as caught:
            run_conformance(connector, SCENARIO, profile="pr", phases=FIND_ONLY)
        found.append(caught.value)
    assert [f.finding for f in found] == ["RAISED AssertionError"] * 2
    assert found[0].where == f"tests/kit/connectors.py:{line_of(AssertsAtFinish, 'assert request')} in " \
                             "AssertsAtFinish.request_finished"
    assert found[1].where == f"tests/kit/connectors.py:{line_of(AssertsAtLookup, 'assert request')} in " \
                             "AssertsAtLookup.get_num_new_matched_tokens"


def test_an_exception_of_the_connector_is_a_violation_that_replays(tmp_path):
    """Nothing is pinned on the connector's own exception: the kit reports a ConnectorError (RAISED) caused by it."""
    path = tmp_path / "raises.jsonl"
    with pytest.raises(ConnectorError) as caught:
        run_conformance(RaisesAtFinish, SCENARIO, profile="pr", trace=path)
    error = caught.value
    assert isinstance(error.__cause__, IndexError) and not hasattr(error.__cause__, "rules_run")
    assert error.finding == "RAISED IndexError" and "the connector raised IndexError: slot out of range" in str(error)
    assert error.where == f"tests/kit/connectors.py:{line_of(RaisesAtFinish, 'raise IndexError')} in " \
                          "RaisesAtFinish.request_finished" and f"(at {error.where})" in str(error).splitlines()[0]
    assert error.rules_run == len(error.trace) > 0 and error.coverage.examples > 0
    assert read_trace(path)[0]["failure"] == f"ConnectorError: {str(error).splitlines()[0]}"
    with pytest.raises(ConnectorError) as again:
        replay(path)
    assert str(again.value) == str(error)


SCRIPT = '''
import sys
from kvoffload.spec import Config, SpecConnector, Violation
from kvoffload.spec.kit import Scenario, run_conformance


class ForgetsTheFence(SpecConnector):
    def request_finished(self, request, block_ids):
        flush = set(self.flush_next)
        super().request_finished(request, block_ids)
        self.flush_next = flush
        return False


scenario = Scenario(Config(num_gpu_blocks=12, tier_blocks=3, prefix_caching=False), delay=2, failures=True)
try:
    run_conformance(ForgetsTheFence, scenario, profile="pr", trace=sys.argv[1])
except Violation as exc:  # the finding itself still reaches the caller
    print("FOUND", exc.invariant)
    print("\\n".join(getattr(exc, "__notes__", [])))
'''


def test_a_trace_from_a_script_is_refused_with_a_clear_message(tmp_path):
    """``python script.py``: the factory is ``__main__:...``, which no replay can import, so no trace is written and
    the Violation says why, instead of an AttributeError at replay."""
    (tmp_path / "script.py").write_text(SCRIPT)
    trace = tmp_path / "failure.jsonl"
    done = subprocess.run([sys.executable, "script.py", str(trace)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "FOUND SRC" in done.stdout
    assert ("cannot write a replayable trace: factory 'ForgetsTheFence' is defined in __main__ (a script); move "
            "it into an importable module, or pass it to replay(path, adapter=...)") in done.stdout
    assert not trace.exists()


def test_a_trace_from_a_script_run_as_a_module_names_the_module_and_replays(tmp_path):
    (tmp_path / "my_script.py").write_text(SCRIPT)
    trace = tmp_path / "failure.jsonl"
    done = subprocess.run([sys.executable, "-m", "my_script", str(trace)], cwd=tmp_path, capture_output=True,
                          text=True)
    assert "FOUND SRC" in done.stdout and "replay: python -m kvoffload.spec.kit.trace" in done.stdout, done.stderr
    assert read_trace(trace)[0]["adapter"] == "my_script:ForgetsTheFence"
    replayed = subprocess.run([sys.executable, "-m", "kvoffload.spec.kit.trace", str(trace)], cwd=tmp_path,
                              capture_output=True, text=True)
    assert replayed.returncode != 0 and "SRC: step " in replayed.stderr, replayed.stderr


def _local_factory():
    def factory(config):
        return SpecConnector(config)
    return factory


@pytest.mark.parametrize("factory, why", [
    (lambda config: SpecConnector(config), "is a lambda or is defined inside a function"),  # noqa: PLW0108 -- a lambda is the case
    (_local_factory(), "is a lambda or is defined inside a function"),
    (functools.partial(SpecConnector, Config()), "binds positional arguments"),
    (functools.partial(SpecConnector, config=Config()), "values that are not JSON"),
])
def test_a_factory_without_an_import_name_is_refused_before_anything_is_written(tmp_path, factory, why):
    violation = Violation("FINISH", "found")
    violation.trace = [("step", {"n": 1})]
    path = tmp_path / "t.jsonl"
    with pytest.raises(UnreplayableTrace, match=f"cannot write a replayable trace: factory .* {why}.*replay\\("):
        write_trace(path, make_machine(factory), violation)
    assert not path.exists()


def test_a_partial_factory_is_recorded_with_its_arguments_and_replays_with_them(tmp_path):
    """The tests' factories bind arguments (``partial(vllm_tiering_past_known, io_delay=3)``): the trace names the
    function and the keyword arguments, and replay binds them again (without them, this program passes)."""
    path = tmp_path / "t.jsonl"
    with pytest.raises(ConnectorError) as caught:
        run_conformance(functools.partial(asserts_past, longest=3), SCENARIO, profile="pr", trace=path)
    header, _program = read_trace(path)
    assert header["adapter"] == "tests.kit.connectors:asserts_past" and header["adapter_args"] == {"longest": 3}
    with pytest.raises(ConnectorError) as again:
        replay(path)
    assert str(again.value) == str(caught.value)
    replay(path, adapter=asserts_past)  # the default allows every prompt here


ROOT = Path(__file__).resolve().parents[2]
RECORD = """
import sys
from kvoffload.spec.kit import run_conformance
from tests.kit.connectors import SCENARIO, FailsInSetOrder
run_conformance(FailsInSetOrder, SCENARIO, profile="pr", trace=sys.argv[1])
"""


def test_a_trace_replays_under_the_hash_seed_it_was_recorded_with(tmp_path):
    """A program that fails only under some string hash seeds replays the same from a process of any seed: the trace
    records PYTHONHASHSEED and the replay runs again under it. Recorded without one, the replay says so."""
    path = tmp_path / "set-order.jsonl"

    def python(seed: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT)

    recorded = python("0", "-c", RECORD, str(path))
    assert "RAISED" in recorded.stderr and read_trace(path)[0]["hash_seed"] == "0", recorded.stderr[-2000:]
    finding = read_trace(path)[0]["failure"].split(": ", 1)[1]
    again = python("1", "-m", "kvoffload.spec.kit.trace", str(path))
    assert again.returncode != 0 and finding in again.stderr, again.stderr[-2000:]
    assert "replaying under PYTHONHASHSEED=0, as recorded" in again.stderr
    # the same program, its seed unknown, in a process of another seed: it passes (the pin is what replays it)
    header, rules = read_trace(path)
    path.write_text("\n".join(json.dumps(line) for line in [header | {"hash_seed": None},
                                                              *({"rule": n, "args": a} for n, a in rules)]))
    unknown = python("1", "-m", "kvoffload.spec.kit.trace", str(path))
    assert "recorded with random string hashes" in unknown.stderr and "the program passes now" in unknown.stdout
