"""kvoffload.spec — the executable definition of correct KV offloading.

Read in this order: ``config`` (sizes, errors), ``types`` (what engine and connector exchange), ``requests`` (a
request, its tokens and hashes), ``memory`` (GPU blocks and the block pool), ``executor`` (when transfers run),
``world`` (the engine), ``tier`` (the offload tier), ``connector`` (the spec connector's decisions),
``invariants`` (what must always hold), ``records`` (the shared tier's records and namespaces), ``store`` (the
store a fleet shares) and ``fleet`` (engines on one store, crashes and restarts). ``kit`` (needs
hypothesis) drives any connector through all of it; ``kit.trace`` replays its failures.
"""

from .config import BlockIdError, Config, ConfigError, UnknownRequestError, registered
from .groups import Group
from .connector import SpecConnector
from .invariants import SPEC_VERSION, Violation, require
from .types import (CAPABILITIES, CONNECTOR_METHODS, FENCED_FREES, FILES, GROUPS, NULL_BLOCK, OBSERVE, PINS, POOL_STORE,
                    REFUSE_STORE, RESET, TRANSFER_FAILURES, Adapter, BlockIds, Connector, Copy, Event, GpuKV, Job, Key,
                    Observation, RequestView, ScheduledRequest, SchedulerOutput, TransferKind, TransferPlan,
                    WorkerOutput, group_key, key_index, offload_keys)
from .executor import Executor
from .memory import GARBAGE, BlockPool, ListKV
from .requests import Request, State
from .world import World

__all__ = [
    "CAPABILITIES", "CONNECTOR_METHODS", "FENCED_FREES", "FILES", "GARBAGE", "GROUPS", "NULL_BLOCK", "OBSERVE", "PINS",
    "POOL_STORE", "REFUSE_STORE", "RESET", "TRANSFER_FAILURES", "Group", "group_key",
    "Adapter", "BlockIds", "BlockPool",
    "SPEC_VERSION", "BlockIdError", "Config", "ConfigError", "Connector", "Copy", "Event", "Executor", "GpuKV", "Job",
    "Key", "ListKV", "Observation", "Request", "RequestView", "ScheduledRequest", "SchedulerOutput", "SpecConnector",
    "State", "TransferKind", "TransferPlan", "UnknownRequestError", "Violation", "WorkerOutput", "World",
    "key_index", "offload_keys", "registered", "require",
]
