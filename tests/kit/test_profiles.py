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
assert load_profile("pr").max_examples == 120 == settings.default.max_examples  # asked for: ours
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


SAME_PROGRAMS = """
import sys
from kvoffload.spec import Config, SpecConnector
from kvoffload.spec.kit import Scenario, run_conformance

def first(config):
    return SpecConnector(config)

def renamed_factory(config):
    return SpecConnector(config)

scenario = Scenario(Config(tier_blocks=3, prefix_caching=False), delay=2, failures=True)
before = run_conformance(first, scenario, profile="pr")
sys.path.insert(0, sys.argv[1])
import project_constants  # a module of the project: its literals join Hypothesis' pool of "local" constants
after = run_conformance(renamed_factory, scenario, profile="pr")
print(before.rules == after.rules and before.world == after.world, dict(before.rules))
"""


def test_pr_runs_the_same_programs_whatever_the_factory_is_called_and_whatever_is_imported(tmp_path):
    """Found when CI ran the suite in a fresh clone: a bug caught in one run was missed in the next, because
    Hypothesis draws some integers from literals of the project's modules that happen to be imported, and seeded
    the programs from the factory's name. The kit now ignores those constants and names every machine alike."""
    (tmp_path / "project_constants.py").write_text("HEAD_SIZE = 128\nWORKERS = 200\n")  # the kind that steered it
    done = subprocess.run([sys.executable, "-c", SAME_PROGRAMS, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("True"), done.stdout + done.stderr
