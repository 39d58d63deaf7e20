"""Worker side of the production connector: submits the plan's copies, reports completions and failures."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvoffload.spec.config import Config, registered
from kvoffload.spec.records import Namespace
from kvoffload.spec.types import Job, TransferPlan, WorkerOutput

from .scheduler import Transfer
from .shared import IOExecutor, Opener, SharedStore, record_copy
from .transfer import Copier, CudaStreamExecutor, HostPool, InlineExecutor, block_views


class OffloadWorker:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._copier: Copier | None = None  # set by register_kv_caches
        self.executor: Any = None
        self.io: Any = None  # runs puts and gets (the engine's executor where one is given, else I/O threads)
        self.worker_store: SharedStore | None = None  # this shard's records in the shared store, once attached
        self.submitted: dict[int, Transfer] = {}  # submitted, not yet polled
        self.load_errors: set[int] = set()  # GPU blocks of failed loads, not yet reported
        self.bytes = {"store": 0, "load": 0, "put": 0, "get": 0}

    def register_kv_caches(self, kv: Any, executor: Any = None) -> None:
        """``kv`` has ``caches`` (name -> tensor) and ``layout``; ``executor`` defaults to CUDA streams when the
        caches live on a GPU, else inline copies."""
        views = block_views(kv.caches, kv.layout)
        self._copier = Copier(views, HostPool(views, self.config.tier_blocks * self.config.k))
        self.io = executor or IOExecutor()
        if executor is None:
            executor = CudaStreamExecutor(views[0].device) if views[0].is_cuda else InlineExecutor()
        self.executor = executor

    def attach_worker_store(self, open: Opener, namespace: Namespace) -> None:
        """This shard's records: ``namespace`` names the shard (its TP rank). After ``register_kv_caches``."""
        self.worker_store = SharedStore(open, namespace, self.config.k * self.copier.pool.row_bytes)

    @property
    def copier(self) -> Copier:
        return registered(self._copier, "copier")

    def handle_preemptions(self, metadata: TransferPlan) -> None:
        """Before the forward pass: the stores of blocks it may write for another request finish first."""
        if metadata.flush:
            self.executor.flush(set(metadata.flush))

    def start_load_kv(self, metadata: TransferPlan) -> None:
        for load in metadata.loads:
            self._submit(load)
        for get in metadata.gets:
            self._submit_record_copy(get)
        sync = {load.job_id for load in metadata.loads if load.sync}
        if sync:  # the forward pass reads them
            self.executor.wait(sync)

    def wait_for_save(self, metadata: TransferPlan) -> None:
        for store in metadata.stores:
            self._submit(store)
        for put in metadata.puts:
            self._submit_record_copy(put)

    def _submit(self, transfer: Transfer) -> None:
        blocks = np.fromiter(transfer.gpu_blocks, dtype=np.int64, count=len(transfer.copies))
        self.copier.check(blocks)
        run = self.copier.plan(transfer.kind, blocks, np.asarray(transfer.host_rows, dtype=np.int64))
        self.submitted[transfer.job_id] = transfer
        self.executor.submit(Job(transfer.job_id, transfer.req_id, transfer.kind, tuple(transfer.copies), run))

    def _submit_record_copy(self, transfer: Transfer) -> None:
        """A put or a get, on the I/O threads: it reads or writes host rows only."""
        self.submitted[transfer.job_id] = transfer
        self.io.submit(Job(transfer.job_id, transfer.req_id, transfer.kind, tuple(transfer.copies),
                           self._record_copy(transfer)))

    def _record_copy(self, transfer: Transfer) -> Callable[[], bool]:
        store = registered(self.worker_store, "worker_store").at(transfer.weights)
        return record_copy(transfer.kind, store, self.copier.pool, transfer.keys, transfer.host_rows, self.config.k)

    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput:
        results = self.executor.poll() + (self.io.poll() if self.io is not self.executor else [])
        recving, failed_recving = set(), set()
        for job_id, success in results:
            transfer = self.submitted.pop(job_id)
            if transfer.kind in ("put", "get"):
                if success:
                    self.bytes[transfer.kind] += len(transfer.copies) * self.copier.pool.row_bytes
                continue
            if transfer.kind == "load":
                if not transfer.sync:  # a synchronous load's request is running: vLLM asserts it is not named
                    recving.add(transfer.req_id)
                if not success and self.config.hybrid:  # vLLM takes no block ids then: the whole request
                    failed_recving.add(transfer.req_id)
                elif not success:
                    self.load_errors.update(transfer.gpu_blocks)
            if success:
                self.bytes[transfer.kind] += len(transfer.copies) * self.copier.pool.row_bytes
        return WorkerOutput(frozenset(), frozenset(recving), tuple(results), frozenset(failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors
