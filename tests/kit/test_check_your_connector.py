"""The examples of docs/check-your-connector.md, run as written: the FIFO connector passes at the invariants
level, the broken one fails with a readable report, and the conftest + test of the pytest section pass in a
scratch project through the installed plugin."""

import re
from pathlib import Path

import pytest

from kvoffload.spec import SPEC_VERSION
from kvoffload.spec.invariants import Violation

PAGE = Path(__file__).resolve().parents[2] / "docs" / "check-your-connector.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def without_the_run(example: str) -> str:
    return example.replace("run_conformance(fifo", "# run_conformance(fifo")


def test_the_page_has_its_examples():
    assert len(examples()) == 5


def test_a_connector_with_its_own_eviction_policy_passes():
    scope: dict = {}
    exec(compile(examples()[0], str(PAGE), "exec"), scope)


def test_a_broken_connector_fails_with_a_readable_report():
    scope: dict = {}
    exec(compile(without_the_run(examples()[0]), str(PAGE), "exec"), scope)
    with pytest.raises(Violation) as failure:
        exec(compile(examples()[1], str(PAGE), "exec"), scope)
    report = str(failure.value)
    assert report.startswith(f"[kvoffload spec {SPEC_VERSION}] safety · SRC: step ")
    assert "written by the forward pass while store job" in report
    assert f"[kvoffload spec {SPEC_VERSION}] safety · SRC: step " in PAGE.read_text()  # the page's version


def test_the_fifo_connector_passes_in_the_gpu_engine_modes():
    scope: dict = {}
    exec(compile(without_the_run(examples()[0]), str(PAGE), "exec"), scope)
    exec(compile(examples()[2], str(PAGE), "exec"), scope)
    assert scope["gpu"].config.num_workers == 4 and scope["gpu"].config.async_scheduling


def test_the_pytest_section_runs_through_the_plugin(pytester):
    _, _, _, conftest, test = examples()
    pytester.makepyfile(my_connectors=without_the_run(examples()[0]), test_conformance=test)
    pytester.makeconftest(conftest)
    result = pytester.runpytest_subprocess("--kvoffload-profile=pr", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*kvoffload kit coverage*"])
