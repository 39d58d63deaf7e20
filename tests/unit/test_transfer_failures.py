"""Production transfers: a copy that raises is a failed transfer — never a crash, never a ghost entry, never
served bytes — and the copy engine moves exactly the right bytes in every layout."""

import numpy as np
import pytest
import torch

from kvoffload.impl import OffloadConnector
from kvoffload.impl.testing import LayeredKV
from kvoffload.impl.transfer import Copier, HostPool, runs
from kvoffload.spec import Config, Request, ScheduledRequest, SchedulerOutput

CONFIG = Config(num_gpu_blocks=8, block_size=2, offload_block_size=2, tier_blocks=4)


def step_output(*scheduled: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(1, scheduled, frozenset(), frozenset())


def break_copies(monkeypatch):
    """Every copy from now on moves its first view, then fails (a DMA error halfway through)."""
    real_plan = Copier.plan

    def plan(self, kind, blocks, rows):
        views = self.views
        self.views = views[:1]
        first_view = real_plan(self, kind, blocks, rows)
        self.views = views

        def run():
            first_view()
            raise RuntimeError("transfer failed halfway")
        return run
    monkeypatch.setattr(Copier, "plan", plan)


def store_prompt(connector, req_id, prompt, blocks):
    request = Request(req_id, tuple(prompt), 1, CONFIG.block_size)
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, blocks, 0)
    plan = connector.build_connector_meta(step_output(ScheduledRequest(req_id, "new", tuple(blocks), 0, len(prompt))))
    connector.wait_for_save(plan)
    output = connector.get_finished(frozenset())
    connector.update_connector_output(output)
    return request, output


def test_failed_store_leaves_no_entry(monkeypatch):
    connector = OffloadConnector(CONFIG)
    connector.register_kv_caches(LayeredKV(CONFIG.num_gpu_blocks))
    break_copies(monkeypatch)
    _, output = store_prompt(connector, "r0", [0, 1, 2, 0, 1], [0, 1, 2])
    assert output.job_results and not any(ok for _id, ok in output.job_results)
    assert connector.tier.view() == ()  # no ghost entry
    assert connector.stats()["failed_stores"] == 2


def test_failed_load_reports_its_blocks_invalid(monkeypatch):
    connector = OffloadConnector(CONFIG)
    kv = LayeredKV(CONFIG.num_gpu_blocks)
    connector.register_kv_caches(kv)
    first, _ = store_prompt(connector, "r0", [0, 1, 2, 0, 1], [0, 1, 2])
    assert [ready for _k, ready, _r in connector.tier.view()] == [True, True]
    break_copies(monkeypatch)
    again = Request("r1", first.prompt + (2,), 1, CONFIG.block_size)
    assert connector.get_num_new_matched_tokens(again, 0) == (4, True)
    connector.update_state_after_alloc(again, [5, 6], 4)
    connector.start_load_kv(connector.build_connector_meta(step_output()))
    output = connector.get_finished(frozenset())
    assert output.finished_recving == {"r1"} and output.job_results[0][1] is False
    assert connector.get_block_ids_with_load_errors() == {5, 6}
    keys = [key for key, _ready, _refs in connector.tier.view()]
    connector.take_events()
    connector.update_connector_output(output)
    assert connector.tier.view() == ()  # unpinned and dropped: a persistent fault would fail every later load
    events = connector.take_events()
    assert {e.kind for e in events} == {"removed"} and [k for e in events for k in e.keys] == keys
    assert connector.get_num_new_matched_tokens(again, 0) == (0, False)  # not offered again until stored afresh


@pytest.mark.parametrize("large_run", [0, 1 << 30], ids=["per-run-copies", "indexed-copies"])
@pytest.mark.parametrize("shape", ["kv_first", "fused", "mla", "cross_layer"])
@pytest.mark.parametrize("blocks, rows", [([0, 1, 2, 3], [4, 5, 6, 7]), ([7, 2, 5, 0], [0, 6, 1, 3]),
                                          ([1, 2, 5, 6], [2, 3, 4, 7])])
def test_store_then_load_round_trips_bytes(shape, blocks, rows, large_run):
    kv = LayeredKV(8, shape=shape, dtype=torch.bfloat16)
    for b in range(8):
        kv.write(b, 1000 + b)
    copier = Copier(kv.views, HostPool(kv.views, 8))
    copier.large_run = large_run
    blocks, rows = np.asarray(blocks), np.asarray(rows)
    copier.plan("store", blocks, rows)()
    targets = np.asarray([1, 3, 4, 6])
    copier.plan("load", targets, rows)()
    for src, dst in zip(blocks, targets):
        assert kv.holds(int(dst), 1000 + int(src))


def test_runs_coalesce_only_where_both_sides_advance():
    assert runs(np.array([3, 4, 5, 9, 10]), np.array([0, 1, 2, 3, 4])) == [(3, 0, 3), (9, 3, 2)]
    assert runs(np.array([3, 4, 5]), np.array([0, 2, 3])) == [(3, 0, 1), (4, 2, 2)]
    assert runs(np.array([], dtype=int), np.array([], dtype=int)) == []
