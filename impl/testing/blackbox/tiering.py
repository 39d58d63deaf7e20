"""vLLM's tiering (``TieringOffloadingSpec``, vLLM 0.32 and 0.33) with its ``fs`` secondary tier, in black-box mode.

vLLM's ``OffloadingConnector`` runs it: the CPU primary tier is vLLM's CPU manager over a shared memory region that
the worker's transfers and the tier's file I/O both touch, and every chunk stored to it is written to a file under
the tier's directory (a cascade); a chunk found only in a file is read back into a primary chunk first (a promotion)
and only then reported as a hit. The kit plays the worker side as for any connector, with one difference: the CPU
chunks it copies GPU blocks into and out of are the real shared region, so what the tier writes to its files and
reads back is what the kit checks (a block's content is sealed into its place in the chunk; a byte the tier lost,
a file it read into the wrong chunk, or a file written before a weight update all show on the GPU as CONTENT).

The tier's own threads are the environment here, as the world's executor is for GPU transfers: its I/O jobs are held
by ``HeldIO`` and run, in submission order, ``io_delay`` steps after they were submitted, at the end of the
scheduler step (while the model would run); its existence checks run as each step ends (``flush``), so their verdicts
reach the next step's lookups, as they would from a fast lookup thread. Nothing else of the tier is changed: the
file names, the writes (a temporary file renamed into place), the reads and their error handling are vLLM's.
"""

from __future__ import annotations

import os
import struct
import tempfile
import weakref
from collections import Counter, deque
from functools import cache
from pathlib import Path
from typing import Any, Callable, Hashable, cast

from kvoffload.spec import GARBAGE

SEAL = struct.Struct("<8sq")  # a GPU block's content in its place of a CPU chunk: a mark, then the content
MARK = b"kvoffkit"


class SharedRegion:
    """The primary tier's CPU chunks, as the played worker reads and writes them: GPU block ``sub`` of chunk ``c`` is
    sealed at byte ``sub * SEAL.size`` of the chunk's row (the tier copies whole rows; what lies where inside a row is
    the worker's business). A place never written, or written by someone else, reads as garbage."""

    def __init__(self, view: memoryview) -> None:
        assert view.strides is not None
        self.row, self.bytes = view.strides[0], view.cast("B")

    def _offset(self, slot: Hashable) -> int:
        chunk, sub = cast(tuple[int, int], slot)  # OffloadingTransfers' slots: (chunk, GPU block inside it)
        return chunk * self.row + sub * SEAL.size

    def __setitem__(self, slot: Hashable, content: int) -> None:
        SEAL.pack_into(self.bytes, self._offset(slot), MARK, content)

    def get(self, slot: Hashable, default: int = GARBAGE) -> int:
        mark, content = SEAL.unpack_from(self.bytes, self._offset(slot))
        return int(content) if mark == MARK else default


class HeldIO:
    """Stands in for the fs tier's I/O thread pool (``DualQueueThreadPool``: the same methods): each job's tasks run
    in submission order ``delay`` steps after it was submitted (``tick`` ends a step), a task that raises fails its
    job, and finished jobs are handed back by ``get_finished`` as the pool hands them back."""

    def __init__(self, delay: int = 0) -> None:
        self.delay = delay
        self.held: deque[tuple[int, int, list[Callable[[], None]]]] = deque()  # (step submitted, job id, tasks)
        self.finished: list[tuple[int, bool, float]] = []
        self.steps = 0
        self.kinds: dict[int, str] = {}  # job id -> "load" (a file into a CPU chunk) or "store"
        self.ran: Counter[str] = Counter()  # jobs run, by kind and outcome: "load ok", "store failed", ...

    def enqueue_load(self, job_id: int, n_tasks: int, tasks: Any) -> None:
        self._hold(job_id, "load", tasks)

    def enqueue_store(self, job_id: int, n_tasks: int, tasks: Any) -> None:
        self._hold(job_id, "store", tasks)

    def _hold(self, job_id: int, kind: str, tasks: Any) -> None:
        self.kinds[job_id] = kind
        self.held.append((self.steps, job_id, list(tasks)))

    def tick(self) -> None:
        """A step ended: run the jobs whose time has come."""
        while self.held and self.steps - self.held[0][0] >= self.delay:
            self._run()
        self.steps += 1

    def _run(self) -> None:
        _step, job_id, tasks = self.held.popleft()
        success = True
        for task in tasks:
            try:
                task()
            except Exception:  # as the pool does: a task that raises fails its job
                success = False
        self.finished.append((job_id, success, 0.0))
        self.ran[f"{self.kinds.pop(job_id)} {'ok' if success else 'failed'}"] += 1

    def get_finished(self) -> list[tuple[int, bool, float]]:
        finished, self.finished = self.finished, []
        return finished

    def wait_idle(self) -> None:
        while self.held:
            self._run()

    def shutdown(self, wait: bool = True) -> None:
        self.held.clear()


class InlineLookups:
    """Stands in for the queue between an ``AsyncLookupManager`` and its thread: a batch put on it is looked up at
    once, by the manager's own worker loop, on the caller's thread."""

    def __init__(self, worker: Callable[[], None]) -> None:
        self.worker, self.items = worker, deque[Any]()

    def put(self, batch: Any) -> None:
        self.items.extend((batch, None))  # None ends the worker loop, as at shutdown
        self.worker()

    put_nowait = put

    def get(self) -> Any:
        return self.items.popleft()


def fs_tier_config(root: Path) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of vLLM's ``fs`` tier on ``root``."""
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}


def take_over(connector: Any, io_delay: int) -> tuple[SharedRegion, HeldIO]:
    """The played worker's view of the primary tier's CPU chunks, and the fs tier's I/O, from now on held by the kit
    (its threads, idle so far, are stopped). When the connector goes, its shared region is released."""
    manager = connector.scheduler.manager
    (tier,) = manager.secondary_tiers
    tier._pool.shutdown(wait=True)
    tier._pool = io = HeldIO(io_delay)
    lookups = tier._lookup_manager
    lookups.shutdown()
    lookups._lookup_queue = InlineLookups(lookups._worker)
    build = connector.build_connector_meta

    def build_then_run_io(scheduler_output: Any) -> Any:
        metadata = build(scheduler_output)
        io.tick()  # the tier's I/O runs while the model does
        return metadata

    connector.build_connector_meta = build_then_run_io
    _let_go_of_file(manager.primary_tier._mmap_region)
    region = SharedRegion(manager.primary_tier.get_kv_memoryview())
    weakref.finalize(connector, _shut_down, manager, region)
    return region, io


def _let_go_of_file(mapped: Any) -> None:
    """The shared region's file in /dev/shm is there for the worker processes to map: the played worker maps none,
    so it goes now, and its descriptor with it (the mapping lives on until the connector is collected, which a
    hunt of thousands of programs may not do before it runs out of descriptors)."""
    os.unlink(mapped.mmap_path)
    os.close(mapped.fd)
    mapped.fd, mapped._creator = None, False


@cache
def _directories() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="kvoffload-fs-tiers-")  # removed at exit


def new_directory() -> Path:
    """A fresh directory for one fs tier (or one fleet's)."""
    return Path(tempfile.mkdtemp(dir=_directories().name))


def _shut_down(manager: Any, region: SharedRegion) -> None:
    region.bytes.release()
    manager.shutdown()
