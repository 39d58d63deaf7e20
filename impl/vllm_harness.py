"""A real vLLM Scheduler without a model: for driving connectors in tests and benchmarks (vLLM 0.32)."""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def make_configs(model: Path, num_blocks: int, connector: str, module: str | None, extra: dict,
                 block_size: int = BLOCK_SIZE, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 256) -> tuple[VllmConfig, KVCacheConfig]:
    """The configs vLLM's engine would build for ``model`` (a config directory is enough): a KV cache of
    ``num_blocks`` blocks of ``block_size`` tokens over two layers, and the named connector."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                            kv_connector_module_path=module, kv_connector_extra_config=extra,
                                            kv_load_failure_policy="recompute"),
        device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=LAYERS,
                                        layer_stride=page * num_blocks, block_stride=page)])
    return vllm_config, kv_cache_config


def make_scheduler(model: Path, num_blocks: int, connector: str, module: str | None, extra: dict,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 256) -> Scheduler:
    """vLLM's real Scheduler over the configs of ``make_configs``, with the named connector on its scheduler side."""
    vllm_config, kv_cache_config = make_configs(model, num_blocks, connector, module, extra,
                                                max_num_seqs=max_num_seqs,
                                                max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE)
