"""Known offloading bugs, each re-created as a small, named deviation from the reference connector.

The conformance kit must catch every one (``test_faulty_variants.py``). Add a bug here when you learn of one.
"""

from __future__ import annotations

from kvoffload.reference import LRUTier, ReferenceConnector


class BreakOnRefusedStore(ReferenceConnector):
    """The seed bug (vLLM v0.11.0): a refused store allocation ``break``s out of the batch loop, so every later
    request in the batch misses this step's new block ids."""

    def _collect_stores(self, scheduler_output, plan) -> None:
        for sched in scheduler_output.scheduled:
            self._update_block_ids(sched)
            keys, first = self._storable_keys(sched)
            slots = self.tier.prepare_store(keys)
            if slots is None:
                break  # the bug: should be `continue`
            if slots:
                plan.stores.append(self._store_transfer(sched.req_id, first, keys, slots))


class NoFlushOnPreemption(ReferenceConnector):
    """A preempted request's in-flight stores are not flushed, so they read its blocks after they were reused."""

    def handle_preemptions(self, req_ids) -> None:
        pass


class FreeWhileStoring(ReferenceConnector):
    """``request_finished`` lets the engine free blocks that a store still reads."""

    def request_finished(self, request, block_ids) -> bool:
        super().request_finished(request, block_ids)
        self._delayed.discard(request.req_id)
        return False


class CursorNotRewound(ReferenceConnector):
    """Preemption keeps the store cursor, so blocks recomputed after the resume are never offered again."""

    def _rewind(self, req_id: str) -> None:
        self._next_stored.setdefault(req_id, 0)


class _EvictThenRefuseTier(LRUTier):
    def prepare_store(self, keys):
        new = [key for key in keys if key not in self.slots]
        self.evict(self.evictable(set(keys))[:max(len(new) - len(self.free), 0)])  # the bug: evicts first
        return super().prepare_store(keys)


class EvictBeforeRefusing(ReferenceConnector):
    """A failed ``prepare_store`` evicts entries before it gives up: a refusal is no longer side-effect free."""

    tier_class = _EvictThenRefuseTier


class _IgnorePinsTier(LRUTier):
    def evictable(self, protected):
        return [key for key, slot in self.slots.items() if slot.ready and key not in protected]  # the bug: refs


class EvictPinned(ReferenceConnector):
    """The tier evicts an entry that an in-flight load has pinned; its slot is reused under the load."""

    tier_class = _IgnorePinsTier


VARIANTS = [BreakOnRefusedStore, NoFlushOnPreemption, FreeWhileStoring, CursorNotRewound, EvictBeforeRefusing,
            EvictPinned]
