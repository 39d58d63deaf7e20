"""The reference LRU tier equals the spec tier operation by operation, and a refused store changes nothing."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvoffload.reference import LRUTier
from kvoffload.spec.invariants import Violation, atomic
from kvoffload.spec.tier import Admission, Tier

from .faulty import _EvictThenRefuseTier

KEYS = st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True)


def reference_view(tier: LRUTier) -> tuple:
    return tuple((k, s.ready, s.refs) for k, s in tier.slots.items())


class TierMachine(RuleBasedStateMachine):
    reference_class = LRUTier
    admission = Admission()  # takes every key

    def __init__(self):
        super().__init__()
        threshold, remembered = self.admission.threshold, self.admission.remembered
        self.spec = Tier(3, admission=Admission(threshold, remembered))
        self.ref = self.reference_class(3, threshold, remembered)
        self.storing: list[list[int]] = []  # accepted, not yet completed
        self.loading: list[list[int]] = []

    @rule(keys=KEYS, refuse=st.booleans(), fetched=st.booleans())
    def prepare_store(self, keys, refuse, fetched):
        before = self.spec.view(), reference_view(self.ref)
        accepted = self.spec.prepare_store(keys, refuse, fetched)
        slots = self.ref.prepare_store(keys, refuse, fetched)
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


class AdmittingTierMachine(TierMachine):
    """Blocks taken once offered twice, offers remembered for the last 4 keys (of 10)."""

    admission = Admission(threshold=2, remembered=4)


TestAdmittingTier = AdmittingTierMachine.TestCase


def test_a_key_is_taken_once_offered_threshold_times_and_forgotten_past_the_memory():
    tier = Tier(8, admission=Admission(threshold=2, remembered=2))
    assert tier.prepare_store([1, 2]) == []  # offered once each: nothing taken
    assert tier.prepare_store([1]) == [1]  # twice
    assert tier.prepare_store([3, 4]) == [] and tier.prepare_store([2]) == []  # 2 was forgotten: once again
    assert tier.prepare_store([5], fetched=True) == [5]  # a get's record is always taken, and not counted
    assert 5 not in tier.admission.offers


def test_atomic_catches_a_tier_that_evicts_before_refusing():
    class Broken(TierMachine):
        reference_class = _EvictThenRefuseTier

    with pytest.raises(Violation, match="ATOMIC"):
        run_state_machine_as_test(Broken)
