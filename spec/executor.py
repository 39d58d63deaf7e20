"""The environment's side of a worker's transfers: when each submitted copy runs, fails or is reported. A copy that
runs late reads the GPU block as it is then, as a GPU copy stream does."""

from __future__ import annotations

from typing import Callable

from attrs import define, field

from .memory import GARBAGE
from .types import GpuKV, Job


@define
class Executor:
    """The environment's side of one worker's transfers. A job is submitted, then executed (its copy runs, or it
    fails without copying), then released for reporting, then polled by the worker. With ``delay`` 0 all of it
    happens at submit; otherwise the environment may hold a job back, but for at most ``delay`` steps."""

    delay: int = 0
    jobs: list[Job] = field(factory=list)  # submitted, not yet polled, in submission order
    last_polled: list[Job] = field(factory=list)
    fail_next: bool = False  # the next job to execute fails
    fail_loads: bool = False  # a persistent fault: every load fails
    before_store: Callable[[Job], None] | None = None  # checks what a store is about to read
    on_submit: Callable[[Job], None] | None = None  # the engine learns of each job
    submitted_at: dict[int, int] = field(factory=dict)  # id(job) -> tick of submission
    ticks: int = 0
    weights: int = 0  # the weights the engine computes with: the KV a store submitted now must read
    kv: GpuKV | None = None  # where failed loads leave garbage

    def submit(self, job: Job) -> None:
        job.weights = self.weights
        if self.on_submit:
            self.on_submit(job)
        self.jobs.append(job)
        self.submitted_at[id(job)] = self.ticks
        if not self.delay:
            self.execute(job)
            job.reported = True

    def tick(self) -> None:
        """One engine step passed: jobs held back for ``delay`` steps complete now."""
        self.ticks += 1
        for job in self.jobs:
            if self.ticks - self.submitted_at[id(job)] >= self.delay:
                if not job.executed:
                    self.execute(job)
                job.reported = True

    def execute(self, job: Job, fail: bool = False) -> None:
        success = not (fail or self.fail_next or (self.fail_loads and job.kind == "load"))
        self.fail_next = False
        if success:
            if job.kind == "store" and self.before_store:
                self.before_store(job)
            success = job.run() is not False
        elif job.kind == "load" and self.kv is not None:
            for block in job.gpu_blocks:  # a load that failed midway leaves garbage behind
                self.kv.write(block, GARBAGE)
        job.executed, job.success = True, success

    def advance(self, index: int, fail: bool) -> None:
        """Move one job a stage on: execute it (or fail it), else release it for reporting."""
        job = self.jobs[index % len(self.jobs)]
        if job.executed:
            job.reported = True
        else:
            self.execute(job, fail)

    def flush(self, job_ids: set[int]) -> None:
        """A worker waits for these jobs to execute now (preemption); they may still fail."""
        for job in self.jobs:
            if job.job_id in job_ids and not job.executed:
                self.execute(job)

    def wait(self, job_ids: set[int]) -> None:
        """A worker waits for these jobs before the forward pass (synchronous loads): each runs now, or fails, and
        its outcome is known at once."""
        for job in self.jobs:
            if job.job_id in job_ids:
                if not job.executed:
                    self.execute(job)
                job.reported = True

    def poll(self) -> list[tuple[int, bool]]:
        self.last_polled = [j for j in self.jobs if j.reported]
        self.jobs = [j for j in self.jobs if not j.reported]
        for job in self.last_polled:
            del self.submitted_at[id(job)]
        return [(j.job_id, bool(j.success)) for j in self.last_polled]

    def drain(self) -> None:
        for job in self.jobs:
            if not job.executed:
                self.execute(job)
            job.reported = True

    def of(self, req_id: str) -> list[Job]:
        return [j for j in self.jobs if j.req_id == req_id]
