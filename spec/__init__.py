"""kvoffload.spec — the executable definition of correct KV offloading.

Read in this order: ``config`` (sizes, errors), ``types`` (what engine and connector exchange), ``world`` (the
engine), ``tier`` (the offload tier), ``connector`` (the spec connector's decisions), ``invariants`` (what must
always hold). ``kit`` (needs hypothesis) drives any connector through all of it; ``trace`` replays its failures.
"""

from .config import BlockIdError, Config, ConfigError, UnknownRequestError
from .connector import SpecConnector
from .invariants import SPEC_VERSION, Violation
from .types import (CAPABILITIES, CONNECTOR_METHODS, FENCED_FREES, OBSERVE, REFUSE_STORE, RESET, TRANSFER_FAILURES,
                    Adapter, Connector, Event, GpuKV, Job, Observation, ScheduledRequest, SchedulerOutput,
                    TransferPlan, WorkerOutput)
from .world import Executor, ListKV, Request, World

__all__ = [
    "CAPABILITIES", "CONNECTOR_METHODS", "FENCED_FREES", "OBSERVE", "REFUSE_STORE", "RESET", "TRANSFER_FAILURES",
    "Adapter",
    "SPEC_VERSION", "BlockIdError", "Config", "ConfigError", "Connector", "Event", "Executor", "GpuKV", "Job",
    "ListKV", "Observation", "Request", "ScheduledRequest", "SchedulerOutput", "SpecConnector",
    "TransferPlan", "UnknownRequestError", "Violation", "WorkerOutput", "World",
]
