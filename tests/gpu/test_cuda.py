"""The production transfer layer on a real GPU: pinned host pool, one CUDA stream per direction, event polling.

Skipped where CUDA is absent; everything here needs a device and real streams (no mocks)."""

import functools
import time

import numpy as np
import pytest
import torch

from kvoffload.impl import OffloadConnector
from kvoffload.impl.testing import SHAPES, LayeredKV
from kvoffload.impl.transfer import Copier, CudaStreamExecutor, HostPool, block_views
from kvoffload.spec import Config, ConfigError, Job
from kvoffload.spec.kit import Scenario, run_conformance
from tests.unit.test_copy_strategies import NUM_BLOCKS, PAGE, PATTERNS, state_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")


@functools.cache
def cycles_per_second() -> float:
    """GPU clock as torch.cuda._sleep sees it, measured once, so sleeps can be asked for in seconds."""
    torch.cuda._sleep(1000)  # load the kernel first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1000)


def gpu_sleep(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds``: work queued after this on it runs late."""
    torch.cuda._sleep(int(seconds * cycles_per_second()))


def setup(shape="kv_first", dtype=torch.bfloat16, num_blocks=16, rows=12, strategy=None):
    kv = LayeredKV(num_blocks, shape=shape, dtype=dtype, device="cuda")
    for block in range(num_blocks):
        kv.write(block, 1000 + block)
    copier = Copier(kv.views, HostPool(kv.views, rows), strategy)
    torch.cuda.synchronize()  # the load stream does not wait for the current one: let these writes land first
    return kv, copier, CudaStreamExecutor(kv.views[0].device)


def job(copier, job_id, kind, blocks, rows):
    run = copier.plan(kind, np.asarray(blocks, dtype=np.int64), np.asarray(rows, dtype=np.int64))
    return Job(job_id, f"r{job_id}", kind, (), run)


def wait_for(executor, job_ids, timeout=10.0):
    """Poll (never synchronise) until every job is reported; {job id: ok}."""
    results, deadline = [], time.monotonic() + timeout
    while {j for j, _ in results} != set(job_ids):
        assert time.monotonic() < deadline, f"jobs {sorted(job_ids)} not all reported after {timeout}s: {results}"
        results += executor.poll()
        time.sleep(0.001)
    return dict(results)


def host_row(copier, row):
    return torch.cat([region[row] for region in copier.pool.regions])


def gpu_block(kv, block):
    return torch.cat([view[block] for view in kv.views]).cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_store_then_load_round_trips_on_streams(shape, dtype):
    kv, copier, executor = setup(shape, dtype)
    assert copier.pool.buffer.is_pinned()  # async copies to pageable memory would silently synchronise
    # scattered ids, with one run (2, 3, 4 -> rows 5, 6, 7) that coalesces into a single copy
    sources, rows, targets = [13, 2, 3, 4, 0, 9], [0, 5, 6, 7, 11, 2], [1, 5, 6, 7, 14, 15]
    executor.submit(job(copier, 1, "store", sources, rows))
    assert wait_for(executor, [1]) == {1: True}
    for block, row in zip(sources, rows):
        assert torch.equal(host_row(copier, row), gpu_block(kv, block))
    executor.submit(job(copier, 2, "load", targets, rows))
    assert wait_for(executor, [2]) == {2: True}
    for source, target in zip(sources, targets):
        assert kv.holds(target, 1000 + source)
    for block in set(range(16)) - set(targets):  # nothing else was touched
        assert kv.holds(block, 1000 + block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("strategy", ["runs", "staged"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_strategy_matches_a_plain_copy(shape, strategy, dtype):
    kv, copier, executor = setup(shape, dtype, strategy=strategy)
    expected = HostPool(kv.views, 12)
    for pool in (copier.pool, expected):
        pool.buffer.fill_(0xA5)  # known bytes in the rows no copy touches
    sources, rows, targets = [15, 14, 13, 2, 3, 4, 9], [0, 1, 2, 5, 6, 7, 11], [1, 5, 6, 7, 14, 3, 0]
    for view, region in zip(kv.views, expected.regions):
        for block, row in zip(sources, rows):
            region[row] = view[block]
    executor.submit(job(copier, 1, "store", sources, rows))
    assert wait_for(executor, [1]) == {1: True}
    assert torch.equal(copier.pool.buffer, expected.buffer)
    plain = [view.clone() for view in kv.views]
    for view, region in zip(plain, expected.regions):
        for block, row in zip(targets, rows):
            view[block] = region[row]
    executor.submit(job(copier, 2, "load", targets, rows))
    assert wait_for(executor, [2]) == {2: True}
    assert all(torch.equal(view, want) for view, want in zip(kv.views, plain))


@pytest.mark.parametrize("strategy", ["runs", "staged"])
@pytest.mark.parametrize("layout", ["gpu", "hybrid"])
def test_state_pages_round_trip_on_streams_and_leave_the_padding(layout, strategy):
    """A Mamba layer's conv and SSM state, each filling part of a padded page (alone, or beside an attention layer
    that owns the whole page), stores and loads on the streams exactly as a plain copy does; loads leave the padding."""
    caches, raw = state_caches(layout, device="cuda")
    views = block_views(caches, "blocks_first")
    copier, expected = Copier(views, HostPool(views, 8), strategy), HostPool(views, 8)
    for pool in (copier.pool, expected):
        pool.buffer.fill_(0xA5)
    blocks, rows = PATTERNS["runs_and_gaps"]
    for view, region in zip(views, expected.regions):
        for block, row in zip(blocks, rows):
            region[row] = view[block]
    executor = CudaStreamExecutor(views[0].device)
    torch.cuda.synchronize()  # the streams do not wait for the fills on the current one
    executor.submit(job(copier, 1, "store", blocks, rows))
    assert wait_for(executor, [1]) == {1: True}
    assert torch.equal(copier.pool.buffer, expected.buffer)

    pages = raw.view(NUM_BLOCKS, PAGE)
    filled = sum(view.shape[1] for view in views)
    padding = pages[:, filled:].clone()
    targets, rows = PATTERNS["scattered"]
    want = [view.clone() for view in views]
    for view, region in zip(want, copier.pool.regions):
        for block, row in zip(targets, rows):
            view[block] = region[row]
    assert not all(torch.equal(view, w) for view, w in zip(views, want))  # the check below can fail
    torch.cuda.synchronize()
    executor.submit(job(copier, 2, "load", targets, rows))
    assert wait_for(executor, [2]) == {2: True}
    assert all(torch.equal(view, w) for view, w in zip(views, want))
    assert torch.equal(pages[:, filled:], padding)


def test_more_than_two_runs_are_staged_and_indexed_copies_cannot_cross_devices():
    kv, copier, _executor = setup()
    assert copier.choose(num_blocks=256, num_runs=2) == "runs"
    assert copier.choose(num_blocks=6, num_runs=3) == "staged"
    copier.large_run = 0  # the CPU's threshold does not apply
    assert copier.choose(num_blocks=256, num_runs=256) == "staged"
    with pytest.raises(ConfigError, match="'indexed'.*'staged'"):
        Copier(kv.views, copier.pool, "indexed")


def test_store_waits_for_the_compute_stream():
    kv, copier, executor = setup()
    gpu_sleep(0.5)  # the forward pass is still running...
    kv.write(3, 2222)  # ...and writes block 3 only at its end, on the same (current) stream
    executor.submit(job(copier, 1, "store", [3], [0]))  # a store that did not wait would copy content 1003
    assert wait_for(executor, [1]) == {1: True}
    assert kv.holds(3, 2222)
    assert torch.equal(host_row(copier, 0), gpu_block(kv, 3))


def test_poll_does_not_block_and_flush_does():
    _kv, copier, executor = setup()
    gpu_sleep(1.0)
    executor.submit(job(copier, 1, "store", [3], [0]))  # queued behind the sleep
    start = time.perf_counter()
    assert executor.poll() == []
    assert time.perf_counter() - start < 0.1
    torch.cuda.synchronize()
    assert executor.poll() == [(1, True)]

    gpu_sleep(1.0)
    executor.submit(job(copier, 2, "store", [4], [1]))
    executor.flush({99})  # another job: must not wait for this one
    assert executor.poll() == []
    executor.flush({2})  # preemption: job 2 is done when flush returns
    assert executor.poll() == [(2, True)]


def test_a_job_that_raises_is_reported_failed_not_raised():
    _kv, copier, executor = setup()

    def broken() -> None:
        raise RuntimeError("copy launch failed")

    executor.submit(job(copier, 1, "store", [1, 2], [0, 1]))
    executor.submit(Job(2, "r2", "load", (), broken))
    executor.submit(job(copier, 3, "load", [5, 6], [4, 5]))  # other rows: loads do not wait for stores
    assert wait_for(executor, [1, 2, 3]) == {1: True, 2: False, 3: True}
    assert executor.poll() == []  # each job is reported exactly once


def test_a_synchronous_load_has_landed_when_wait_returns():
    """What a worker waits for in ``start_load_kv`` before the forward pass: the copy is done, and the next poll
    reports it (an outcome in the output of its step, as vLLM needs it to fail a request that read a failed one)."""
    kv, copier, executor = setup()
    executor.submit(job(copier, 1, "store", [3, 4], [0, 1]))
    assert wait_for(executor, [1]) == {1: True}
    executor.submit(job(copier, 2, "load", [5, 6], [0, 1]))
    executor.wait({2})
    assert executor.poll() == [(2, True)]
    assert kv.holds(5, 1003) and kv.holds(6, 1004)


def test_connector_conforms_on_cuda():
    scenario = Scenario(Config(num_gpu_blocks=12, tier_blocks=4, prefix_caching=False), delay=2, failures=True)
    run_conformance(OffloadConnector, scenario, level="exact",
                    kv_factory=functools.partial(LayeredKV, shape="kv_first", device="cuda"), max_examples=20)


def test_connector_conforms_on_cuda_with_synchronous_loads():
    from tests.stateful.scenarios import SYNC_SCENARIOS

    run_conformance(OffloadConnector, SYNC_SCENARIOS["k2-sync-spec2-tp2-broken-loads"], level="exact",
                    kv_factory=functools.partial(LayeredKV, shape="kv_first", device="cuda"), max_examples=10)


@pytest.mark.parametrize("name", ["hybrid-state-full-checkpoints-async-spec3-delayed-failures",
                                  "hybrid-full-state-w4-async-tp2-delayed-failures"])
def test_connector_conforms_on_cuda_in_hybrid_models(name):
    """A model with recurrent state, a window and speculative decoding, on the streams: equal to the spec."""
    from tests.stateful.scenarios import HYBRID_SCENARIOS

    run_conformance(OffloadConnector, HYBRID_SCENARIOS[name], level="exact",
                    kv_factory=functools.partial(LayeredKV, shape="fused", device="cuda"), max_examples=10)
