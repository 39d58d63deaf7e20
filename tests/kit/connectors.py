"""Small third-party-style adapters for the kit's own tests (importable, so their traces replay by name)."""

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
