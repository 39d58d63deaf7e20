"""Small third-party-style adapters for the kit's own tests (importable, so their traces replay by name)."""

from attrs import evolve

from kvoffload.spec import CONNECTOR_METHODS, Config, SpecConnector
from kvoffload.spec.kit import Scenario

# Stores in flight at finishes (delay), a tier small enough to refuse, failures on.
SCENARIO = Scenario(Config(num_gpu_blocks=12, tier_blocks=3, prefix_caching=False), delay=2, failures=True)


class ForgetsDelayedFrees(SpecConnector):
    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return False  # the engine reuses blocks a store still reads


class Undeclared:
    """The spec connector behind nothing but the connector method set: it declares no capabilities."""

    def __init__(self, config: Config) -> None:
        inner = SpecConnector(config)
        for name in CONNECTOR_METHODS:
            setattr(self, name, getattr(inner, name))


class RaisesAtFinish(SpecConnector):
    """A connector with a bug of its own: an exception, not a wrong answer."""

    def request_finished(self, request, block_ids):
        raise IndexError("slot out of range")


class DelaysEveryFree(SpecConnector):
    """Cautious, and safe: every free is delayed, whether or not a store is in flight, and each delayed request is
    reported in finished_sending only ``HOLD`` polls after its stores drained."""

    HOLD = 2

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.held: dict[str, int] = {}  # drained, polls still to wait

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        self.delayed.add(request.req_id)
        return True

    def get_finished(self, finished_req_ids):
        output = super().get_finished(finished_req_ids)
        for req_id in output.finished_sending:
            self.held[req_id] = self.HOLD
        sending = {r for r, n in self.held.items() if n == 0}
        self.held = {r: n - 1 for r, n in self.held.items() if n}
        return evolve(output, finished_sending=frozenset(sending))


class NeverReleases(SpecConnector):
    """Unsafe in no step, but a delayed free that is never reported: the blocks never return to the engine."""

    def get_finished(self, finished_req_ids):
        return evolve(super().get_finished(finished_req_ids), finished_sending=frozenset())
