"""What one kit run exercised, and the report it prints."""

from __future__ import annotations

from collections import Counter

from attrs import define, field

from ..invariants import LIVENESS, SPEC_VERSION


@define
class Coverage:
    """What one kit run exercised: how often each rule ran, which preconditions never held, what was skipped and
    why, how often each invariant was evaluated, and what the worlds went through (steps, preemptions, hits...)."""

    rules: Counter[str] = field(factory=Counter)
    enabled: Counter[str] = field(factory=Counter)  # precondition evaluations that held, per guarded rule
    guarded: set[str] = field(factory=set)  # rules behind a precondition
    skipped: dict[str, str] = field(factory=dict)  # needs a capability the adapter does not declare (warned)
    off: dict[str, str] = field(factory=dict)  # turned off by the scenario
    invariants: Counter[str] = field(factory=Counter)
    world: Counter[str] = field(factory=Counter)
    beyond_need: Counter[int] = field(factory=Counter)  # delayed frees released, by steps held beyond need
    examples: int = 0

    def never_held(self) -> list[str]:
        return sorted(r for r in self.guarded if not self.enabled[r] and r not in {*self.skipped, *self.off})

    def __str__(self) -> str:
        lines = [f"kvoffload kit coverage (spec {SPEC_VERSION}): {self.examples} programs, "
                 f"{sum(self.rules.values())} rules, {self.world['steps']} engine steps"]
        lines.append("  rules:      " + ", ".join(f"{r} {n}" for r, n in sorted(self.rules.items())))
        safety = [i for i in self.invariants if i not in LIVENESS]
        for heading, names in (("safety:    ", safety), ("liveness:  ", LIVENESS)):
            lines.append(f"  {heading} " + ", ".join(f"{i} {self.invariants[i]}" for i in sorted(names)))
        lines.append("  world:      " + ", ".join(f"{k} {n}" for k, n in self.world.items() if k != "checks"))
        if self.beyond_need:
            held = ", ".join(f"{steps} ×{n}" for steps, n in sorted(self.beyond_need.items()))
            lines.append(f"  delayed frees: {self.beyond_need.total()} released; steps held beyond need: {held}")
        lines += [f"  never held: {r} (its precondition was always false)" for r in self.never_held()]
        lines += [f"  skipped:    {r}: {why}" for r, why in self.skipped.items()]
        lines += [f"  off:        {r}: {why}" for r, why in self.off.items()]
        return "\n".join(lines)
