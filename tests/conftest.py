"""Hypothesis profile for every test: $HYPOTHESIS_PROFILE (pr, nightly, mutation), default pr. Engines compile
nothing ($KVOFFLOAD_EAGER). The Redis tier's server fixture, and the Mooncake tier's pool."""

import os

import pytest

from kvoffload.spec.kit import load_profile

load_profile()

# Every vLLM engine the tests start, in this process or a child, compiles nothing: 3.6 s less per start (about 90
# starts), the connector's hooks run the same (kvoffload.impl.testing.demo.make_llm). Figures come from full runs.
os.environ.setdefault("KVOFFLOAD_EAGER", "1")

pytest_plugins = ["pytester"]  # tests/kit/test_plugin.py runs the kit's pytest plugin in a scratch project


def needs_redis_server() -> None:
    """A test that needs ``redis-server`` and cannot find it fails in CI, and skips elsewhere, with the reason."""
    pytest.importorskip("redis", reason="the Redis tier needs redis-py (pip install kvoffload[redis])")
    from kvoffload.impl.testing.redis_server import missing

    why = missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the Redis tier's tests: {why}")
        pytest.skip(why)


@pytest.fixture
def redis_server():
    """A real redis-server on a loopback port, with an ACL user and a password; stopped after the test."""
    needs_redis_server()
    from kvoffload.impl.testing.redis_server import RedisServer

    with RedisServer() as server:
        yield server


def needs_mooncake() -> None:
    """A test that needs a Mooncake master and client and cannot find them fails in CI, and skips elsewhere."""
    from kvoffload.impl.testing.mooncake_master import missing

    why = missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the Mooncake tier's tests: {why}")
        pytest.skip(why)


@pytest.fixture
def mooncake_pool():
    """A real mooncake_master and one store node on loopback ports; stopped after the test."""
    needs_mooncake()
    from kvoffload.impl.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        yield master
