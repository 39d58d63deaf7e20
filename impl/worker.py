"""Worker side of the production connector: submits the plan's copies, reports completions and failures."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kvoffload.spec.config import Config, registered
from kvoffload.spec.types import Job, TransferPlan, WorkerOutput

from .scheduler import TransferSpec
from .transfer import Copier, CudaStreamExecutor, HostPool, InlineExecutor, block_views


class OffloadWorker:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._copier: Copier | None = None  # set by register_kv_caches
        self.executor: Any = None
        self.submitted: dict[int, TransferSpec] = {}
        self.pending: Counter[str] = Counter()  # request -> transfers submitted, not yet reported
        self.stores_of: dict[str, set[int]] = {}  # request -> store job ids in flight (for preemption flushes)
        self.draining: set[str] = set()  # finished requests whose transfers are still in flight
        self.invalid_blocks: set[int] = set()
        self.bytes = {"store": 0, "load": 0}

    def register_kv_caches(self, kv: Any, executor: Any = None) -> None:
        """``kv`` has ``caches`` (name -> tensor) and ``layout``; ``executor`` defaults to CUDA streams when the
        caches live on a GPU, else inline copies."""
        views = block_views(kv.caches, kv.layout)
        self._copier = Copier(views, HostPool(views, self.config.tier_blocks * self.config.k))
        if executor is None:
            executor = CudaStreamExecutor(views[0].device) if views[0].is_cuda else InlineExecutor()
        self.executor = executor

    @property
    def copier(self) -> Copier:
        return registered(self._copier, "copier")

    def handle_preemptions(self, req_ids: frozenset[str]) -> None:
        jobs = set().union(*(self.stores_of.get(r, ()) for r in req_ids))
        if jobs:
            self.executor.flush(jobs)

    def start_load_kv(self, metadata: TransferPlan) -> None:
        self.draining |= metadata.delayed
        for spec in metadata.loads:
            self._submit(spec)

    def wait_for_save(self, metadata: TransferPlan) -> None:
        for spec in metadata.stores:
            self._submit(spec)

    def _submit(self, spec: TransferSpec) -> None:
        blocks = np.fromiter(spec.blocks, dtype=np.int64, count=len(spec.copies))
        self.copier.check(blocks)
        run = self.copier.plan(spec.kind, blocks, np.asarray(spec.rows, dtype=np.int64))
        self.submitted[spec.job_id] = spec
        self.pending[spec.req_id] += 1
        if spec.kind == "store":
            self.stores_of.setdefault(spec.req_id, set()).add(spec.job_id)
        self.executor.submit(Job(spec.job_id, spec.req_id, spec.kind, tuple(spec.copies), run))

    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput:
        results = self.executor.poll()
        recving = set()
        for job_id, success in results:
            spec = self.submitted.pop(job_id)
            self._forget(spec)
            if spec.kind == "load":
                recving.add(spec.req_id)
                if not success:
                    self.invalid_blocks.update(spec.blocks)
            if success:
                self.bytes[spec.kind] += len(spec.copies) * self.copier.pool.row_bytes
        sending = {r for r in self.draining if not self.pending[r]}
        self.draining -= sending
        return WorkerOutput(frozenset(sending), frozenset(recving), tuple(results))

    def _forget(self, spec: TransferSpec) -> None:
        self.pending[spec.req_id] -= 1
        if not self.pending[spec.req_id]:
            del self.pending[spec.req_id]
        if spec.kind == "store":
            jobs = self.stores_of[spec.req_id]
            jobs.discard(spec.job_id)
            if not jobs:
                del self.stores_of[spec.req_id]

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self.invalid_blocks = self.invalid_blocks, set()
        return invalid
