"""The production connector's side of the shared store: its namespace, opened once per weights, the threads that run
puts and gets, and the copies between a record's payload and the host pool's rows.

A record is one offload block of one shard: its ``k`` host rows, region after region (one region per KV cache
view), ``k * row_bytes`` bytes. Puts and gets run on I/O threads, never in the engine step: the engine polls them
like any other transfer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy
import torch
from attrs import evolve

from kvoffload.spec.records import Namespace
from kvoffload.spec.store import SharedTier
from kvoffload.spec.types import Job, Key

from .transfer import HostPool, as_words

logger = logging.getLogger("kvoffload.shared")

Opener = Callable[[Namespace, int], SharedTier]  # (namespace, payload bytes) -> that namespace's records


class SharedStore:
    """One engine's (one shard's) records in the shared store: its namespace now, and every weights it was opened with
    (a put or a get in flight at a reset still finishes in the namespace it was made in)."""

    def __init__(self, open: Opener, namespace: Namespace, payload: int) -> None:
        self.open, self.namespace, self.payload = open, namespace, payload
        self._opened: dict[str, SharedTier] = {}  # by weights

    def at(self, weights: str | None = None) -> SharedTier:
        weights = self.namespace.weights if weights is None else weights
        store = self._opened.get(weights)
        if store is None:
            store = self._opened[weights] = self.open(evolve(self.namespace, weights=weights), self.payload)
        return store

    def published(self, weights: str, keys: list[Key]) -> None:
        """A put of this engine's ended well: its records are in the store. A backend that answers existence
        checks from an index of its own (``FileTier.learn``) learns them now, not at its next listing."""
        learn = getattr(self.at(weights), "learn", None)
        if learn is not None:
            learn(keys)

    def counters(self) -> dict[str, int]:
        """What its records went through, over every namespace opened: shared_hits, shared_misses, shared_stored,
        shared_present, and shared_dropped, shared_quarantined, shared_errors whatever the reason."""
        totals = dict.fromkeys(SHARED_COUNTERS, 0)
        for store in self._opened.values():
            for name, n in store.counters.items():
                kind = f"shared_{name.split('_')[0]}"
                if kind in totals:
                    totals[kind] += n
        return totals


SHARED_COUNTERS = ("shared_hits", "shared_misses", "shared_stored", "shared_present", "shared_dropped",
                   "shared_quarantined", "shared_errors")


_scratch = threading.local()  # each I/O thread's staging buffer for the records it puts or gets
STAGING_KEPT = 64 << 20  # bytes: the most an I/O thread keeps between transfers


def _staging(nbytes: int) -> torch.Tensor:
    """This thread's staging buffer, at least ``nbytes``: grown when a put or get needs more, reused after (fresh
    memory for every transfer page-faults as the records pass through it). Valid until the thread's next one. A
    transfer larger than ``STAGING_KEPT`` gets memory of its own, not kept."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes <= STAGING_KEPT:
            _scratch.buffer = buffer
    return buffer[:nbytes]


def _staged(store: SharedTier, keys: list[Key], width: int) -> torch.Tensor:
    """``[keys, width]`` bytes to stage one put's or get's payloads in: where the store asks for them
    (``MooncakeTier.staging``: its registered memory, each record then moving as one piece), else this thread's
    staging buffer."""
    staging = getattr(store, "staging", None)
    frames = staging(keys, width) if staging is not None else None
    return torch.from_numpy(frames) if frames is not None else _staging(len(keys) * width).view(len(keys), width)


