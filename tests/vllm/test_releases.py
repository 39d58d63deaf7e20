"""The black box against other vLLM releases, each installed by ``make releases`` in its own venv layered over the
project's (``.venv-vllm/<release>``), run in a subprocess with that venv's Python:

  * vLLM 0.33: the black-box suite (vLLM's own OffloadingConnector, its tiering, SimpleCPUOffloadConnector, the
    known divergences; ours in black-box mode runs on 0.32 only), our connector behind 0.33's real ``Scheduler`` /
    ``AsyncScheduler`` and ``KVOutputAggregator`` in every GPU mode, and the world's worker call order against
    0.33's own model-runner code;
  * vLLM 0.11, the release that shipped the seed bug: the documented example finds the bug in vLLM's own code, its
    trace replays, and the same run passes once its ``break`` is made a ``continue``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASES = ROOT / ".venv-vllm"
EXAMPLE = ROOT / "docs" / "examples" / "find_the_seed_bug.py"
PAGE = ROOT / "docs" / "check-a-vllm-release.md"


VLLM_LOG = ("DEBUG ", "INFO ", "WARNING ", "ERROR ")  # vLLM's own log lines, on stdout


def python_of(release: str) -> str:
    python = RELEASES / release / "bin" / "python"
    if not python.exists():
        pytest.skip(f"vLLM {release} is not installed here: `make releases` installs it (`make test` does)")
    return str(python)


def run(release: str, *args: str, cwd: Path = ROOT, timeout: int = 1800) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVOFFLOAD_MODEL_DIR": str(ROOT / ".cache" / "tiny-llama"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([python_of(release), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# pytest in a release's venv, once its ``import vllm`` is seen to be that release (one vLLM import per suite)
PYTEST_UNDER = """
import sys, pytest, vllm
assert vllm.__version__.startswith(sys.argv[1]), f"vLLM {vllm.__version__} imported, not {sys.argv[1]}"
sys.exit(pytest.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("suite", [
    # vLLM's own OffloadingConnector in black-box mode (ours is checked behind 0.33's real schedulers, below; the
    # kit's own catches of bugs planted in ours and in the reader, on 0.32)
    ["tests/vllm/test_blackbox.py", "-k",
     "not ours and not our_vllm_connector and not seed_bug and not forgets_a_flush"],
    # vLLM's tiering with its fs tier, and its SimpleCPUOffloadConnector, eager and lazy, in black-box mode (the
    # tests of the kit's own tooling on them, its hunt and what it catches, run on 0.32)
    ["tests/vllm/test_blackbox_tiering.py", "-k", "not hunt and not fleet_factory and not is_caught"],
    ["tests/vllm/test_blackbox_simple_cpu.py", "-k", "not hunt and not the_kit_sees"],
    # ours behind 0.33's real schedulers, the world's call order against 0.33's model runners, what a failed
    # synchronous load leaves in 0.33's prefix cache, and the world's hybrid rules against 0.33's schedulers and
    # managers in vLLM's default retention (with every state kept, 0.33 commits a sync speculative step's states as
    # its output arrives: the world follows 0.32; docs/vllm-offloading-connector.md, spec 0.14)
    ["tests/vllm/test_gpu_modes.py", "tests/vllm/test_scheduler_driven.py", "tests/vllm/test_call_order.py",
     "tests/vllm/test_hybrid_rules.py", "tests/vllm/test_sync_loads.py", "-k", "not dense and not every-32"],
], ids=["black-box", "tiering", "simple-cpu", "real-schedulers"])
def test_the_vllm_suites_pass_against_vllm_0_33(suite):
    done = run("0.33", "-c", PYTEST_UNDER, "0.33", "-q", "-p", "no:cacheprovider", *suite)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_the_kit_finds_the_seed_bug_in_vllm_0_11_and_its_trace_replays(tmp_path):
    found = run("0.11", str(EXAMPLE), cwd=tmp_path)
    assert found.returncode == 1, found.stdout[-2000:] + found.stderr[-2000:]
    printed = [line for line in found.stdout.splitlines() if not line.startswith(VLLM_LOG)]
    assert printed[0] == "vLLM 0.11: OffloadingConnector in black-box mode", found.stdout
    finding = printed[1]
    # the seed bug's two faces: a later request's lost block ids crash the store loop, or a store names the wrong block
    assert "RAISED: the connector raised IndexError" in finding or "TRACK" in finding, found.stdout
    assert "state.refuse_next_store(" in found.stdout  # the refusal that triggers it is in the shrunk program
    replayed = run("0.11", "-m", "kvoffload.spec.kit.trace", "seed-bug.jsonl", cwd=tmp_path)
    assert replayed.returncode != 0 and finding in replayed.stderr, replayed.stderr[-2000:]


FIXED = """
import inspect, textwrap
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as oc
source = textwrap.dedent(inspect.getsource(oc.OffloadingConnectorScheduler._get_reqs_to_store))
assert source.count("break") == 1, "the seed bug's break is not where it was"
scope = {}
exec(compile(source.replace("break", "continue"), oc.__file__, "exec"), vars(oc), scope)
oc.OffloadingConnectorScheduler._get_reqs_to_store = scope["_get_reqs_to_store"]
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), {"__name__": "__main__"})
"""


def test_with_continue_instead_of_break_the_same_run_passes(tmp_path):
    """The finding is the ``break``: the same scenario and programs pass once that one word is changed."""
    done = run("0.11", "-c", "import sys\n" + FIXED, str(EXAMPLE), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "kvoffload kit coverage" in done.stdout and "delayed frees:" in done.stdout


def test_the_page_shows_the_example_as_it_is():
    assert EXAMPLE.read_text().split('"""', 2)[2].strip() in PAGE.read_text()


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.11"])
def test_each_supported_release_has_an_adapter(release):
    from kvoffload.impl.testing.blackbox import SUPPORTED
    assert release in SUPPORTED
    assert (ROOT / "impl" / "testing" / "blackbox" / f"vllm_{release.replace('.', '_')}.py").exists()


def test_the_generic_driver_imports_no_vllm():
    code = ("import sys; import kvoffload.impl.testing.blackbox as b; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'; "
            "print(b.SUPPORTED)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
