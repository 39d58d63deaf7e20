"""A real vLLM Scheduler without a model: for driving connectors in tests and benchmarks (vLLM 0.32).

It can be built the way vLLM runs on GPUs (DESIGN 6.1): the ``AsyncScheduler`` of async scheduling, ngram
speculative decoding, and a tensor-parallel world size (the scheduler side only reads it; the worker sides are the
caller's)."""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         SpeculativeConfig, VllmConfig)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def make_configs(model: Path, num_blocks: int, connector: str, module: str | None, extra: dict,
                 block_size: int = BLOCK_SIZE, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
                 num_spec_tokens: int = 0, world_size: int = 1,
                 windows: tuple[int | None, ...] = (None,)) -> tuple[VllmConfig, KVCacheConfig]:
    """The configs vLLM's engine would build for ``model`` (a config directory is enough): a KV cache of
    ``num_blocks`` blocks of ``block_size`` tokens, one KV cache group of two layers per entry of ``windows`` (None:
    full attention, else a sliding window of that many tokens), and the named connector. ``num_spec_tokens`` turns
    on ngram speculative decoding (no draft model needed); ``world_size`` is the tensor-parallel size."""
    speculative = (SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec_tokens, prompt_lookup_max=3,
                                     prompt_lookup_min=2) if num_spec_tokens else None)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                         max_model_len=1024, is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
        speculative_config=speculative,
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                            kv_connector_module_path=module, kv_connector_extra_config=extra,
                                            kv_load_failure_policy="recompute"),
        device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    def spec(window: int | None) -> FullAttentionSpec | SlidingWindowSpec:
        if window is None:
            return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                 sliding_window=window)

    specs = [spec(window) for window in windows]
    layers = [LAYERS] if len(windows) == 1 else [[f"model.layers.{i}.self_attn.attn" for i in (g, g + len(windows))]
                                                 for g in range(len(windows))]
    page = specs[0].page_size_bytes
    # As vLLM lays out a hybrid model: the groups overlay one allocation, a KVCacheTensor per group over all of it.
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in zip(layers, specs)],
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=names,
                                        layer_stride=page * num_blocks, block_stride=page) for names in layers])
    return vllm_config, kv_cache_config


def make_scheduler(model: Path, num_blocks: int, connector: str, module: str | None, extra: dict,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 256, async_scheduling: bool = False,
                   num_spec_tokens: int = 0, world_size: int = 1, log_stats: bool = False,
                   windows: tuple[int | None, ...] = (None,)) -> Scheduler:
    """vLLM's real Scheduler (``AsyncScheduler`` with ``async_scheduling``) over the configs of ``make_configs``
    (``windows``: its KV cache groups), with the named connector on its scheduler side. ``log_stats`` keeps vLLM's
    own prefix-cache statistics."""
    vllm_config, kv_cache_config = make_configs(model, num_blocks, connector, module, extra,
                                                max_num_seqs=max_num_seqs,
                                                max_num_batched_tokens=max_num_batched_tokens,
                                                num_spec_tokens=num_spec_tokens, world_size=world_size,
                                                windows=windows)
    scheduler_class = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_class(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                           structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE,
                           log_stats=log_stats)
