"""Hypothesis profile for every test: $HYPOTHESIS_PROFILE (pr, nightly, mutation), default pr."""

from kvoffload.spec.kit import load_profile

load_profile()

pytest_plugins = ["pytester"]  # tests/kit/test_plugin.py runs the kit's pytest plugin in a scratch project
