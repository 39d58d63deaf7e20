"""The bug that started the project, as an explicit program (vLLM v0.11.0, `break` instead of `continue`).

Two requests share a batch. r0 completes an offload block this step and the tier refuses to store it; r1 crosses
into a new GPU block in the same step. A connector that stops the batch loop at r0's refusal never records r1's new
block: TRACK fails at once, and the next step's store of r1's new block indexes past the end of its table.
"""

import pytest

from kvoffload.reference import ReferenceConnector, TensorKV
from kvoffload.spec import Config, Executor, ListKV, SpecConnector, Violation, World

from .faulty import BreakOnRefusedStore

CONFIG = Config(num_gpu_blocks=16, block_size=2, offload_block_size=2, tier_blocks=8, token_budget=8)


def world_with(connector_class, observable=True, kv=TensorKV) -> World:
    world = World(CONFIG, connector_class(CONFIG), kv(CONFIG.num_gpu_blocks), Executor(), observable=observable)
    world.add_request([0, 1, 2], max_tokens=5)  # r0: 3 tokens -> its 2nd block fills at step 2
    world.add_request([2, 1, 0, 1], max_tokens=5)  # r1: 4 tokens -> needs a 3rd block at step 2
    world.step()  # both prefilled in one batch
    world.connector.refuse_next_store("r0")  # r0's store at step 2 is refused
    return world


def test_setup_really_is_the_seed_scenario():
    world = world_with(SpecConnector, kv=ListKV)
    out = world.step()
    r0, r1 = out.scheduled
    assert (r0.req_id, r1.req_id) == ("r0", "r1")
    assert (r0.num_computed_tokens + r0.num_scheduled_tokens) // 2 == 2  # r0 completes offload block 1...
    assert world.connector.observe().cursors["r0"] == 2
    assert ("r0", "store") not in {(j[0], j[1]) for j in world.connector.observe().jobs}  # ...which is refused
    assert r1.block_ids is not None and len(r1.block_ids) == 1  # r1 got a new block in the same step


def test_reference_keeps_tracking_after_a_refused_store():
    world = world_with(ReferenceConnector)
    for _ in range(2):  # the refused step, then the step that stores r1's new block
        world.step()
        world.check()
    assert world.connector.observe().tracked["r1"] == tuple(world.requests["r1"].blocks)


def test_break_variant_fails_track_at_once():
    world = world_with(BreakOnRefusedStore)
    with pytest.raises(Violation, match="TRACK.*request r1"):
        world.step()


def test_break_variant_without_observation_crashes_on_the_next_store():
    world = world_with(BreakOnRefusedStore, observable=False)
    world.step()  # silently loses r1's new block
    with pytest.raises(IndexError):
        world.step()  # r1 completes the block whose id it never recorded
