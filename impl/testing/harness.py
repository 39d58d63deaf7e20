"""A real vLLM Scheduler without a model: for driving connectors in tests and benchmarks (vLLM 0.32).

It can be built the way vLLM runs on GPUs (DESIGN 6.1): the ``AsyncScheduler`` of async scheduling, ngram
speculative decoding, and a tensor-parallel world size (the scheduler side only reads it; the worker sides are the
caller's)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         SpeculativeConfig, VllmConfig)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec,
                                        SlidingWindowSpec)
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.spec.groups import FULL_ATTENTION, Group

BLOCK_SIZE = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def make_configs(model: Path, num_blocks: int, connector: str | None, module: str | None, extra: dict,
                 block_size: int = BLOCK_SIZE, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
                 num_spec_tokens: int = 0, world_size: int = 1, groups: tuple[Group, ...] = FULL_ATTENTION,
                 checkpoint_alignment: int | None = None, retention_interval: int | None = 0,
                 kv_load_failure_policy: Literal["recompute", "fail"] = "recompute",
                 ) -> tuple[VllmConfig, KVCacheConfig]:
    """The configs vLLM's engine would build for ``model`` (a config directory is enough): a KV cache of
    ``num_blocks`` blocks of ``block_size`` tokens, one KV cache group of two layers per entry of ``groups`` (full
    attention or a sliding window; a group with blocks of its own size has as much fewer bytes per token, so that
    every page has one size, as vLLM's ``unify_kv_cache_spec_page_size`` makes them; a state group is a gated delta
    net's state in align mode, its page padded to that size), and the named connector (None: none).
    ``num_spec_tokens`` turns on ngram speculative decoding (no draft model needed); ``world_size`` is the
    tensor-parallel size; ``checkpoint_alignment`` gives the state a prefill checkpoint block, as Mamba2 layers do;
    ``retention_interval`` is the prefix cache's, vLLM's default 0 unless given (None: every window and state block
    is kept; 0: only where a later request resumes). A failed load is recomputed unless ``kv_load_failure_policy`` is
    "fail" (vLLM's default; our connector asks for "recompute")."""
    speculative = (SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec_tokens, prompt_lookup_max=3,
                                     prompt_lookup_min=2) if num_spec_tokens else None)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024),
        # with recurrent state, vLLM's cache block size is the state's (align mode gives every group that size)
        cache_config=CacheConfig(block_size=next((g.block_size or block_size for g in groups if g.state), block_size),
                                 enable_prefix_caching=True,
                                 mamba_cache_mode="align" if any(g.state for g in groups) else "none"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                         max_model_len=1024, is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
        speculative_config=speculative,
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                            kv_connector_module_path=module, kv_connector_extra_config=extra,
                                            kv_load_failure_policy=kv_load_failure_policy) if connector else None,
        device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    def spec(group: Group) -> FullAttentionSpec | SlidingWindowSpec | MambaSpec:
        size = group.block_size or block_size
        if size % block_size or 32 % (size // block_size):
            raise ValueError(f"a group's blocks of {size} tokens: not 1, 2, 4, ... 32 blocks of {block_size}")
        if group.state:  # a gated delta net's conv and recurrent state, padded to the attention page (vLLM pads),
            # with a block for the state after each draft token (``MambaBase.get_kv_cache_spec``)
            return MambaSpec(block_size=size, shapes=((3, 16), (2, 8, 8)), dtypes=(torch.float32, torch.float32),
                             page_size_padded=2 * size * 2 * 32 * 4, mamba_cache_mode="align",
                             num_speculative_blocks=num_spec_tokens,
                             num_prefill_checkpoint_blocks=int(checkpoint_alignment is not None),
                             prefill_checkpoint_alignment=checkpoint_alignment)
        shape = dict(block_size=size, num_kv_heads=2, head_size=32 * block_size // size, dtype=torch.float32)
        if group.window is None:
            return FullAttentionSpec(**shape)  # type: ignore[arg-type]
        return SlidingWindowSpec(**shape, sliding_window=group.window)  # type: ignore[arg-type]

    specs = [spec(group) for group in groups]
    layers = [LAYERS] if len(groups) == 1 else [[f"model.layers.{i}.self_attn.attn" for i in (g, g + len(groups))]
                                                for g in range(len(groups))]
    page = specs[0].page_size_bytes
    # As vLLM lays out a hybrid model: the groups overlay one allocation, a KVCacheTensor per group over all of it.
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in zip(layers, specs)],
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * len(LAYERS), layers=names,
                                        layer_stride=page * num_blocks, block_stride=page) for names in layers],
        prefix_cache_retention_interval=retention_interval)
    vllm_config.cache_config.prefix_cache_retention_interval = retention_interval
    return vllm_config, kv_cache_config


def make_scheduler(model: Path, num_blocks: int, connector: str | None, module: str | None, extra: dict,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 256, async_scheduling: bool = False,
                   num_spec_tokens: int = 0, world_size: int = 1, log_stats: bool = False,
                   groups: tuple[Group, ...] = FULL_ATTENTION, checkpoint_alignment: int | None = None,
                   retention_interval: int | None = 0,
                   kv_load_failure_policy: Literal["recompute", "fail"] = "recompute") -> Scheduler:
    """vLLM's real Scheduler (``AsyncScheduler`` with ``async_scheduling``) over the configs of ``make_configs``
    (``groups``: its KV cache groups), with the named connector on its scheduler side, and the scheduler and hash
    block sizes vLLM's engine gives it. ``log_stats`` keeps vLLM's own prefix-cache statistics."""
    vllm_config, kv_cache_config = make_configs(model, num_blocks, connector, module, extra,
                                                max_num_seqs=max_num_seqs,
                                                max_num_batched_tokens=max_num_batched_tokens,
                                                num_spec_tokens=num_spec_tokens, world_size=world_size,
                                                groups=groups, checkpoint_alignment=checkpoint_alignment,
                                                retention_interval=retention_interval,
                                                kv_load_failure_policy=kv_load_failure_policy)
    scheduler_class = AsyncScheduler if async_scheduling else Scheduler
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return scheduler_class(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                           structured_output_manager=StructuredOutputManager(vllm_config),
                           block_size=scheduler_block_size, hash_block_size=hash_block_size, log_stats=log_stats)
