"""The kit's Hypothesis profiles: the one place its settings live.

They are registered under kvoffload's own names (``kvoffload-pr``, ``kvoffload-nightly``, ``kvoffload-mutation``), so
importing the kit never replaces a profile of the project that uses it, and nothing is loaded at import. The short
names (``pr``, ``nightly``, ``mutation``) mean ours wherever the kit takes a profile name: ``load_profile``,
``run_conformance(profile=...)``, ``$HYPOTHESIS_PROFILE`` and ``--kvoffload-profile``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

from hypothesis import HealthCheck, Phase, settings

PROFILES = {"pr": "kvoffload-pr", "nightly": "kvoffload-nightly", "mutation": "kvoffload-mutation"}  # short: ours
PROFILE_ENV = "HYPOTHESIS_PROFILE"

_COMMON: dict[str, Any] = dict(deadline=None, report_multiple_bugs=False,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# Every profile used for reporting runs without the explain phase: explaining a stateful failure costs minutes (a
# nightly failure found in seconds took minutes to report), and the shrunk program and trace say what it would.
_NO_EXPLAIN = [p for p in Phase if p is not Phase.explain]
# For a test that asks only whether the kit catches a bug, and by which invariant: the first failure, unshrunk
# (``run_conformance(..., phases=FIND_ONLY)``). Shrinking a stateful failure costs 5-300x finding it.
FIND_ONLY = [p for p in _NO_EXPLAIN if p is not Phase.shrink]
settings.register_profile(PROFILES["pr"], derandomize=True, max_examples=120, stateful_step_count=40,
                          phases=_NO_EXPLAIN, **_COMMON)
settings.register_profile(PROFILES["nightly"], max_examples=2000, stateful_step_count=80, phases=_NO_EXPLAIN,
                          **_COMMON)
settings.register_profile(PROFILES["mutation"], derandomize=True, database=None, max_examples=200,
                          stateful_step_count=60, phases=[Phase.generate], **_COMMON)

# pr's seed schedule: its programs are split evenly over these seeds (40 programs each), so a pr run tests the same
# programs in every process, whatever the factory is called and however kvoffload is installed, and does not hang
# on one seed's luck. A failure names the seed it came from. Other profiles: nightly draws fresh programs each run,
# mutation follows derandomize.
SEEDS = {PROFILES["pr"]: (0, 1, 2)}


def seed_schedule(profile: settings) -> tuple[int, ...]:
    """The seeds a kit run under ``profile`` (a registered profile object) is split over; () for none."""
    return next((seeds for name, seeds in SEEDS.items() if profile is settings.get_profile(name)), ())


def profile_name(name: str) -> str:
    """The registered name: ours for a short name, any other name (``kvoffload-pr``, a profile of yours) as given."""
    return PROFILES.get(name, name)


def get_profile(name: str) -> settings:
    """The named profile, without loading it."""
    return settings.get_profile(profile_name(name))


def load_profile(name: str | None = None) -> settings:
    """Make the named profile Hypothesis' default (default: $HYPOTHESIS_PROFILE, else "pr") and return it."""
    name = profile_name(name or os.environ.get(PROFILE_ENV) or "pr")
    settings.load_profile(name)
    return settings.get_profile(name)


@contextmanager
def project_independent() -> Iterator[None]:
    """Run Hypothesis without the constants it collects from the importing project's own modules.

    Hypothesis sometimes draws an integer from the literals of "local" modules (those outside site-packages) that
    happen to be imported. Which ones are depends on what ran earlier in the process, and on whether kvoffload is
    installed editable or not, so the same derandomized profile tested other programs from one run to the next (a
    bug caught in one CI run was missed in the next). The kit's programs depend on the profile alone. If a
    Hypothesis release drops that private hook, this does nothing.
    """
    from hypothesis.internal.conjecture import providers

    collect = getattr(providers, "_get_local_constants", None)
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if collect is None or not isinstance(cache, dict):
        yield
        return
    none_local = providers.Constants()
    providers._get_local_constants = lambda: none_local
    cache.clear()  # the permitted constants cached so far include the local ones
    try:
        yield
    finally:
        providers._get_local_constants = collect
        cache.clear()
