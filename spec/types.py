"""The neutral types that pass between an engine and a connector.

They mirror vLLM v1's ``SchedulerOutput`` / ``KVConnectorOutput`` closely enough that a thin adapter maps one onto
the other, and they need neither torch nor vLLM.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, Protocol, runtime_checkable

from attrs import define, field, frozen

if TYPE_CHECKING:
    from .records import Namespace
    from .store import SharedTier

Key = int  # a tier key: the chained hash of the last GPU block of an offload block (``key_index``), in its group
HASH_BITS = (1 << 62) - 1
Copy = tuple[int, Key, int]  # (GPU block id, tier key, index of that GPU block inside the offload block)
# the direction of a transfer: GPU -> tier, tier -> GPU, or between the tier and the shared store (a "put" copies a
# tier entry into the store, a "get" a record into the tier; they touch no GPU block: their copies name NULL_BLOCK)
TransferKind = Literal["store", "load", "put", "get"]
BlockIds = list[int] | tuple[list[int], ...]  # a block table, or one per KV cache group (GROUPS, hybrid models)


def key_index(j: int, k: int) -> int:
    """The key rule. Offload block ``j`` of a request is GPU blocks ``j*k .. j*k + k-1`` (``k = Config.k``), and
    it is stored and looked up under the hash of its *last* GPU block: ``block_hashes[key_index(j, k)]``. The
    hashes chain, so that one hash names the whole prefix up to the end of the block; an offload block whose last
    GPU block has no hash yet (see ``RequestView``) has no key, and cannot be stored or loaded."""
    return j * k + k - 1


def group_key(block_hash: Key, group: int) -> Key:
    """A block's key in KV cache group ``group`` (vLLM's offload key: hash and group). Group 0's is the hash itself,
    so a model with one group keys its blocks by their hashes. The same in every process, as keys shared by a fleet
    must be: vLLM's block hashes are bytes, whose ``hash()`` Python salts per process, so they go through BLAKE2b
    (an int's ``hash()``, and a tuple of ints', is unsalted)."""
    if group == 0:
        return block_hash
    raw: object = block_hash  # typed as the spec's int keys; vLLM's adapter passes its bytes through
    if isinstance(raw, bytes):
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"group%d" % group).digest(),
                              "little") & HASH_BITS
    return hash((block_hash, group)) & HASH_BITS


def offload_keys(block_hashes: list[Key], k: int, start: int = 0, stop: int | None = None) -> list[Key]:
    """The keys of offload blocks ``[start, stop)`` under the key rule, as far as they exist: ``stop`` defaults to
    (and is capped at) the number of full offload blocks that are hashed. One slice: each key is ``k`` hashes
    after the previous one."""
    full = len(block_hashes) // k
    stop = full if stop is None else min(stop, full)
    return block_hashes[key_index(start, k):stop * k:k]  # the last one read is key_index(stop - 1, k)


class RequestView(Protocol):
    """The request as a connector reads it: vLLM's ``Request`` (through the adapter's ``VllmRequestView``), the
    world's ``Request``. A connector reads nothing else of a request.

    The timing rule, written once:
      * ``num_tokens`` counts the tokens the engine has *seen*: the prompt and the sampled tokens delivered so far.
        Under async scheduling a sampled token reaches the scheduler one step late; drafts never count.
      * ``block_hashes`` has one chained hash per *full* GPU block of those ``num_tokens`` tokens, so it covers
        only tokens the engine has seen. The scheduled tokens (``ScheduledRequest.num_computed_tokens +
        num_scheduled_tokens``) run ahead of it under async scheduling and speculative decoding: a block full
        after a step may have no hash (so no key, ``key_index``) yet, and is stored once it has one.
      * ``num_computed_tokens`` is read in ``update_state_after_alloc`` only: it is then the local prefix hit (GPU
        prefix cache) the scheduler offered at lookup, which is also the lookup's ``num_computed_tokens`` argument;
        the tier's hit starts there. (vLLM updates its request's own count only after ``update_state_after_alloc``,
        so its adapter carries the hit.) Later counts come per step in ``ScheduledRequest``; the request's own
        includes placeholders and unverified drafts, and a connector must not read it then.
      * ``num_prompt_tokens`` never changes: the tokens before the first sampled one.
      * ``failed`` is read in ``request_finished`` only: the request ended with an error (vLLM's ``FINISHED_ERROR``:
        under the "fail" policy, a load it read from failed).
    """

    @property
    def req_id(self) -> str: ...

    @property
    def block_hashes(self) -> list[Key]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def failed(self) -> bool: ...


class ScheduledRequest(NamedTuple):  # a tuple: engines build one per request per step
    """One request in one step's batch.

    kind "new" and "resumed" (after a preemption) carry the *whole* block table in ``block_ids``;
    kind "running" carries only the blocks allocated this step, or None when there are none. In a hybrid model
    (a connector that declares GROUPS) they come in ``group_block_ids`` instead, one tuple per KV cache group, and
    ``block_ids`` is None.
    """

    req_id: str
    kind: Literal["new", "resumed", "running"]
    block_ids: tuple[int, ...] | None
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    group_block_ids: tuple[tuple[int, ...], ...] | None = None


@frozen
class SchedulerOutput:
    step: int
    scheduled: tuple[ScheduledRequest, ...]  # in scheduling order: running first, then admitted
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]  # finished or aborted since the previous step
    # A model with recurrent state: each state block vLLM commits to its prefix cache this step, handed over by id
    # as (request, group, block, tokens the state follows), because a connector cannot find it by position once the
    # next chunk frees it (vLLM's ``boundary_state_offloads``). Our connectors store states by position and ignore it.
    state_handoffs: tuple[tuple[str, int, int, int], ...] = ()
    # A request admitted this step loads synchronously: the workers start loads before the forward pass, and wait
    # for those (vLLM's ``has_sync_kv_loads``)
    has_sync_loads: bool = False


@define
class TransferPlan:
    """The connector metadata of one step: the transfers the worker side must submit, the stores it must finish
    before the forward pass, and the delayed frees to report. Each connector brings its own ``Transfer`` record;
    the plan's shape is common."""

    loads: list[Any] = field(factory=list)
    stores: list[Any] = field(factory=list)
    delayed: frozenset[str] = frozenset()  # finished requests whose blocks stay until their transfers drain
    gets: list[Any] = field(factory=list)  # records to copy from the shared store into the tier
    puts: list[Any] = field(factory=list)  # tier entries to copy into the shared store
    # stores to finish before the forward pass (``handle_preemptions``): a preempted request's, and those reading a
    # block the engine freed without telling (a sliding window's, while the request ran or as it finished)
    flush: frozenset[int] = frozenset()


