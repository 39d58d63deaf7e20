"""What the connector counts: the scheduler side's counters and the workers' moves, vLLM's logging intervals of them
(``KVOffloadStats``) and Prometheus (``KVOffloadPromMetrics``, ``vllm:kvoffload_<name>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# the worker's moves, and the shared store's counters (FileTier.counters, summed over the workers)
MOVED = ("bytes_stored", "bytes_loaded", "store_seconds", "load_seconds", "shared_hits", "shared_misses",
         "shared_stored", "shared_present", "shared_dropped", "shared_quarantined", "shared_errors", "shared_put_bytes",
         "shared_got_bytes", "shared_put_seconds", "shared_get_seconds", "shared_backpressure_drops")
GAUGES = ("shared_used_bytes",)  # levels: the latest value counts, never a sum
LATENCIES = {"get": "shared_get_latencies", "put": "shared_put_latencies"}  # seconds of each get, each put
COUNTERS = ("lookups", "hit_tokens", "engine_hit_tokens", "stored_blocks", "loaded_blocks", "sync_loaded_blocks",
            "failed_stores",
            "failed_loads", "alloc_failures", "evictions", "unadmitted_blocks", "shared_lookups",
            "shared_deadline_misses", "shared_got_blocks", "shared_failed_gets", "shared_put_blocks",
            "shared_reclaimed_bytes", *MOVED)


@dataclass
class KVOffloadStats(KVConnectorStats):
    """One logging interval: counter increments (hits, lookups, blocks, failures, bytes, seconds), the latest value
    of each gauge, and the seconds of each shared-tier transfer."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = {**self.data, **other.data}  # a gauge: the later interval's
        for k in {*self.data, *other.data} - set(GAUGES):
            mine, theirs = self.data.get(k), other.data.get(k)
            merged[k] = theirs if mine is None else mine if theirs is None else mine + theirs  # sums, or lists joined
        return KVOffloadStats(merged)

    def reduce(self) -> dict[str, int | float]:
        reduced = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        for direction, moved in (("store", "bytes_stored"), ("load", "bytes_loaded")):
            seconds = reduced.get(f"{direction}_seconds", 0)
            reduced[f"{direction}_GBps"] = round(reduced.get(moved, 0) / seconds / 1e9, 3) if seconds else 0.0
        for kind, name in LATENCIES.items():
            latencies = self.data.get(name) or [0.0]
            reduced[f"shared_{kind}_ms_mean"] = round(1e3 * sum(latencies) / len(latencies), 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvoffload_<name>``, labelled per engine: one counter per connector counter, the shared tier's used
    bytes as a gauge, and the seconds of its gets and puts as histograms (one observation per worker's transfer)."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def about(name: str) -> dict[str, Any]:
            return {"name": f"vllm:kvoffload_{name}", "labelnames": labelnames,
                    "documentation": f"kvoffload connector: {name.replace('_', ' ')}"}
        self.counters = {name: self._counter_cls(**about(name)) for name in COUNTERS}
        gauge, histogram = cast(Any, self._gauge_cls), cast(Any, self._histogram_cls)  # typed as any of vLLM's
        self.gauges = {name: gauge(**about(name), multiprocess_mode="mostrecent") for name in GAUGES}
        self.histograms = {name: histogram(**about(name.replace("latencies", "latency_seconds")),
                                           buckets=self.BUCKETS) for name in LATENCIES.values()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():  # vLLM's metric classes: prometheus_client's methods
            if name in self.counters and value:
                cast(Any, self.counters[name]).labels(*labels).inc(value)
            elif name in self.gauges:
                cast(Any, self.gauges[name]).labels(*labels).set(value)
            elif name in self.histograms:
                for seconds in value:
                    cast(Any, self.histograms[name]).labels(*labels).observe(seconds)
