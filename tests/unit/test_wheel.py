"""The built wheel installs into a fresh venv without torch or vLLM, and there the kit checks a pure-Python
connector (the FIFO example of docs/check-your-connector.md), from Python and through the pytest plugin."""

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.kit.test_check_your_connector import examples, without_the_run

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"spec": "kvoffload/spec", "reference": "kvoffload/reference", "impl": "kvoffload/impl"}  # folder: package

NO_TORCH = """
import sys
import kvoffload.spec.kit.runners  # every module of the kit, Hypothesis and all
assert "torch" not in sys.modules and "vllm" not in sys.modules, "the kit imported torch or vLLM"
print("kit imports without torch", kvoffload.spec.SPEC_VERSION)
"""


def run(*cmd: str, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_the_kit_without_torch(tmp_path):
    # Built from a copy of the sources: setuptools' build/ in the checkout keeps modules that were moved or deleted
    # since, and would ship them.
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), cwd=src)
    (wheel,) = dist.glob("kvoffload-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    sources = {f"{package}/{path.relative_to(ROOT / folder).as_posix()}"
               for folder, package in PACKAGES.items() for path in (ROOT / folder).rglob("*.py")}
    assert shipped == sources, f"wheel lacks {sorted(sources - shipped)}, has extra {sorted(shipped - sources)}"
    assert "kvoffload/impl/testing/blackbox/vllm_0_32.py" in shipped  # opt-in test tooling ships (as zarr.testing)
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    run(python, "-m", "pip", "install", "--quiet", f"{wheel}[kit]", "pytest")
    assert "torch" not in run(python, "-m", "pip", "list")

    project = tmp_path / "project"
    project.mkdir()
    fifo, _broken, _gpu_modes, conftest, test = examples()
    (project / "my_connectors.py").write_text(without_the_run(fifo))
    (project / "conftest.py").write_text(conftest)
    (project / "test_conformance.py").write_text(test)
    assert "kit imports without torch" in run(python, "-c", NO_TORCH, cwd=project)
    run(python, "-c", fifo, cwd=project)  # the example as written: run_conformance in the pr profile
    out = run(python, "-m", "pytest", "-q", "--kvoffload-profile=pr", "-p", "no:cacheprovider", cwd=project)
    assert "2 passed" in out and "kvoffload kit coverage" in out
