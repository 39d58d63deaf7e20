"""The pytest plugin, installed through its entry point, in a scratch project the way a connector author uses it:
fixture overridden in a conftest, ``--kvoffload-profile``, the slow marker, a JSON Lines trace that replays."""

import subprocess
import sys

MY_CONNECTORS = '''
from kvoffload.spec import Config, SpecConnector
from kvoffload.spec.tier import LRU, Tier


class FIFO(LRU):
    def touch(self, key):
        pass


def fifo_connector(config: Config) -> SpecConnector:
    return SpecConnector(config, tier=Tier(config.tier_blocks, FIFO()))


class ForgetsTheFence(SpecConnector):
    def request_finished(self, request, block_ids):
        flush = set(self.flush_next)
        super().request_finished(request, block_ids)
        self.flush_next = flush
        return False
'''

CONFTEST = '''
import pytest
from kvoffload.spec import Config
from kvoffload.spec.kit import Scenario
from my_connectors import fifo_connector


@pytest.fixture
def kvoffload_adapter():
    return fifo_connector


@pytest.fixture
def kvoffload_scenario():
    return Scenario(Config(num_gpu_blocks=12, tier_blocks=3, prefix_caching=False), delay=2, failures=True)
'''

TEST_FIFO = '''
import pytest
from hypothesis import settings


def test_profile_comes_from_the_command_line():
    assert settings.default.max_examples == settings.get_profile("kvoffload-mutation").max_examples


def test_fifo_connector(kvoffload_conformance):
    coverage = kvoffload_conformance()
    assert coverage.examples >= settings.default.max_examples


@pytest.mark.kvoffload_slow
def test_fifo_connector_on_a_slow_machine(kvoffload_conformance):
    coverage = kvoffload_conformance()
    assert settings.default.max_examples // 4 <= coverage.examples < settings.default.max_examples // 2
'''

TEST_BROKEN = '''
import pytest
from my_connectors import ForgetsTheFence


@pytest.fixture
def kvoffload_adapter():
    return ForgetsTheFence


def test_broken_connector(kvoffload_conformance):
    kvoffload_conformance()
'''


def test_the_plugin_runs_the_kit_and_writes_a_trace_that_replays(pytester):
    pytester.makepyfile(my_connectors=MY_CONNECTORS, test_fifo=TEST_FIFO, test_broken=TEST_BROKEN)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_subprocess("--kvoffload-profile=mutation", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*SRC: step * written by the forward pass while store job*",
                                 "*replay: python -m kvoffload.spec.kit.trace*",
                                 "*kvoffload kit coverage*", "test_fifo.py::test_fifo_connector",
                                 "*: * programs, * rules, * engine steps", "*safety: *CONTENT *"])
    trace = pytester.path / "kvoffload-traces" / "test_broken_connector.jsonl"
    assert trace.exists()
    failure = next(line.split("Violation: ")[1] for line in result.stdout.lines if "Violation: [kvoffload" in line)
    replayed = subprocess.run([sys.executable, "-m", "kvoffload.spec.kit.trace", str(trace)], cwd=pytester.path,
                              capture_output=True, text=True)
    assert replayed.returncode != 0
    assert failure.startswith("[kvoffload spec") and failure in replayed.stderr


def test_coverage_reaches_the_summary_from_parallel_workers(pytester):
    pytester.makepyfile(my_connectors=MY_CONNECTORS, test_fifo=TEST_FIFO)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_subprocess("--kvoffload-profile=mutation", "-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*kvoffload kit coverage*", "test_fifo.py::test_fifo_connector",
                                 "*: * programs, * rules, * engine steps", "test_fifo.py::test_fifo_connector_on_a*"])


def test_without_an_override_the_fixture_says_what_to_do(pytester):
    pytester.makepyfile(test_it="def test_it(kvoffload_conformance):\n    kvoffload_conformance()\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*override the kvoffload_adapter fixture in your conftest.py*"])
