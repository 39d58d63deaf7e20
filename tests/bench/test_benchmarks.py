"""Every benchmark runs, at a tiny size, and prints its figures: a benchmark that crashes fails CI. The figures
themselves come from full runs on a quiet machine (README's table), never from here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import needs_mooncake, needs_redis_server

ROOT = Path(__file__).resolve().parents[2]

# script: (tiny arguments, the name=value figures its last line gives)
BENCHMARKS = {
    "admission.py": (["--requests", "6", "--hot", "2", "--document", "64", "--tier-documents", "2", "--policies",
                      "threshold 2"],  # (and those its last line needs; threshold 3 runs the same code)
                     ["admission_ttft_vs_every_block"]),
    "convoy.py": (["--requests", "2", "--document", "64", "--rounds", "1", "--max-tokens", "2"],
                  ["convoy_throughput_vs_none", "nohit_ttft_vs_none"]),
    "cpu_copy.py": (["--repeats", "1"], ["cpu_copy_vs_memcpy"]),
    "fs_tier.py": (["--sizes-kib", "64", "--total-mib", "2", "--repeat", "1"], ["shared_tier_load_vs_raw"]),
    "gpu_check.py": (["--repeats", "1", "--warmup", "0", "--skip-tests"], []),
    "identity.py": (["--quick"], ["identity_vs_load", "fold_vs_load"]),
    "mooncake_tier.py": (["--sizes-kib", "64", "--total-mib", "2", "--repeat", "1"], ["mooncake_load_vs_raw"]),
    "redis_tier.py": (["--sizes-kib", "64", "--total-mib", "2", "--repeat", "1"], ["redis_load_vs_raw"]),
    "sched_vs_reference.py": (["--steps", "5", "--live", "16"], ["sched_ratio_vs_reference"]),
    "sched_shared.py": (["--steps", "5", "--live", "16"], ["sched_shared_tier_vs_off"]),
    "sched_vs_vllm.py": (["--steps", "5", "--live", "16"], ["sched_ratio_vs_vllm"]),
    "shadow_overhead.py": (["--requests", "4", "--rounds", "1"], ["shadow_overhead"]),
    "ttft.py": (["--lengths", "64", "--docs", "1", "--at", "64", "--hybrid", "--hybrid-lengths", "512", "--mooncake"],
                ["ttft_tier_vs_recompute", "ttft_tier_vs_gpu_hit", "ttft_sync_vs_gpu_hit", "ttft_sync_vs_own_hit",
                 "ttft_hybrid_tier_vs_gpu_hit", "ttft_mooncake_vs_recompute"]),
}


def test_every_benchmark_is_here():
    assert sorted(p.name for p in (ROOT / "bench").glob("*.py")) == sorted(BENCHMARKS)


@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_the_benchmark_runs_at_a_tiny_size(script, tmp_path):
    args, figures = BENCHMARKS[script]
    if script == "redis_tier.py":
        needs_redis_server()
    if script in ("mooncake_tier.py", "ttft.py"):
        needs_mooncake()
    if script == "gpu_check.py":
        args = [*args, "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for figure in figures:  # a number, as the README's table quotes it
        assert re.search(rf"\b{figure}=\d+(\.\d+)?\b", done.stdout), f"{script} printed no {figure}:\n{done.stdout}"
    if script == "gpu_check.py":  # without CUDA, a report that says so
        assert (tmp_path / "gpu_report.json").exists()


def test_the_convoys_control_runs_no_connector_in_both_processes():
    """``--same none``: the harness's own difference between two identical engines, the noise a figure lies in."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "convoy.py"), "--requests", "1", "--document", "32",
                           "--rounds", "1", "--max-tokens", "1", "--same", "none"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "both ways are 'none'" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["1"]]
    assert [row[1] for row in rows] == ["shared", "unique"] and all(row[8] == "0" for row in rows), done.stdout