@frozen
class WorkerOutput:
    """What the worker side reports once per step (vLLM's ``KVConnectorOutput``)."""

    finished_sending: frozenset[str] = frozenset()  # finished requests whose delayed blocks may now be freed
    finished_recving: frozenset[str] = frozenset()  # requests whose load completed (successfully or not)
    job_results: tuple[tuple[int, bool], ...] = ()  # (job id, success): once per transfer from each worker
    # requests whose load failed, as a whole: the engine recomputes them from scratch. A hybrid model's failed load
    # must be reported so (vLLM raises on invalid block ids when a block id does not name one group's block);
    # with one group, invalid block ids (``get_block_ids_with_load_errors``) keep the valid prefix instead.
    failed_recving: frozenset[str] = frozenset()


@frozen
class Event:
    kind: Literal["stored", "removed"]
    keys: tuple[Key, ...]
    medium: str = "CPU"  # or SHARED_MEDIUM: records the shared store holds now (a put landed them)


SHARED_MEDIUM = "SHARED"


@define(eq=False)
class Job:
    """The environment's record of one transfer a worker submitted (its ``job_id`` is the transfer's); the
    environment decides when it executes, fails and is reported."""

    job_id: int
    req_id: str
    kind: TransferKind
    copies: tuple[Copy, ...]
    run: Callable[[], bool | None] = field(repr=False)  # False: it found what it reads missing (a get's record)
    executed: bool = False
    success: bool | None = None  # set when it executes
    reported: bool = False
    weights: int = 0  # the weights the KV it reads was computed with (set at submit)

    @property
    def gpu_blocks(self) -> tuple[int, ...]:
        return tuple(c[0] for c in self.copies if c[0] != NULL_BLOCK)


