"""``kv_connector_extra_config`` and vLLM's KV cache config, checked, as our ``Config``: one clear ``ConfigError`` for
anything the connector cannot run with."""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any, Callable

from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

from kvoffload.spec.config import Config, ConfigError
from kvoffload.spec.groups import Group
from kvoffload.spec.records import Namespace

from ..tiers import FileTier, SharedTier


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _positive_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


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
    "sync_loads": (lambda v: isinstance(v, bool), "a bool: hits load in the step that computes the rest (needs "
                   "kv_load_failure_policy='fail' and no async scheduling)"),
}
EXTRA_KEYS = set(EXTRA)
# shared_tier: key -> (check, what it must be, default; None: required, OPTIONAL: the backend's own default). The
# keys every backend takes, then each backend's own.
OPTIONAL = object()
Check = tuple[Callable[[object], bool], str, object]
SHARED: dict[str, Check] = {
    "backend": (lambda v: v in SHARED_BACKENDS, "'fs' (a directory; one host, or a shared filesystem), 'redis' (a "
                "Redis or Valkey server, or a Redis Cluster) or 'mooncake' (a Mooncake Store pool)", "fs"),
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
    "mooncake": {  # kvoffload.impl.tiers.mooncake.MooncakeSettings
        "master": (lambda v: isinstance(v, str) and ":" in v, "the master's RPC address, host:port", None),
        "metadata": (lambda v: isinstance(v, str) and "://" in v,
                     "the metadata server: http://host:port/metadata (the master's own) or etcd://host:port", None),
        "local_host": (_is_str, "this host's address as the pool's other hosts reach it", OPTIONAL),
        "protocol": (lambda v: v in ("tcp", "rdma"), "'tcp' or 'rdma'", OPTIONAL),
        "device": (_is_str, "the RDMA devices to use, e.g. 'mlx5_0' ('' over TCP)", OPTIONAL),
        "segment_bytes": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                          "an int >= 0: host memory this engine lends the pool (0: store nodes hold it all)", OPTIONAL),
        "buffer_bytes": (_positive_int, "a positive int: the client's own transfer buffer", OPTIONAL),
        "lease": (_positive_seconds, "the master's default_kv_lease_ttl, in seconds", OPTIONAL),
        "retry_after": (lambda v: _positive_seconds(v) or (v == 0 and not isinstance(v, bool)),
                        "seconds >= 0 every call fails at once after one could not reach the master", OPTIONAL),
    },
}


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
        from ..tiers.redis import RedisSettings  # redis-py is needed only by those who use it

        return RedisSettings(**self.options)

    def _mooncake(self) -> Any:
        from ..tiers.mooncake import MooncakeSettings  # its client is needed only by those who use it

        return MooncakeSettings(**self.options)

    def check(self) -> None:
        """At start-up: a server that refuses us is a clear error now, not a miss at every lookup."""
        if self.backend in ("redis", "mooncake"):
            from ..tiers import TierError

            try:
                (self._redis() if self.backend == "redis" else self._mooncake()).check()
            except TierError as error:
                raise ConfigError(f"kv_connector_extra_config {error}") from None

    def open(self, namespace: Namespace, payload: int) -> SharedTier:
        if self.backend == "redis":
            from ..tiers.redis import RedisTier

            return RedisTier(self._redis(), namespace, payload)
        if self.backend == "mooncake":
            from ..tiers.mooncake import MooncakeTier

            return MooncakeTier(self._mooncake(), namespace, payload)
        return FileTier(self.options["path"], namespace, payload)


def group_of(spec: Any, index: int) -> Group:
    """A KV cache group's spec as our ``Group``: full attention (MLA included), a sliding window, or recurrent state
    (Mamba, gated delta nets: in vLLM's align mode, where a block holds the state at its end), with its block size
    (vLLM gives the layers of a group with fewer bytes per token larger blocks, so that pages are equal)."""
    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode != "align":
            raise ConfigError(f"KV cache group {index} holds Mamba state in mamba_cache_mode={spec.mamba_cache_mode!r}"
                              ": KVOffloadConnector offloads it in 'align' mode only, where each block holds the "
                              "state at its end (--mamba-cache-mode align, with prefix caching)")
        return Group(block_size=spec.block_size, state=True)
    specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    attention = all(isinstance(s, (SlidingWindowSpec, FullAttentionSpec)) for s in specs)
    kinds = {Group(s.sliding_window if isinstance(s, SlidingWindowSpec) else None, s.block_size) for s in specs}
    if not attention or len(kinds) != 1:
        raise ConfigError(f"KV cache group {index} is {type(spec).__name__}: KVOffloadConnector handles "
                          "full-attention, sliding-window and Mamba groups only (not chunked-local or cross attention)")
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
                  store_prompts_only=extra.get("store_prompts_only", False),
                  num_spec_tokens=vllm_config.num_speculative_tokens,  # what the spec refuses of it, refused
                  checkpoint_alignment=checkpoint_alignment(kv_cache_config),
                  retention_interval=kv_cache_config.prefix_cache_retention_interval,
                  load_failure_policy=vllm_config.kv_transfer_config.kv_load_failure_policy,
                  async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
                  prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                  sync_loads=extra.get("sync_loads", False))


def checkpoint_alignment(kv_cache_config: Any) -> int | None:
    """Where the state groups save a prefill checkpoint inside a chunk (vLLM's Mamba2 and KDA layers:
    ``num_prefill_checkpoint_blocks``), as ``Config.checkpoint_alignment``; None: they save none. vLLM's scheduler
    follows the first state group's alignment, so groups that disagree are refused."""
    kinds = {(spec.num_prefill_checkpoint_blocks > 0 and spec.prefill_checkpoint_alignment is not None,
              spec.prefill_checkpoint_alignment) for g in kv_cache_config.kv_cache_groups
             if isinstance(spec := g.kv_cache_spec, MambaSpec)}
    if len(kinds) > 1:
        raise ConfigError(f"the Mamba KV cache groups disagree on prefill checkpoints (saved, alignment): "
                          f"{sorted(kinds, key=str)}; vLLM follows the first group's, which the others' layers do not")
    saved, alignment = kinds.pop() if kinds else (False, None)
    return alignment if saved else None


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
