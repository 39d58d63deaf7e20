"""The production connector in neutral types: scheduler side and worker side in one class, as vLLM builds it."""

from __future__ import annotations

from typing import Any

from kvoffload.spec.config import Config
from kvoffload.spec.records import Namespace
from kvoffload.spec.types import (FENCED_FREES, GROUPS, OBSERVE, REFUSE_STORE, RESET, SHARED, TRANSFER_FAILURES,
                                  Observation)

from .scheduler import OffloadScheduler
from .shared import SHARED_COUNTERS, Opener
from .worker import OffloadWorker


class OffloadConnector(OffloadScheduler, OffloadWorker):
    capabilities = frozenset({OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES, RESET, GROUPS, SHARED})

    def __init__(self, config: Config) -> None:
        OffloadScheduler.__init__(self, config)
        OffloadWorker.__init__(self, config)

    def attach_shared_tier(self, open: Opener, namespace: Namespace) -> None:
        """Both sides: the scheduler's existence checks, this shard's puts and gets."""
        OffloadScheduler.attach_shared_tier(self, open, namespace)
        if self._copier is not None:  # a worker side here too (vLLM's scheduler role has none)
            self.attach_worker_store(open, namespace)

    def stats(self) -> dict[str, Any]:
        """Counters for operators: hits, lookups, refusals, evictions, blocks admission left out, failures, bytes and
        seconds per direction."""
        seconds = getattr(self.executor, "seconds", {})
        store = self.worker_store.counters() if self.worker_store else dict.fromkeys(SHARED_COUNTERS, 0)
        io_seconds = getattr(self.io, "seconds", {})
        return {**self.counters, "alloc_failures": self.tier.refusals, "evictions": self.tier.evictions,
                "unadmitted_blocks": self.tier.unadmitted,
                "bytes_stored": self.bytes["store"], "bytes_loaded": self.bytes["load"],
                "store_seconds": seconds.get("store", 0.0), "load_seconds": seconds.get("load", 0.0), **store,
                "shared_put_bytes": self.bytes["put"], "shared_got_bytes": self.bytes["get"],
                "shared_put_seconds": io_seconds.get("put", 0.0), "shared_get_seconds": io_seconds.get("get", 0.0),
                "shared_backpressure_drops": getattr(self.io, "dropped", 0)}

    # ---- for the conformance kit ----
    def observe(self) -> Observation:
        live = {r: s for r, s in self.requests.items() if s.allocated}
        return Observation(
            tracked={r: tuple(map(tuple, s.block_tables)) if self.hybrid else tuple(s.block_tables[0])
                     for r, s in live.items()},
            cursors={r: s.cursor for r, s in live.items()},
            tier=self.tier.view(),
            jobs=tuple(sorted((t.req_id, t.kind, tuple(t.copies)) for t in self.unfinished.values())),
            tier_state=self.tier.policy.state(),
        )

    def refuse_next_store(self, req_id: str) -> None:
        """Fault injection: the tier refuses the next store allocation made for this request."""
        self.refusing.add(req_id)
