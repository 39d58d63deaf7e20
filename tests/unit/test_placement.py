"""Host rows follow the GPU blocks. vLLM frees a request's blocks tail first, so a later request's blocks descend
through its tokens; a store into rows in token order, and a load back into blocks handed out the same way, would
copy backwards through memory on one side. The production tier hands a store's new slots out ascending as the
keys' first GPU blocks do: the store, and a later load into blocks that descend too, are each one forward run."""

import numpy as np
import pytest
from attrs import evolve

from kvoffload.impl import OffloadConnector
from kvoffload.impl.transfer import runs
from kvoffload.spec import Config, Group, Request, ScheduledRequest, SchedulerOutput, WorkerOutput

CONFIG = Config(num_gpu_blocks=32, block_size=2, offload_block_size=2, tier_blocks=16)
DOCUMENT = tuple(range(100, 108))  # four blocks


def step(connector, *scheduled: ScheduledRequest):
    plan = connector.build_connector_meta(SchedulerOutput(1, scheduled, frozenset(), frozenset()))
    connector.update_connector_output(WorkerOutput(job_results=tuple((t.job_id, True) for t in
                                                                     (*plan.stores, *plan.loads))))
    return plan


def forward_runs(transfer) -> int | None:
    """The runs of a copy whose rows ascend as its blocks do; None if they do not."""
    blocks, rows = np.array(transfer.gpu_blocks), np.array(transfer.host_rows)
    rows = rows[np.argsort(blocks)]
    return len(runs(np.sort(blocks), rows)) if (np.diff(rows) > 0).all() else None


def store_document(connector, blocks: list[int]):
    request = Request("writer", DOCUMENT + (1,), 1, CONFIG.block_size)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    connector.update_state_after_alloc(request, blocks, 0)
    (store,) = step(connector, ScheduledRequest("writer", "new", tuple(blocks), 0, len(request.prompt))).stores
    return store


@pytest.mark.parametrize("groups", [None, (Group(), Group())], ids=["one-group", "two-groups"])
def test_a_store_into_blocks_that_descend_copies_forward(groups):
    connector = OffloadConnector(CONFIG if groups is None else evolve(CONFIG, groups=groups))
    if groups is None:
        store = store_document(connector, [20, 19, 18, 17, 16])
        assert store.gpu_blocks == [20, 19, 18, 17]  # token order
    else:
        request = Request("writer", DOCUMENT + (1,), 1, CONFIG.block_size)
        connector.get_num_new_matched_tokens(request, 0)
        tables = ((20, 19, 18, 17, 16), (9, 8, 7, 6, 5))
        connector.update_state_after_alloc(request, tables, 0)
        (store,) = step(connector, ScheduledRequest("writer", "new", None, 0, len(request.prompt), tables)).stores
    assert forward_runs(store) == len(groups or [0])  # one per group


def test_a_load_into_blocks_that_descend_as_the_stored_ones_did_is_one_forward_run():
    connector = OffloadConnector(CONFIG)
    store_document(connector, [20, 19, 18, 17, 16])
    reader = Request("reader", DOCUMENT + (2,), 1, CONFIG.block_size)
    assert connector.get_num_new_matched_tokens(reader, 0) == (8, True)
    connector.update_state_after_alloc(reader, [12, 11, 10, 9, 8], 8)
    (load,) = step(connector).loads
    assert load.gpu_blocks == [12, 11, 10, 9] and forward_runs(load) == 1


def test_present_keys_keep_their_slots():
    """Only the keys a store adds take slots: one the tier holds keeps its row, whatever its block now."""
    connector = OffloadConnector(CONFIG)
    first = store_document(connector, [20, 19, 18, 17, 16])
    rows = dict(zip(first.keys, first.host_rows))
    longer = Request("longer", DOCUMENT + (108, 109, 1), 1, CONFIG.block_size)
    connector.get_num_new_matched_tokens(longer, 0)
    connector.update_state_after_alloc(longer, [30, 29, 28, 27, 26, 25], 0)
    (store,) = step(connector, ScheduledRequest("longer", "new", (30, 29, 28, 27, 26, 25), 0, 11)).stores
    assert store.gpu_blocks == [26] and not set(store.host_rows) & set(rows.values())
    assert connector.tier.slot_of.items() >= rows.items()
