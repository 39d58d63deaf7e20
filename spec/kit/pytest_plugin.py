"""pytest plugin (entry point ``pytest11: kvoffload``): the conformance kit as fixtures.

In your conftest.py override ``kvoffload_adapter`` (and, if you like, ``kvoffload_scenario`` / ``kvoffload_level``);
in a test call the runner:

    @pytest.fixture
    def kvoffload_adapter():
        return MyConnector  # config -> adapter

    def test_conformance(kvoffload_conformance):
        kvoffload_conformance()

``--kvoffload-profile=pr|nightly|mutation`` picks the Hypothesis profile (``kvoffload-pr``, ...; a profile of your own
by its name). ``@pytest.mark.kvoffload_slow`` runs a quarter of the profile's programs, half as long, for slow
machines. A failing run writes its shrunk program to ``--kvoffload-trace-dir`` (default ``kvoffload-traces``) as JSON
Lines; ``python -m kvoffload.spec.kit.trace FILE`` replays it. Coverage of every run is printed at the end of the
session.

Nothing here imports Hypothesis until a kit fixture is used or a profile is asked for: pytest loads this plugin
wherever kvoffload is installed (and so imports the ``kvoffload.spec.kit`` package, which imports nothing eagerly).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from .machine import Level

COVERAGE = "kvoffload_coverage"  # a user property of the test's report: it reaches the summary under xdist too


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvoffload", "kvoffload conformance kit")
    group.addoption("--kvoffload-profile", default=None, metavar="NAME",
                    help="Hypothesis profile for kit runs: pr, nightly, mutation (kvoffload-pr, ...) or one of "
                         "yours (default: the profile Hypothesis has loaded)")
    group.addoption("--kvoffload-trace-dir", default="kvoffload-traces",
                    help="where failing kit runs write their shrunk program (JSON Lines)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvoffload_slow: run the kit at a quarter of the profile's programs, "
                                       "half as long each (slow machines)")
    name = config.getoption("kvoffload_profile")
    if name:
        from hypothesis.errors import InvalidArgument

        from .profiles import load_profile
        try:
            load_profile(name)
        except InvalidArgument as exc:
            raise pytest.UsageError(f"--kvoffload-profile={name}: {exc}") from None


@pytest.fixture
def kvoffload_adapter() -> Callable[[Any], Any]:
    """Override in your conftest.py: return ``config -> adapter`` (your connector class, usually)."""
    raise pytest.UsageError("override the kvoffload_adapter fixture in your conftest.py: "
                            "return a callable taking a kvoffload.spec.Config and returning your connector")


@pytest.fixture
def kvoffload_scenario() -> Any:
    from .scenario import Scenario
    return Scenario()


@pytest.fixture
def kvoffload_level() -> Level:
    return "invariants"


@pytest.fixture
def kvoffload_conformance(request: pytest.FixtureRequest, kvoffload_adapter: Callable[[Any], Any],
                          kvoffload_scenario: Any, kvoffload_level: Level) -> Callable[..., Any]:
    """Runs the kit against ``kvoffload_adapter``; keyword arguments override Hypothesis settings."""
    from hypothesis import settings

    from .runners import run_conformance

    def run(**overrides: Any) -> Any:
        if request.node.get_closest_marker("kvoffload_slow"):
            base = settings.default
            assert base is not None, "Hypothesis loads a settings profile on import"
            overrides = {"max_examples": max(1, base.max_examples // 4),
                         "stateful_step_count": max(1, base.stateful_step_count // 2), **overrides}
        trace = Path(request.config.getoption("kvoffload_trace_dir")) / f"{request.node.name}.jsonl"
        coverage = run_conformance(kvoffload_adapter, kvoffload_scenario, kvoffload_level, trace=trace, **overrides)
        request.node.user_properties.append((COVERAGE, str(coverage)))
        return coverage
    return run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reports = [(report.nodeid, value) for outcome in ("passed", "failed")
               for report in terminalreporter.stats.get(outcome, []) if getattr(report, "when", None) == "call"
               for name, value in report.user_properties if name == COVERAGE]
    if reports:
        terminalreporter.section("kvoffload kit coverage")
        for nodeid, coverage in sorted(reports):
            terminalreporter.write_line(f"{nodeid}\n{coverage}")
