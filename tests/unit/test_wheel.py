"""The built wheel installs into a fresh venv (no torch) and its spec and kit work there."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import kvoffload.spec
from kvoffload.spec import Config, SpecConnector
from kvoffload.spec.kit import Scenario, run_conformance
assert "torch" not in sys.modules, "kvoffload.spec imported torch"
run_conformance(SpecConnector, Scenario(Config(tier_blocks=2)), level="exact", profile="pr", max_examples=5)
print("wheel ok", kvoffload.spec.SPEC_VERSION)
"""


def run(*cmd: str, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_the_kit_without_torch(tmp_path):
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), cwd=ROOT)
    (wheel,) = dist.glob("kvoffload-*.whl")
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    run(python, "-m", "pip", "install", "--quiet", f"{wheel}[kit]")
    assert "torch" not in run(python, "-m", "pip", "list")
    assert "wheel ok" in run(python, "-c", CHECK, cwd=tmp_path)
