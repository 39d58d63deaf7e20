"""A load convoy: requests that arrive together over one document the tier holds. The first loads it; each other
asks again until that load lands, then the engine's prefix cache serves it the same GPU blocks (vLLM caches an
asynchronous load's blocks when it lands, and its OffloadingConnector waits the same way). A load of its own would
copy the same KV into more blocks, and every later step's attention would read each copy (on vLLM's CPU engine, 32
requests decoded at 25 ms a step against 13 ms with shared blocks). Every connector answers alike."""

import pytest
from attrs import evolve

from kvoffload.impl import OffloadConnector
from kvoffload.reference import ReferenceConnector
from kvoffload.spec import Config, Request, ScheduledRequest, SchedulerOutput, SpecConnector, WorkerOutput

CONFIG = Config(num_gpu_blocks=16, block_size=2, offload_block_size=2, tier_blocks=8)
CONNECTORS = {"spec": SpecConnector, "reference": ReferenceConnector, "production": OffloadConnector}
DOCUMENT = (0, 1, 2, 3)  # two offload blocks


def step(connector, *scheduled: ScheduledRequest):
    return connector.build_connector_meta(SchedulerOutput(1, scheduled, frozenset(), frozenset()))


def reported(connector, transfers) -> None:
    """Every worker reports these transfers done."""
    connector.update_connector_output(WorkerOutput(job_results=tuple((t.job_id, True) for t in transfers)))


def asking(req_id: str, question: tuple[int, ...]) -> Request:
    """A request over the document, with its own question after it."""
    return Request(req_id, DOCUMENT + question, 1, CONFIG.block_size)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("name", CONNECTORS)
def test_a_request_waits_for_the_load_that_brings_its_hit(name, prefix_caching):
    connector = CONNECTORS[name](evolve(CONFIG, prefix_caching=prefix_caching))
    writer = asking("r0", (4,))
    assert connector.get_num_new_matched_tokens(writer, 0) == (0, False)
    connector.update_state_after_alloc(writer, [0, 1, 2], 0)
    reported(connector, step(connector, ScheduledRequest("r0", "new", (0, 1, 2), 0, 5)).stores)

    first, second = asking("r1", (7, 8)), asking("r2", (9, 9))
    assert connector.get_num_new_matched_tokens(first, 0) == (4, True)
    connector.update_state_after_alloc(first, [3, 4, 5], 4)
    load = step(connector).loads
    # while it is on its way: wait for it, where the engine's prefix cache will share it (without one: load it too)
    assert connector.get_num_new_matched_tokens(second, 0) == ((None, False) if prefix_caching else (4, True))
    reported(connector, load)
    assert connector.get_num_new_matched_tokens(second, 4) == (0, False)  # the engine's cache holds it now
    assert connector.get_num_new_matched_tokens(second, 0) == (4, True)  # (had it evicted them: the tier serves)


@pytest.mark.parametrize("name", CONNECTORS)
def test_a_hit_that_reads_none_of_the_loading_blocks_does_not_wait(name):
    connector = CONNECTORS[name](CONFIG)
    for req_id, prompt, blocks in (("r0", DOCUMENT + (4,), [0, 1, 2]), ("r1", (5, 6, 7, 8, 9), [3, 4, 5])):
        request = Request(req_id, prompt, 1, CONFIG.block_size)
        connector.get_num_new_matched_tokens(request, 0)
        connector.update_state_after_alloc(request, blocks, 0)
        reported(connector, step(connector, ScheduledRequest(req_id, "new", tuple(blocks), 0, 5)).stores)
    loading = asking("r2", (1,))
    assert connector.get_num_new_matched_tokens(loading, 0) == (4, True)
    connector.update_state_after_alloc(loading, [6, 7, 8], 4)
    step(connector)
    other = Request("r3", (5, 6, 7, 8, 0), 1, CONFIG.block_size)
    assert connector.get_num_new_matched_tokens(other, 0) == (4, True)
