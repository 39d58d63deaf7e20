"""Bad input gets one clear error, from the spec and from the reference alike."""

import pytest

from kvoffload.impl import OffloadConnector
from kvoffload.impl.testing import LayeredKV
from kvoffload.impl.scheduler import Transfer as ImplTransfer
from kvoffload.reference import ReferenceConnector, TensorKV
from kvoffload.reference import Transfer as ReferenceTransfer
from kvoffload.spec import (BlockIdError, Config, ConfigError, Executor, ListKV, Request, ScheduledRequest,
                            SchedulerOutput, SpecConnector, UnknownRequestError, World)
from kvoffload.spec.connector import Transfer as SpecTransfer
from kvoffload.spec.groups import Group
from kvoffload.spec.types import TransferPlan

CONNECTORS = [(SpecConnector, ListKV), (ReferenceConnector, TensorKV), (OffloadConnector, LayeredKV)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=2, offload_block_size=3), "multiple of block_size"),
    (dict(tier_blocks=0), "tier_blocks must be a positive integer"),
    (dict(num_gpu_blocks=-4), "num_gpu_blocks must be a positive integer"),
    (dict(token_budget=2.5), "token_budget must be a positive integer"),
    (dict(policy="mru"), "unknown eviction policy"),
    (dict(groups=()), "groups must be one or more Group"),
    (dict(groups=("sliding",)), "groups must be one or more Group"),
    (dict(block_size=2, groups=(Group(block_size=4), Group(8, block_size=8))),
     r"block_size \(2 tokens per block hash\) must be the greatest common divisor .* \[4, 8\]"),
    (dict(block_size=2, groups=(Group(block_size=4),)), "greatest common divisor"),
])
def test_invalid_configuration(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_a_sliding_window_spans_two_tokens_at_least():
    with pytest.raises(ConfigError, match="at least 2 tokens, got 1"):
        Group(1)


@pytest.mark.parametrize("size", [0, -4, 2.5])
def test_a_groups_block_size_is_a_positive_integer(size):
    with pytest.raises(ConfigError, match=f"block_size must be a positive integer, got {size}"):
        Group(block_size=size)


def output_with(sched: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(1, (sched,), frozenset(), frozenset())


@pytest.mark.parametrize("connector_class, kv", CONNECTORS)
def test_unknown_request_id(connector_class, kv):
    config = Config()
    connector = connector_class(config)
    stranger = Request("ghost", (0, 1, 2), 1, config.block_size)
    with pytest.raises(UnknownRequestError, match="unknown request id 'ghost'"):
        connector.request_finished(stranger, [])
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        connector.build_connector_meta(output_with(ScheduledRequest("ghost", "running", (3,), 2, 1)))
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        connector.update_state_after_alloc(stranger, [0, 1], 0)


@pytest.mark.parametrize("connector_class, kv", CONNECTORS)
def test_unknown_job_completion(connector_class, kv):
    from kvoffload.spec import WorkerOutput
    with pytest.raises(UnknownRequestError, match="unknown job 7"):
        connector_class(Config()).update_connector_output(WorkerOutput(job_results=((7, True),)))


def test_block_id_out_of_range_in_gpu_kv():
    with pytest.raises(BlockIdError, match="GPU block id 16 out of range"):
        ListKV(16).write(16, 0)


@pytest.mark.parametrize("connector_class, kv", CONNECTORS)
def test_block_id_out_of_range_in_a_transfer(connector_class, kv):
    config = Config()
    connector = connector_class(config)
    connector.register_kv_caches(kv(config.num_gpu_blocks), Executor())
    bad = ((config.num_gpu_blocks + 3, 0x1234, 0),)
    plan = {
        SpecConnector: lambda: TransferPlan([], [SpecTransfer(0, "r0", "store", bad)]),
        ReferenceConnector: lambda: TransferPlan(stores=[ReferenceTransfer(0, "r0", "store", bad, (0,))]),
        OffloadConnector: lambda: TransferPlan(stores=[ImplTransfer(0, "r0", "store", [0x1234], list(bad), [0])]),
    }[connector_class]()
    with pytest.raises(BlockIdError, match=str(config.num_gpu_blocks + 3)):
        connector.wait_for_save(plan)


def test_world_refuses_a_connector_that_is_not_one():
    class HalfConnector:
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

    with pytest.raises(TypeError, match="HalfConnector is not a connector: it lacks update_state_after_alloc"):
        World(Config(), HalfConnector(), ListKV(16))