def _spans(pool: HostPool, records: torch.Tensor, k: int) -> list[tuple[numpy.ndarray, numpy.ndarray]]:
    """Each region, as words (``as_words``: index kernels move bytes one at a time), with its span of every record,
    ``[records, k, words]`` (a record's payload is its ``k`` rows, region after region). NumPy's arrays, not torch's:
    a torch kernel called on an I/O thread starts an OpenMP team of that thread's, and once libgomp manages more
    threads than there are cores, the engine's own team sleeps between its parallel regions instead of spinning (a
    CPU engine's prefill took 1.3-1.5x as long after a put had moved rows)."""
    spans, offset = [], 0
    for region, words in zip(pool.regions, as_words(pool.regions)):
        width = k * region.shape[1]
        span = records[:, offset:offset + width].view(words.dtype).view(len(records), k, -1)
        spans.append((words.numpy(), span.numpy()))
        offset += width
    return spans


def record_copy(kind: str, store: SharedTier, pool: HostPool, keys: list[Key], rows: list[int],
                k: int) -> Callable[[], bool]:
    """A put (host rows -> one record per key) or a get (records -> host rows; False, with no row written, unless
    every record was there and whole). Rows move one region at a time, every record at once: a copy per record and
    region held the GIL for the scheduler's thread to wait on (a 64-record get took 33 ms, 6 of them reading)."""
    index = numpy.array(rows).reshape(len(keys), k)  # each record's rows
    if kind == "put":
        def put() -> bool:  # False if the store dropped a record (counted there): it is not in the store
            staged = _staged(store, keys, k * pool.row_bytes)
            for words, span in _spans(pool, staged, k):
                numpy.take(words, index, axis=0, out=span, mode="clip")  # rows are in range: "raise" buffers
            outcomes = store.put([(key, payload.numpy().data) for key, payload in zip(keys, staged)])
            return not any(outcome.startswith("dropped") for outcome in outcomes)
        return put

    def get() -> bool:
        landing = _staged(store, keys, k * pool.row_bytes)
        if not all(store.get(keys, [t.numpy().data for t in landing])):
            return False
        for words, span in _spans(pool, landing, k):
            words[index] = span
        return True
    return get


class IOExecutor:
    """Runs puts and gets on threads; ``poll`` reports those done, without waiting. A put or get that raises is a
    failed transfer, never an engine error. Back-pressure: with ``max_puts`` puts in flight (a slow store), a new
    put is dropped at once (reported failed, counted in ``dropped``): the tier keeps its entry, the engine never
    waits for the store."""

    def __init__(self, threads: int = 2, max_puts: int = 64) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvoffload-io")
        self.in_flight: list[tuple[Job, Future[bool | None]]] = []
        self.max_puts, self.dropped = max_puts, 0
        self.seconds = {"get": 0.0, "put": 0.0}  # time the I/O threads spent in each kind
        self.latencies: deque[tuple[str, float]] = deque()  # (kind, seconds) of each put and get run, until taken
        self._refused: list[tuple[int, bool]] = []

    def submit(self, job: Job) -> None:
        if job.kind == "put" and sum(j.kind == "put" for j, _f in self.in_flight) >= self.max_puts:
            self.dropped += 1
            self._refused.append((job.job_id, False))
            return
        self.in_flight.append((job, self.pool.submit(self._timed, job)))

    def _timed(self, job: Job) -> bool | None:
        start = time.perf_counter()
        try:
            return job.run()
        except Exception:  # a failed transfer, as the docstring says: logged, for the operator to see why
            logger.exception("a shared-tier %s raised (reported as a failed transfer)", job.kind)
            raise
        finally:
            took = time.perf_counter() - start
            self.seconds[job.kind] += took
            self.latencies.append((job.kind, took))

    def take_latencies(self) -> list[tuple[str, float]]:
        n = len(self.latencies)  # the I/O threads may append meanwhile: those wait for the next call
        return [self.latencies.popleft() for _ in range(n)]

    def flush(self, job_ids: set[int]) -> None:
        pass  # puts and gets touch no GPU block: nothing waits for them

    def poll(self) -> list[tuple[int, bool]]:
        done, pending, self._refused = self._refused, [], []
        for job, future in self.in_flight:
            if future.done():
                done.append((job.job_id, future.exception() is None and future.result() is not False))
            else:
                pending.append((job, future))
        self.in_flight = pending
        return done
