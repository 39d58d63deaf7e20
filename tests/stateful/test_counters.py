"""The production connector's counters agree with what the world saw, over whole kit runs: an operator's
dashboard must not report hits the engine never loaded (an admission retried after a failed allocation once
counted its hit twice)."""

from collections import Counter

import pytest

from kvoffload.impl import OffloadConnector
from kvoffload.impl.testing import LayeredKV
from kvoffload.spec.kit import run_conformance

from .scenarios import GPU_MODE_SCENARIOS, SCENARIOS

CASES = {name: {**SCENARIOS, **GPU_MODE_SCENARIOS}[name] for name in
         ("k1-immediate-ample", "k2-delayed", "k1-async-spec2-delayed-failures",
          "k1-tp2-delayed-failures-no-prefix-cache")}


@pytest.mark.parametrize("name", CASES)
def test_counters_match_the_world(name):
    connectors: list[OffloadConnector] = []

    def factory(config):
        connectors.append(OffloadConnector(config))
        return connectors[-1]

    coverage = run_conformance(factory, CASES[name], kv_factory=LayeredKV)
    scheduler_sides = connectors[::CASES[name].config.num_workers]  # each world's first instance
    counted = sum((Counter(c.counters) for c in scheduler_sides), Counter())
    assert coverage.world["tier_hit_tokens"] > 0 and coverage.world["blocks_stored"] > 0
    assert counted["hit_tokens"] == coverage.world["tier_hit_tokens"]
    assert counted["stored_blocks"] == coverage.world["blocks_stored"]
