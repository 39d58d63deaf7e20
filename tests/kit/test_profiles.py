"""The kit's Hypothesis profiles are its own (``kvoffload-pr``, ...): importing the kit replaces no profile of the
project using it and loads none, while the short names still mean ours wherever the kit takes a profile name."""

import os
import subprocess
import sys

DOWNSTREAM = """
from hypothesis import settings
settings.register_profile("pr", max_examples=7)
settings.load_profile("pr")

import kvoffload.spec.kit.runners  # every kit module, profiles registered
from kvoffload.spec.kit import load_profile

assert settings.get_profile("pr").max_examples == 7 and settings.default.max_examples == 7, "the kit replaced pr"
assert load_profile("pr").max_examples == 60 == settings.default.max_examples  # asked for: ours
assert load_profile("kvoffload-mutation").stateful_step_count == 60
assert load_profile().max_examples == 2000  # $HYPOTHESIS_PROFILE=nightly
print("ok")
"""


def test_importing_the_kit_keeps_a_projects_own_profiles():
    env = {**os.environ, "HYPOTHESIS_PROFILE": "nightly"}
    done = subprocess.run([sys.executable, "-c", DOWNSTREAM], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_importing_the_kit_package_imports_nothing_yet():
    """pytest imports ``kvoffload.spec.kit`` for its plugin wherever kvoffload is installed: no Hypothesis there."""
    code = "import sys, kvoffload.spec.kit.pytest_plugin; print('hypothesis' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
