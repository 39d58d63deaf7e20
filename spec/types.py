"""The neutral types that pass between an engine and a connector.

They mirror vLLM v1's ``SchedulerOutput`` / ``KVConnectorOutput`` closely enough that a thin adapter maps one onto
the other, and they need neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple, Protocol, runtime_checkable

from attrs import define, field, frozen

Key = int  # a tier key: the chained hash of the last GPU block of an offload block
Copy = tuple[int, Key, int]  # (GPU block id, tier key, index of that GPU block inside the offload block)
TransferKind = Literal["store", "load"]  # the direction of a transfer: GPU -> tier, or tier -> GPU


class ScheduledRequest(NamedTuple):  # a tuple: engines build one per request per step
    """One request in one step's batch.

    kind "new" and "resumed" (after a preemption) carry the *whole* block table in ``block_ids``;
    kind "running" carries only the blocks allocated this step, or None when there are none.
    """

    req_id: str
    kind: Literal["new", "resumed", "running"]
    block_ids: tuple[int, ...] | None
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


@frozen
class SchedulerOutput:
    step: int
    scheduled: tuple[ScheduledRequest, ...]  # in scheduling order: running first, then admitted
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]  # finished or aborted since the previous step


@define
class TransferPlan:
    """The connector metadata of one step: what the worker side must submit, and the delayed frees to report.
    Each connector brings its own transfer type; the plan's shape is common."""

    loads: list[Any] = field(factory=list)
    stores: list[Any] = field(factory=list)
    delayed: frozenset[str] = frozenset()  # finished requests whose blocks stay until their transfers drain


@frozen
class WorkerOutput:
    """What the worker side reports once per step (vLLM's ``KVConnectorOutput``)."""

    finished_sending: frozenset[str] = frozenset()  # finished requests whose delayed blocks may now be freed
    finished_recving: frozenset[str] = frozenset()  # requests whose load completed (successfully or not)
    job_results: tuple[tuple[int, bool], ...] = ()  # (job id, success): once per job from each worker


@frozen
class Event:
    kind: Literal["stored", "removed"]
    keys: tuple[Key, ...]
    medium: str = "CPU"


@define(eq=False)
class Job:
    """One transfer submitted by a worker; the environment decides when it executes, fails and is reported."""

    job_id: int
    req_id: str
    kind: TransferKind
    copies: tuple[Copy, ...]
    run: Callable[[], None] = field(repr=False)
    executed: bool = False
    ok: bool | None = None
    reported: bool = False
    epoch: int = 0  # the weights the KV it reads was computed with (set at submit)

    @property
    def gpu_blocks(self) -> tuple[int, ...]:
        return tuple(c[0] for c in self.copies)


@frozen
class Observation:
    """A connector's observable state; our connectors must match the spec's exactly."""

    tracked: dict[str, tuple[int, ...]]  # request -> GPU block table as the connector believes it
    cursors: dict[str, int]  # request -> offload blocks already handled (stored, in flight, present, refused)
    tier: tuple[tuple[Key, bool, int], ...]  # (key, ready, ref count), in eviction order
    jobs: tuple[tuple[str, TransferKind, tuple[Copy, ...]], ...]  # (request, kind, copies) in flight, sorted
    tier_state: tuple[object, ...] = ()  # the eviction policy's own state (ARC: target, t1, ghosts)


@runtime_checkable
class GpuKV(Protocol):
    """GPU KV memory as the engine sees it: one content id per block (real bytes in the torch version)."""

    num_blocks: int

    def write(self, block_id: int, content: int) -> None: ...

    def holds(self, block_id: int, content: int) -> bool: ...


@runtime_checkable
class Connector(Protocol):
    """vLLM's ``KVConnectorBase_V1`` method set in neutral types; both sides in one object."""

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None: ...
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...
    def update_connector_output(self, output: WorkerOutput) -> None: ...
    def request_finished(self, request: Any, block_ids: list[int]) -> bool: ...
    def take_events(self) -> list[Event]: ...

    # worker side
    def register_kv_caches(self, kv: Any, executor: Any) -> None: ...  # kv: a GpuKV of the type the adapter works on
    def handle_preemptions(self, req_ids: frozenset[str]) -> None: ...
    def start_load_kv(self, metadata: Any) -> None: ...
    def wait_for_save(self, metadata: Any) -> None: ...
    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput: ...
    def get_block_ids_with_load_errors(self) -> set[int]: ...


CONNECTOR_METHODS = tuple(name for name in vars(Connector) if not name.startswith("_"))

# What an adapter declares in ``capabilities``. The kit runs a rule or checks an invariant that needs one only when
# it is declared, and reports every rule it skipped with the reason, so nothing passes silently.
OBSERVE = "observe"  # observe() -> Observation: tracked tables, cursors, tier, jobs (TRACK, REF, CURSOR, exact level)
REFUSE_STORE = "refuse_store"  # refuse_next_store(): the kit makes the tier's next store allocation fail
TRANSFER_FAILURES = "transfer_failures"  # failed transfers are reported (success=False) and recovered from
# A protocol, not an extra: the connector frees a finished request's blocks at once, even under stores in flight,
# and flushes those stores before any of the blocks is written again (vLLM's OffloadingConnector does this).
# FINISH and the ownership half of SRC then do not apply; the bytes each store reads are still checked.
FENCED_FREES = "fenced_frees"
# reset_cache() -> bool: forget every stored entry (vLLM calls it after a weight update); stores in flight at the
# reset never become loadable. Without it, the kit does not update weights (vLLM would serve stale KV).
RESET = "reset"
CAPABILITIES = (OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES, RESET)
CAPABILITY_METHODS = {OBSERVE: "observe", REFUSE_STORE: "refuse_next_store", RESET: "reset_cache"}


# The methods those capabilities promise, for code that has checked the capability (``capabilities_of``).
class Observable(Protocol):
    def observe(self) -> Observation: ...


class Refusable(Protocol):
    def refuse_next_store(self) -> None: ...


class Resettable(Protocol):
    def reset_cache(self) -> bool | None: ...


@runtime_checkable
class Adapter(Connector, Protocol):
    """What the kit drives: a connector (or a wrapper around one) that declares what else it offers."""

    capabilities: frozenset[str]
