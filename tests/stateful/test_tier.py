"""The reference LRU tier equals the spec tier operation by operation, and a refused store changes nothing."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvoffload.reference import LRUTier
from kvoffload.spec.invariants import Violation, atomic
from kvoffload.spec.tier import Tier

from .faulty import _EvictThenRefuseTier

KEYS = st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True)


def reference_view(tier: LRUTier) -> tuple:
    return tuple((k, s.ready, s.refs) for k, s in tier.slots.items())


class TierMachine(RuleBasedStateMachine):
    reference_class = LRUTier

    def __init__(self):
        super().__init__()
        self.spec, self.ref = Tier(3), self.reference_class(3)
        self.storing: list[list[int]] = []  # accepted, not yet completed
        self.loading: list[list[int]] = []

    @rule(keys=KEYS, refuse=st.booleans())
    def prepare_store(self, keys, refuse):
        before = self.spec.view(), reference_view(self.ref)
        accepted = self.spec.prepare_store(keys, refuse)
        slots = self.ref.prepare_store(keys, refuse)
        atomic(before[0], self.spec.view(), accepted)
        atomic(before[1], reference_view(self.ref), slots)
        assert (accepted is None) == (slots is None)
        if accepted:
            assert list(slots) == accepted
            assert len(set(slots.values())) == len(slots)  # one slot each
            self.storing.append(accepted)

    @precondition(lambda self: self.storing)
    @rule(i=st.integers(0, 9), ok=st.booleans())
    def complete_store(self, i, ok):
        keys = self.storing.pop(i % len(self.storing))
        self.spec.complete_store(keys, ok)
        self.ref.complete_store(keys, ok)

    @rule(keys=KEYS)
    def load_what_is_ready(self, keys):
        n = self.spec.lookup(keys)
        assert n == self.ref.lookup(keys)
        if n:
            self.spec.prepare_load(keys[:n])
            self.ref.prepare_load(keys[:n])
            self.loading.append(keys[:n])

    @precondition(lambda self: self.loading)
    @rule(i=st.integers(0, 9))
    def complete_load(self, i):
        keys = self.loading.pop(i % len(self.loading))
        self.spec.complete_load(keys)
        self.ref.complete_load(keys)

    @invariant()
    def same_state(self):
        assert self.spec.view() == reference_view(self.ref)
        assert self.spec.events == self.ref.events
        assert len(self.ref.slots) + len(self.ref.free) == self.ref.capacity
        assert len(self.spec.entries) <= self.spec.capacity


TestTier = TierMachine.TestCase


def test_atomic_catches_a_tier_that_evicts_before_refusing():
    class Broken(TierMachine):
        reference_class = _EvictThenRefuseTier

    with pytest.raises(Violation, match="ATOMIC"):
        run_state_machine_as_test(Broken)
