"""The shadow monitor: the spec connector runs beside the production connector inside a real engine.

It is fed exactly the calls the production connector gets. After every call it requires the same answers and the
same observable state (block tables, cursors, tier, unfinished transfers), and after every batch it requires both
connectors' block tables to equal the engine's own. A divergence is reported once, with the step, the request and both
views; the engine keeps running on the production connector either way.

One empty engine table is vLLM's own behaviour, not a divergence: after a failed load under
``kv_load_failure_policy="recompute"``, vLLM frees the request's blocks without telling the connector
(``_update_waiting_for_remote_kv``) and allocates afresh at its next admission, which resets the connector's block
table.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from attrs import fields

from kvoffload.spec import SpecConnector
from kvoffload.spec.config import Config
from kvoffload.spec.invariants import same_tables
from kvoffload.spec.types import BlockIds, Observation, SchedulerOutput, WorkerOutput

logger = logging.getLogger("kvoffload.shadow")


class ShadowMonitor:
    def __init__(self, config: Config, production: Any, engine_tables: Callable[[str], BlockIds | None]) -> None:
        self.spec = SpecConnector(config)
        self.production = production
        self.engine_tables = engine_tables  # request id -> the engine's block tables (None: it has none)
        self.grouped = config.hybrid  # tables come one per KV cache group
        self.steps = self.checks = 0
        self.divergences: list[str] = []
        self.load_failed: set[str] = set()  # requests whose load failed, not allocated since: vLLM may free them

    def verdict(self) -> str:
        if self.divergences:
            return f"DIVERGED ({len(self.divergences)}): {self.divergences[0]}"
        return f"ok: {self.steps} steps, {self.checks} checks, no divergence"

    def _diverged(self, what: str) -> None:
        message = f"step {self.steps}: {what}"
        if not self.divergences:
            logger.error("kvoffload shadow monitor: %s", message)
        self.divergences.append(message)

    def _same(self, call: str, ours: Any, spec: Any) -> None:
        self.checks += 1
        if ours != spec:
            self._diverged(f"{call}: connector answered {ours!r}, spec {spec!r}")

    def _same_state(self, call: str) -> None:
        ours, theirs = self.production.observe(), self.spec.observe()
        for f in fields(Observation):
            self.checks += 1
            a, b = getattr(ours, f.name), getattr(theirs, f.name)
            if a == b:
                continue
            if isinstance(a, dict):  # per request: name the requests that differ
                for req_id in sorted({*a, *b}, key=str):
                    if a.get(req_id) != b.get(req_id):
                        self._diverged(f"after {call}, request {req_id}: {f.name} connector {a.get(req_id)}, "
                                       f"spec {b.get(req_id)}")
            else:
                self._diverged(f"after {call}, {f.name} differ\n  connector: {a}\n  spec:      {b}")

    def lookup(self, request: Any, num_computed_tokens: int, answer: tuple[int | None, bool]) -> None:
        self._same(f"lookup of {request.req_id}", answer,
                   self.spec.get_num_new_matched_tokens(request, num_computed_tokens))

    def alloc(self, request: Any, block_ids: BlockIds, num_external_tokens: int) -> None:
        self.load_failed.discard(request.req_id)
        self.spec.update_state_after_alloc(request, block_ids, num_external_tokens)
        self._same_state(f"update_state_after_alloc of {request.req_id}")

    def batch(self, scheduler_output: SchedulerOutput) -> None:
        self.steps += 1
        self.spec.build_connector_meta(scheduler_output)
        self._same_state("build_connector_meta")
        for req_id, table in self.production.observe().tracked.items():
            engine = self.engine_tables(req_id)
            self.checks += 1
            if engine is None or not self._holds(table):
                continue
            if not self._holds(engine) and req_id in self.load_failed:
                continue  # freed by vLLM after the failed load; the next allocation brings a new table
            engine_table = tuple(map(tuple, engine)) if self.grouped else tuple(engine)  # type: ignore[arg-type]
            if not same_tables(engine_table, table, self.grouped):  # the spec's TRACK, null blocks and all
                self._diverged(f"request {req_id}: engine block table {engine_table}, connector {table}")

    def _holds(self, table: Any) -> bool:
        return any(map(len, table)) if self.grouped else bool(table)

    def results(self, output: WorkerOutput) -> None:
        for job_id, success in output.job_results:
            transfer = self.spec.unfinished.get(job_id)
            if not success and transfer is not None and transfer.kind == "load":
                self.load_failed.add(transfer.req_id)
        self.spec.update_connector_output(output)
        self._same_state("update_connector_output")

    def reset(self, done: bool) -> None:
        self._same("reset_cache", done, self.spec.reset_cache())
        self._same_state("reset_cache")

    def finished(self, request: Any, block_ids: BlockIds, delayed: bool) -> None:
        self.load_failed.discard(request.req_id)
        if request.req_id in self.spec.requests:
            self._same(f"request_finished of {request.req_id}", delayed,
                       self.spec.request_finished(request, block_ids))
