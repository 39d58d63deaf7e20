"""The conformance kit: drive any connector through the world with Hypothesis and check the invariants.

    from kvoffload.spec.kit import Scenario, run_conformance
    coverage = run_conformance(MyConnector, Scenario(Config(tier_blocks=2)), level="invariants", profile="pr")
    print(coverage)

``factory(config)`` returns an adapter: the ``Connector`` method set plus ``capabilities``, a set of names from
``kvoffload.spec.types`` (OBSERVE, REFUSE_STORE, TRANSFER_FAILURES, FENCED_FREES, RESET, PINS, ...). A rule or
invariant that needs a capability the adapter does not declare is skipped, and every skip is reported with its
reason (a warning, and in the returned ``Coverage``). Level "exact" also runs the spec connector in a twin world fed
the same rules and requires identical worlds and observations after every engine step. A failure is raised shrunk
as a ``Violation`` (an exception the connector raised itself as its subclass ``ConnectorError``), with the spec
version in its message; with ``trace=`` its program is also written as JSON Lines (replay:
``python -m kvoffload.spec.kit.trace FILE``).

One concern per module: ``profiles`` (Hypothesis settings), ``strategies``, ``scenario`` (scenarios, capabilities,
what each rule needs), ``coverage``, ``machine`` (the state machine), ``runners`` (``run_conformance``), ``trace``
(write and replay failing programs) and ``pytest_plugin``. The public API is this package's ``__all__`` and
``kvoffload.spec.kit.trace``; it changes only with ``SPEC_VERSION``. Names are imported on first use: pytest imports
this package for its plugin wherever kvoffload is installed, and must not need Hypothesis for that.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..invariants import SPEC_VERSION
    from .coverage import Coverage
    from .machine import ConformanceMachine, Level, make_machine
    from .profiles import load_profile
    from .runners import run_conformance
    from .scenario import Scenario, SkippedRule, capabilities_of
    from .strategies import max_tokens, prompts

__all__ = ["SPEC_VERSION", "ConformanceMachine", "Coverage", "Level", "Scenario", "SkippedRule", "capabilities_of",
           "load_profile", "make_machine", "max_tokens", "prompts", "run_conformance"]

_HOMES = {"SPEC_VERSION": "..invariants", "Coverage": ".coverage", "ConformanceMachine": ".machine",
          "Level": ".machine", "make_machine": ".machine", "load_profile": ".profiles", "run_conformance": ".runners",
          "Scenario": ".scenario", "SkippedRule": ".scenario", "capabilities_of": ".scenario",
          "max_tokens": ".strategies", "prompts": ".strategies"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
