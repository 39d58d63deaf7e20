"""Hypothesis profile for every test: $HYPOTHESIS_PROFILE (pr, nightly, mutation), default pr. Engines compile
nothing ($KVOFFLOAD_EAGER). The Redis tier's server fixture, and the Mooncake tier's pool."""

import os
from pathlib import Path

import pytest

from kvoffload.spec.kit import load_profile

load_profile()

# Every vLLM engine the tests start, in this process or a child, compiles nothing: 3.6 s less per start (about 90
# starts), the connector's hooks run the same (kvoffload.impl.testing.demo.make_llm). Figures come from full runs.
os.environ.setdefault("KVOFFLOAD_EAGER", "1")
# Two workers each run engines whose OpenMP threads span both cores: threads that spin while they wait take the
# core from the other worker's engine. Waiting threads sleep instead: 15-20% less wall time on the engine tests.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest_plugins = ["pytester"]  # tests/kit/test_plugin.py runs the kit's pytest plugin in a scratch project

# The slowest modules start first (CPU seconds in a full run, from --durations), the rest follow in pytest's order.
# `make test` hands tests out one at a time (--dist loadgroup): the workers then end together on short tests, instead
# of one idling for minutes while the other runs a long suite it was handed last. A module whose tests share an
# engine started once per module is one xdist group (its `pytestmark`), so no two workers both start it.
SLOWEST_FIRST = (
    "vllm/test_releases.py",  # 460 s: vLLM 0.33's suites, 175 s the longest single test
    "vllm/test_identity.py",  # 300 s
    "bench/test_benchmarks.py",  # 210 s
    "vllm/test_engine.py",  # 200 s
    "vllm/test_shared_tier.py",  # 150 s
    "stateful/test_equivalence.py",  # 400 s, in tests of 3-12 s
    "vllm/test_blackbox_tiering.py",  # 85 s
    "vllm/test_demos.py",  # 55 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    rank = {module: i for i, module in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank))
               if item.path.is_relative_to(tests) else len(rank))


@pytest.fixture(scope="session", autouse=True)
def preloaded_vllm():
    """The engine processes this worker starts, and those its children start, fork from one that imported vLLM
    already (``kvoffload.impl.testing.preloaded``): its 6 s of imports are paid once."""
    from kvoffload.impl.testing import preloaded

    if preloaded.SOCKET in os.environ:
        yield
        return
    server = preloaded.start()
    yield
    server.kill()
    server.wait()
    os.environ.pop(preloaded.SOCKET)


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
