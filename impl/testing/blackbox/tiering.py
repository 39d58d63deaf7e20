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

The held I/O is also where the kit does its file faults (a file removed or torn between its lookup and its read, a
slow job) and keeps the clock that vLLM's back-pressure detector, where one is configured, times stores by.
"""

from __future__ import annotations

import gc
import os
import shutil
import struct
import tempfile
import weakref
from collections import Counter, deque
from functools import cache
from pathlib import Path
from types import FunctionType
from typing import Any, Callable, Hashable, cast

from kvoffload.spec import GARBAGE

SEAL = struct.Struct("<8sq")  # a GPU block's content in its place of a CPU chunk: a mark, then the content
MARK = b"kvoffkit"


class SharedRegion:
    """The primary tier's CPU chunks, as the played worker reads and writes them: GPU block ``sub`` of a chunk of
    ``k`` owns the ``sub``-th ``k``-th of the chunk's row (the tier copies whole rows; what lies where inside a row
    is the worker's business), and every byte of that place is its content's seal, repeated. A place never written,
    written by someone else, or written only in part (a torn file read as whole) reads as garbage."""

    def __init__(self, view: memoryview, k: int) -> None:
        assert view.strides is not None and view.strides[0] % k == 0
        self.row, self.place, self.bytes = view.strides[0], view.strides[0] // k, view.cast("B")

    def _offset(self, slot: Hashable) -> int:
        chunk, sub = cast(tuple[int, int], slot)  # OffloadingTransfers' slots: (chunk, GPU block inside it)
        return chunk * self.row + sub * self.place

    def _sealed(self, content: int) -> bytes:
        seal = SEAL.pack(MARK, content)
        return (seal * -(-self.place // SEAL.size))[:self.place]

    def __setitem__(self, slot: Hashable, content: int) -> None:
        offset = self._offset(slot)
        self.bytes[offset:offset + self.place] = self._sealed(content)

    def get(self, slot: Hashable, default: int = GARBAGE) -> int:
        offset = self._offset(slot)
        mark, content = SEAL.unpack_from(self.bytes, offset)
        whole = mark == MARK and self.bytes[offset:offset + self.place] == self._sealed(content)
        return int(content) if whole else default


class HeldIO:
    """Stands in for the fs tier's I/O thread pool (``DualQueueThreadPool``: the same methods): each job's tasks run
    in submission order ``delay`` steps after it was submitted (``tick`` ends a step), a task that raises fails its
    job, and finished jobs are handed back by ``get_finished`` as the pool hands them back.

    The kit's file faults (``fault_next``): a file of the next load job is removed or torn just before the job runs
    (after the lookup that found it), or the next job submitted is slow, and the jobs behind it wait. Its steps are
    also the tier's clock (``monotonic``), so what a back-pressure detector measures replays."""

    def __init__(self, delay: int = 0, files_of: Callable[[int], list[str]] = lambda job_id: []) -> None:
        self.delay, self.files_of = delay, files_of  # files_of: a load job's files, by job id
        self.damage: tuple[int, str] | None = None  # for the next load: (which of its files, "vanish" | "torn")
        self.slow = 0  # steps the next job takes beyond ``delay``
        self.seconds_per_step = 0.0
        self.held: deque[tuple[int, int, list[Callable[[], None]]]] = deque()  # (step it may run, job id, tasks)
        self.finished: list[tuple[int, bool, float]] = []
        self.steps = 0
        self.kinds: dict[int, str] = {}  # job id -> "load" (a file into a CPU chunk) or "store"
        self.ran: Counter[str] = Counter()  # jobs run, by kind and outcome ("load ok", "store failed"), faults done

    def enqueue_load(self, job_id: int, n_tasks: int, tasks: Any) -> None:
        self._hold(job_id, "load", tasks)

    def enqueue_store(self, job_id: int, n_tasks: int, tasks: Any) -> None:
        self._hold(job_id, "store", tasks)

    def _hold(self, job_id: int, kind: str, tasks: Any) -> None:
        self.kinds[job_id] = kind
        self.held.append((self.steps + self.delay + self.slow, job_id, list(tasks)))
        if self.slow:
            self.slow = 0
            self.ran["file slow"] += 1

    def tick(self) -> None:
        """A step ended: run the jobs whose time has come, in order."""
        while self.held and self.held[0][0] <= self.steps:
            self._run()
        self.steps += 1

    def monotonic(self) -> float:
        return self.steps * self.seconds_per_step

    def fault_next(self, index: int, how: str) -> None:
        if how == "slow":
            self.slow = 4 * (index % 4 + 1)
        else:
            self.damage = (index, how)

    def _damage(self, job_id: int) -> None:
        """Remove (``vanish``) or tear (``torn``: half its bytes left, as a writer killed mid-write leaves it) a
        file of this load job; vLLM is not told."""
        assert self.damage is not None
        (index, how), self.damage = self.damage, None
        files = self.files_of(job_id)
        path = Path(files[index % len(files)])
        if how == "vanish":
            path.unlink(missing_ok=True)
        elif path.exists():
            os.truncate(path, path.stat().st_size // 2)
        self.ran[f"file {how}"] += 1

    def _run(self) -> None:
        _step, job_id, tasks = self.held.popleft()
        if self.damage and self.kinds[job_id] == "load":
            self._damage(job_id)
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


def fs_tier_config(root: Path, backpressure: bool = False) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of vLLM's ``fs`` tier on ``root``, with vLLM's back-pressure detector if asked:
    its defaults for a local disk, but out of its warm-up after one store (a program stores a few chunks only)."""
    detector = {"backpressure": {"backpressure_cls": "EMABackpressureDetector", "warmup_completions": 1}}
    detector = detector if backpressure else {}
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1, **detector}


def take_over(connector: Any, io_delay: int, k: int) -> tuple[SharedRegion, HeldIO]:
    """The played worker's view of the primary tier's CPU chunks (of ``k`` GPU blocks), and the fs tier's I/O, from
    now on held by the kit (its threads, idle so far, are stopped). When the connector goes, its shared region is
    released."""
    manager = connector.scheduler.manager
    (tier,) = manager.secondary_tiers
    tier._pool.shutdown(wait=True)
    tier._pool = io = HeldIO(io_delay, lambda job_id: list(map(tier.file_mapper.get_file_name,
                                                               tier._load_job_keys[job_id])))
    if tier.bp_detector is not None:
        _time_in_steps(tier, io)
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
    region = SharedRegion(manager.primary_tier.get_kv_memoryview(), k)
    weakref.finalize(connector, _shut_down, manager, region)
    return region, io


def _time_in_steps(tier: Any, io: HeldIO) -> None:
    """vLLM's back-pressure detector, timing the tier's store jobs on the kit's clock (``HeldIO.monotonic``): its own
    methods, run with that clock as their module ``time``, and each job stamped with it as it is submitted. The disk
    is slow: each step a one-chunk store takes costs twice the detector's high water mark, so the tier comes under
    pressure once its stores take a step (more under a ``slow`` file fault), and out of it through multi-chunk
    stores and idle steps (the detector's decay and cool-down are counted in steps too). The stores it drops are
    counted."""
    detector = tier.bp_detector
    cls = type(detector)
    on_steps = {name: _on_clock(f, io) for name in dir(cls)
                if isinstance(f := getattr(cls, name), FunctionType) and "time" in f.__code__.co_names}
    timed = type(cls.__name__, (cls,), {**on_steps, "__module__": cls.__module__})

    class Counted(timed):  # type: ignore[valid-type, misc]
        def should_store(self, num_blocks: int) -> bool:
            store = bool(super().should_store(num_blocks))
            io.ran["store dropped"] += not store
            return store

    detector.__class__ = Counted
    io.seconds_per_step = 2 * detector._high * tier._block_size / 2**20  # the high water mark is in s/MiB
    # its time constants in steps, as a real disk's pressure passes in a few dozen engine steps
    detector._decay_half_life_s, detector._cooldown_s = 8 * io.seconds_per_step, 4 * io.seconds_per_step
    submit = tier.submit_store

    def submit_on_steps(job: Any) -> None:
        job.submit_time = io.monotonic()
        submit(job)

    tier.submit_store = submit_on_steps


def _on_clock(method: FunctionType, clock: Any) -> FunctionType:
    """The same code, reading ``clock`` where it reads the module ``time``."""
    on_clock = FunctionType(method.__code__, {**method.__globals__, "time": clock}, method.__name__,
                            method.__defaults__, method.__closure__)
    on_clock.__kwdefaults__ = method.__kwdefaults__
    return on_clock


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


def clean_up() -> None:
    """Once no engine is left (a hunt's configuration ran): every connector collected now, and its fs tier shut
    down, and every directory removed. Left to the end, a long hunt's hundreds of engines and tens of thousands of
    files made its exit take minutes."""
    gc.collect()
    for directory in Path(_directories().name).iterdir():
        shutil.rmtree(directory, ignore_errors=True)


def _shut_down(manager: Any, region: SharedRegion) -> None:
    region.bytes.release()
    manager.shutdown()
