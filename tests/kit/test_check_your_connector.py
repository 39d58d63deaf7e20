"""The examples of docs/check-your-connector.md, run as written: the FIFO connector passes at the invariants
level, the broken one fails with a readable report."""

import re
from pathlib import Path

import pytest

from kvoffload.spec.invariants import Violation

PAGE = Path(__file__).resolve().parents[2] / "docs" / "check-your-connector.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_its_two_examples():
    assert len(examples()) == 2


def test_a_connector_with_its_own_eviction_policy_passes():
    exec(compile(examples()[0], str(PAGE), "exec"), {})


def test_a_broken_connector_fails_with_a_readable_report():
    scope: dict = {}
    exec(compile(examples()[0].replace("run_conformance(fifo", "# run_conformance(fifo"), str(PAGE), "exec"), scope)
    with pytest.raises(Violation) as failure:
        exec(compile(examples()[1], str(PAGE), "exec"), scope)
    report = str(failure.value)
    assert report.startswith("[kvoffload spec 0.2] FINISH: request r")
    assert "delay=False" in report and "store(s) in flight" in report
