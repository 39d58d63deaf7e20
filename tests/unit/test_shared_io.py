"""The worker's I/O threads for the shared tier: puts and gets never run in the engine step, and a slow store
makes puts drop (counted), never the engine wait; the scheduler side keeps the engine stepping until its stores are
put."""

import os
import threading
import time

import pytest
import torch

from kvoffload.impl import OffloadConnector
from kvoffload.impl.shared import IOExecutor, record_copy
from kvoffload.impl.tiers import FileTier
from kvoffload.impl.transfer import HostPool
from kvoffload.impl.testing import LayeredKV
from kvoffload.spec import Config, Executor, World
from kvoffload.spec.store import Store
from kvoffload.spec.types import Job

from .test_fs_tier import NS


def _job(job_id, kind, run):
    return Job(job_id, "", kind, (), run)


def _poll_until(io, n, timeout=5.0):
    results, deadline = [], time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results += io.poll()
        time.sleep(0.01)
    return results


def test_a_slow_store_drops_puts_past_the_limit_and_the_engine_never_waits():
    release = threading.Event()
    io = IOExecutor(threads=1, max_puts=1)
    started = time.monotonic()
    io.submit(_job(0, "put", lambda: release.wait(5)))  # the store hangs
    io.submit(_job(1, "put", lambda: True))
    io.submit(_job(2, "get", lambda: True))  # gets are not dropped: a request waits for them, within a deadline
    assert time.monotonic() - started < 1  # submitting never blocks
    assert io.poll() == [(1, False)] and io.dropped == 1
    release.set()
    assert sorted(_poll_until(io, 2)) == [(0, True), (2, True)]


def test_a_put_or_get_that_raises_or_finds_nothing_is_a_failed_transfer():
    io = IOExecutor()
    io.submit(_job(0, "get", lambda: False))
    io.submit(_job(1, "put", lambda: 1 / 0))
    assert sorted(_poll_until(io, 2)) == [(0, False), (1, False)]
    assert io.seconds["get"] > 0 and io.seconds["put"] > 0


def test_the_last_requests_stores_keep_the_engine_stepping_until_they_are_put():
    """The put of stores that landed in a step is made by the next plan: with no request left, the engine must
    still step for it (``has_pending_push_work``), or an idle engine keeps those blocks from the fleet."""
    config = Config(num_gpu_blocks=16, block_size=16, offload_block_size=16, tier_blocks=8, token_budget=256)
    connector, store = OffloadConnector(config), Store(1 << 30)
    world = World(config, connector, LayeredKV(config.num_gpu_blocks), Executor(delay=0), store=store)
    request = world.add_request(list(range(40)), 1)  # two full blocks, one token
    while world.requests:
        world.step()
    assert connector.counters["stored_blocks"] == 2 and not connector.unfinished
    assert connector.has_pending_push_work()  # stored, not put yet
    steps = 0
    while connector.has_pending_push_work():
        world.step()
        steps += 1
        assert steps < 10
    assert {key for _namespace, key in store.records} == set(request.block_hashes[:2])


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here: no OpenMP team to start")
def test_a_put_and_a_get_on_an_io_thread_start_no_openmp_team_of_its_own(tmp_path):
    """Once libgomp manages more threads than there are cores (a team per thread that ran a parallel kernel), the
    engine's own team sleeps between its parallel regions instead of spinning: a CPU engine's prefill took 1.3-1.5x
    as long after a put's torch gather on an I/O thread. The rows move with numpy's copies, on the I/O thread
    alone, and land exactly."""
    views = [torch.empty(1, width, dtype=torch.uint8) for width in (4096, 12288)]
    pool, k, keys = HostPool(views, 64), 2, list(range(16))
    pool.buffer.copy_(torch.arange(pool.buffer.numel()) * 7 % 251)
    store = FileTier(tmp_path, NS, k * pool.row_bytes)
    grown = []

    def native_threads() -> int:  # the process's threads that Python did not start (the tier's pool starts some)
        return len(os.listdir("/proc/self/task")) - threading.active_count()

    def io_thread() -> None:
        before = native_threads()
        assert record_copy("put", store, pool, keys, list(range(32)), k)()
        assert record_copy("get", store, pool, keys, list(range(32, 64)), k)()
        grown.append(native_threads() - before)
    thread = threading.Thread(target=io_thread)
    thread.start()
    thread.join()
    assert grown == [0]
    for region in pool.regions:
        assert torch.equal(region[32:], region[:32])