@frozen
class Observation:
    """A connector's observable state; our connectors must match the spec's exactly."""

    # request -> its block table (one per group, GROUPS in a hybrid model), as the connector tracks it (TRACK)
    tracked: dict[str, tuple[int, ...] | tuple[tuple[int, ...], ...]]
    cursors: dict[str, int]  # request -> its store cursor: offload blocks already offered (stored, in flight, ...)
    tier: tuple[tuple[Key, bool, int], ...]  # (key, ready, ref count), in eviction order
    jobs: tuple[tuple[str, TransferKind, tuple[Copy, ...]], ...]  # unfinished transfers: (request, kind, copies)
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
    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int | None, bool]: ...
    def update_state_after_alloc(self, request: RequestView, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...
    def update_connector_output(self, output: WorkerOutput) -> None: ...
    def request_finished(self, request: RequestView, block_ids: list[int]) -> bool: ...
    def take_events(self) -> list[Event]: ...

    # worker side
    def register_kv_caches(self, kv: Any, executor: Any) -> None: ...  # kv: a GpuKV of the type the adapter works on
    def handle_preemptions(self, metadata: Any) -> None: ...  # this step's metadata, before the forward pass
    def start_load_kv(self, metadata: Any) -> None: ...
    def wait_for_save(self, metadata: Any) -> None: ...
    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput: ...
    def get_block_ids_with_load_errors(self) -> set[int]: ...


CONNECTOR_METHODS = tuple(name for name in vars(Connector) if not name.startswith("_"))
# Optional, called only when the connector has it: ``on_new_request(request)`` as a request arrives, before any
# lookup (vLLM's scheduler calls it from ``add_request``).

# What an adapter declares in ``capabilities``. The kit runs a rule or checks an invariant that needs one only when
# it is declared, and reports every rule it skipped with the reason, so nothing passes silently.
OBSERVE = "observe"  # observe() -> Observation: block tables, cursors, tier, transfers (TRACK, REF, CURSOR, exact)
REFUSE_STORE = "refuse_store"  # refuse_next_store(req_id): the tier's next store allocation for that request fails
TRANSFER_FAILURES = "transfer_failures"  # failed transfers are reported (success=False) and recovered from
# A protocol, not an extra: the connector frees a finished request's blocks at once, even under stores in flight,
# and flushes those stores before any of the blocks is written again (vLLM's OffloadingConnector does this).
# FINISH and the ownership half of SRC then do not apply; the bytes each store reads are still checked.
FENCED_FREES = "fenced_frees"
# reset_cache() -> bool: forget every stored entry (vLLM calls it after a weight update); stores in flight at the
# reset never become loadable. Without it, the kit does not update weights (vLLM would serve stale KV).
RESET = "reset"
# Hybrid models (vLLM's SupportsHMA): block ids come one list per KV cache group (``Config.groups``), in
# ``update_state_after_alloc``, ``request_finished`` and ``ScheduledRequest.group_block_ids``, and a group's block
# that a sliding window freed is ``NULL_BLOCK``. Without it the engine gives every layer full-attention blocks.
GROUPS = "groups"
NULL_BLOCK = -1  # in a block table: a block a window or a state freed, or never needed (vLLM's null block)
# attach_shared_tier(open, namespace): the tier is backed by a store the fleet shares (``store.SharedTier``, opened
# for a namespace by ``open``); ``namespace`` is the engine's KV identity (``records.Namespace``), this worker's
# shard on a worker side. Without it, the kit runs every engine of a fleet with its own tier only.
SHARED = "shared_tier"
# A protocol, not an extra: bind_gpu_block_pool(pool) hands the connector the engine's ``memory.BlockPool``, and it
# holds the GPU blocks its transfers use by reference there (``take``, then ``release``: vLLM's ``touch`` and
# ``free_blocks``; SimpleCPUOffloadConnector does this). A block it holds is not reused, whoever else freed it, so it
# may finish a request with stores in flight, and store blocks no request holds any more: a store of cached blocks
# names no request (``POOL_STORE``). FINISH and the ownership half of SRC then do not apply; the bytes each store
# reads are checked, it never frees what it does not hold (REF), and after draining it holds nothing (RELEASE).
PINS = "pins"
POOL_STORE = ""  # the request of a store of cached GPU blocks, no request's (PINS): each copied under its own key
# file_fault(index, how): the connector keeps KV in files of its own below its CPU tier, which the world does not
# model (vLLM's fs tier). The next file it reads is removed ("vanish": a cleanup, another replica) or torn ("torn":
# its writer was killed mid-write) after it was found and before it is read (``index`` picks one of the files read
# together), or its next file job is slow ("slow": a congested disk, ``index`` saying how slow; the jobs behind it
# wait). The world is not told: what the connector cannot read back it must recompute, and what it cannot write in
# time it may drop. Only where the scenario turns ``file_faults`` on.
FILES = "files"
CAPABILITIES = (OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES, RESET, GROUPS, SHARED, PINS, FILES)
CAPABILITY_METHODS = {OBSERVE: "observe", REFUSE_STORE: "refuse_next_store", RESET: "reset_cache",
                      SHARED: "attach_shared_tier", PINS: "bind_gpu_block_pool", FILES: "file_fault"}


# The methods those capabilities promise, for code that has checked the capability (``capabilities_of``).
class Observable(Protocol):
    def observe(self) -> Observation: ...


class Refusable(Protocol):
    def refuse_next_store(self, req_id: str) -> None: ...


class Resettable(Protocol):
    def reset_cache(self) -> bool | None: ...


class Shareable(Protocol):
    def attach_shared_tier(self, open: Callable[[Namespace, int], SharedTier], namespace: Namespace) -> None:
        """``open(namespace, payload bytes)``: the store's records of one namespace. ``namespace`` is the engine's
        identity, derived from what it computes with now. The engine attaches the store at start and again after
        every ``reset_cache`` (a weight update): from the reset until then the connector neither asks the store nor
        writes to it, and from then on it uses the new namespace (a put or get in flight keeps its own)."""
        ...


class Pinning(Protocol):
    def bind_gpu_block_pool(self, pool: Any) -> None: ...  # the engine's ``memory.BlockPool``


class KeepsFiles(Protocol):
    def file_fault(self, index: int, how: str) -> None: ...


class Grouped(Protocol):
    """GROUPS in a hybrid model: these two take one block table per KV cache group."""

    def update_state_after_alloc(self, request: RequestView, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None: ...
    def request_finished(self, request: RequestView, block_ids: tuple[list[int], ...]) -> bool: ...


@runtime_checkable
class Adapter(Connector, Protocol):
    """What the kit drives: a connector (or a wrapper around one) that declares what else it offers."""

    capabilities: frozenset[str]
