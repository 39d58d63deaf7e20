"""Hypothesis profile for every test: $HYPOTHESIS_PROFILE (pr, nightly, mutation), default pr."""

from kvoffload.spec.kit import load_profile

load_profile()
