"""The worker's I/O threads for the shared tier: puts and gets never run in the engine step, and a slow store
makes puts drop (counted), never the engine wait."""

import threading
import time

from kvoffload.impl.shared import IOExecutor
from kvoffload.spec.types import Job


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
