"""Scenarios, and what an adapter declares it can do (its capabilities).

A rule or check that needs a capability the adapter does not declare is skipped, and one that needs a scenario switch
that is off is turned off; both are reported with their reason. What each needs is declared once, as a ``Need``
(``needs`` on a rule of the machine, ``declare`` for a check): its precondition and the coverage report's skipped and
off lines (``skipped_by``) are computed from that declaration.
"""

from __future__ import annotations

from typing import Any, Literal

from attrs import field, frozen

from ..config import Config
from ..groups import FULL_ATTENTION
from ..types import CAPABILITIES, CAPABILITY_METHODS


@frozen
class Scenario:
    """One configuration of engine, tier and environment."""

    config: Config = Config()
    delay: int = 0  # steps the environment may hold a transfer back (0: it completes at submit)
    failures: bool = False  # transfers may fail
    max_live: int = 6  # live requests at most
    broken_loads: bool = False  # a persistent fault: every load fails on the last worker (requests must finish)
    # A fleet: engines behind one router, each of the KV identity ``identities`` gives it (0 by default: one model),
    # sharing one store of ``store`` records (0: none) whose existence checks take up to ``store_delay`` steps.
    engines: int = 1
    identities: tuple[int, ...] = field(default=(), converter=tuple)
    store: int = 0
    store_delay: int = 0
    restarts: bool = False  # engines may crash and restart
    store_dead: bool = False  # the store never answers: every lookup must give up on it
    file_faults: bool = False  # files a connector keeps below its CPU tier may vanish, tear, be slow (types.FILES)
    # A fleet's engines update their weights in place to weights the kit picks from a few (so two engines may hold
    # the same weights or other ones whatever their count of updates), and, with restarts, restart on a checkpoint
    # that changed in place (a fine-tune redeployed to the same path)
    weight_versions: bool = False

    def identity(self, engine: int) -> int:
        return self.identities[engine] if engine < len(self.identities) else 0

    @property
    def hybrid(self) -> bool:
        """The model has several KV cache groups (sliding-window and full-attention layers): without GROUPS, vLLM
        turns its hybrid manager off. (A model of one attention kind keeps its one group, sliding window or not.)"""
        return self.config.hybrid

    def __str__(self) -> str:
        c = self.config
        cache = "" if c.prefix_caching else " no-prefix-cache"
        timing = f"delay={self.delay}" if self.delay else "immediate"
        groups = ",".join(map(str, c.groups))
        modes = "".join((" async" if c.async_scheduling else "", f" spec={c.num_spec_tokens}" * bool(c.num_spec_tokens),
                         f" workers={c.num_workers}" * (c.num_workers > 1), " broken-loads" * self.broken_loads,
                         f" groups={groups}" * (c.groups != FULL_ATTENTION), " file-faults" * self.file_faults,
                         " weight-versions" * self.weight_versions,
                         " fail-policy" * (c.load_failure_policy == "fail"), " sync-loads" * c.sync_loads))
        if self.engines > 1 or self.store:
            models = f" models={','.join(map(str, self.identities))}" if any(self.identities) else ""
            delay = f"/delay={self.store_delay}" if self.store_delay else ""
            modes += (f" engines={self.engines}{models} store={self.store}{delay}{' dead' * self.store_dead}"
                      f"{' restarts' * self.restarts}")
        return (f"k={c.k} gpu={c.num_gpu_blocks}{cache} tier={c.tier_blocks} {c.policy} budget={c.token_budget} "
                f"{timing}{' failures' if self.failures else ''}{modes}")


DEFAULT_SCENARIO = Scenario()  # Scenario is frozen: one instance serves as every default

# How the coverage report says that a switch is off (default: "the scenario has <switch>=<value>").
SWITCHED_OFF = {"delay": "the scenario completes transfers at submit (delay=0)",
                "store": "the scenario has no shared store (store=0)"}


class SkippedRule(UserWarning):
    """A rule or invariant the kit could not run against this adapter: a capability it does not declare."""


def capabilities_of(adapter: Any) -> frozenset[str]:
    """The adapter's declared capabilities, checked: known names, and the methods they promise are there."""
    declared = frozenset(getattr(adapter, "capabilities", ()))
    unknown = declared - set(CAPABILITIES)
    if unknown:
        raise TypeError(f"{type(adapter).__name__} declares unknown capabilities {sorted(unknown)}; "
                        f"known: {', '.join(CAPABILITIES)}")
    missing = [f"{name} needs {method}()" for name, method in CAPABILITY_METHODS.items()
               if name in declared and not callable(getattr(adapter, method, None))]
    if missing:
        raise TypeError(f"{type(adapter).__name__} declares capabilities it lacks: {'; '.join(missing)}")
    return declared


@frozen
class Need:
    """What one rule or check needs to run here; every field is optional."""

    capability: str | None = None  # the adapter must declare it
    switch: str | None = None  # a Scenario field that must be on; off, the report lists it under "off"
    mode: str | None = None  # a Scenario field: the check exists only when the scenario turns it on (off is no gap)
    unless: tuple[str, ...] = ()  # capabilities that, declared, replace the check
    note: str = ""  # what is lost without it, added to the reason

    def gap(self, declared: frozenset[str], scenario: Scenario) -> tuple[Literal["off", "skipped"], str] | None:
        """Why it cannot run: ("off", why) for the scenario's choice, ("skipped", why) for the adapter's gap."""
        note = f" ({self.note})" if self.note else ""
        if self.switch and not getattr(scenario, self.switch):
            return "off", SWITCHED_OFF.get(self.switch, f"the scenario has {self.switch}="
                                                        f"{getattr(scenario, self.switch)!r}")
        if self.mode and not getattr(scenario, self.mode):
            return None  # not asked for: nothing is lost
        if self.capability and self.capability not in declared:
            return "skipped", f"the adapter does not declare '{self.capability}'{note}"
        replaced_by = sorted(set(self.unless) & declared)
        if replaced_by:
            return "skipped", f"the adapter declares '{replaced_by[0]}'{note}"
        return None

    def met(self, declared: frozenset[str], scenario: Scenario) -> bool:
        return self.gap(declared, scenario) is None and self.met_mode(scenario)

    def met_mode(self, scenario: Scenario) -> bool:
        """The scenario runs the mode this belongs to (or it belongs to every mode)."""
        return self.mode is None or bool(getattr(scenario, self.mode))


NEEDS: dict[str, Need] = {}  # every rule and check with a need, by the name the coverage report gives it


def declare(name: str, capability: str | None = None, **need: Any) -> Need:
    """Declare what the rule or check ``name`` needs (the one place it is said) and return it."""
    NEEDS[name] = Need(capability, **need)
    return NEEDS[name]


def skipped_by(declared: frozenset[str], scenario: Scenario) -> tuple[dict[str, str], dict[str, str]]:
    """What this adapter cannot be checked for (capabilities it does not declare), and what this scenario turns off
    (a choice, not a gap), each with its reason: computed from what every rule and check declared it needs."""
    report: dict[str, dict[str, str]] = {"skipped": {}, "off": {}}
    for name, need in NEEDS.items():
        if gap := need.gap(declared, scenario):
            report[gap[0]][name] = gap[1]
    return report["skipped"], report["off"]
