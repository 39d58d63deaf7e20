"""The Redis tier against a real redis-server on a loopback port, with an ACL user and a password: the first writer
wins, another namespace never reads a record, and every fault an operator's server goes through (SIGKILL and a
restart, a frozen server, a wrong password, a value overwritten by another client, maxmemory eviction) is a counted
miss or a dropped write, never a wrong byte served and never a wait past the timeout."""

import hashlib
import time

import attrs
import pytest

pytest.importorskip("redis", reason="the Redis tier needs redis-py (pip install kvoffload[redis])")

from kvoffload.impl.testing import redis_server  # noqa: E402
from kvoffload.impl.testing.redis_server import PASSWORD, USER, RedisCluster, RedisServer  # noqa: E402
from kvoffload.impl.tiers import TierError  # noqa: E402
from kvoffload.impl.tiers.redis import RedisSettings, RedisTier  # noqa: E402

from ..conftest import needs_redis_server  # noqa: E402
from .test_fs_tier import (KEY, NS, OTHER_NAMESPACES, PAYLOAD, frozen_store_costs_its_timeout, payload,  # noqa: E402
                           read, wait)


@pytest.fixture
def server(redis_server):
    return redis_server


def settings(server, **options) -> RedisSettings:
    return RedisSettings(**{"url": server.url, "username": USER, "password": PASSWORD, **options})


def tier(server, namespace=NS, **options) -> RedisTier:
    return RedisTier(settings(server, **options), namespace, PAYLOAD)


def test_a_record_comes_back_and_a_second_writer_writes_nothing(server):
    first, second = tier(server), tier(server)
    assert first.put([(KEY, payload(1)), (5, payload(2))]) == ["stored", "stored"]
    assert second.put([(KEY, payload(3))]) == ["present"]
    assert read(second) == payload(1) and read(second, 5) == payload(2)
    assert second.exists([KEY, 5, 6]) == [True, True, False] and wait(second.ask([6, 5])) == [False, True]
    assert read(second, 6) is None and second.counters["misses"] == 1 and second.counters["hits"] == 2
    assert server.client().ttl(first.name(KEY)) > 0  # every record expires


def test_one_batch_reads_hits_misses_bad_values_and_errors_each_for_itself_and_the_connection_stays_in_step(
        server):
    """Replies are read off the socket by hand: a miss, a value one byte too long, one too short and one of another
    type (the server's error) between two records leave every other reply where it belongs, then and next time."""
    engine, client = tier(server), server.client()
    assert engine.put([(1, payload(1)), (9, payload(9))]) == ["stored", "stored"]
    good = client.get(engine.name(1))
    client.set(engine.name(3), good + b"!")
    client.set(engine.name(4), good[:-1])
    client.rpush(engine.name(5), b"a list, not a string")
    for _batch in range(2):
        keys = [1, 2, 3, 4, 5, 9]
        buffers = [bytearray(PAYLOAD) for _ in keys]
        assert engine.get(keys, list(map(memoryview, buffers))) == [True, False, False, False, False, True]
        assert bytes(buffers[0]) == payload(1) and bytes(buffers[-1]) == payload(9)
        assert not client.exists(engine.name(3), engine.name(4))  # quarantined (the digest of what was read)
        client.set(engine.name(3), good + b"!")  # back for the second batch
        client.set(engine.name(4), good[:-1])
    assert engine.counters == {"stored": 2, "hits": 4, "misses": 2, "quarantined_length": 2, "quarantined_short": 2,
                               "errors_wrongtype": 2}


def test_another_namespace_never_reads_a_record(server):
    tier(server).put([(KEY, payload(1))])
    for other in OTHER_NAMESPACES:
        assert read(tier(server, other)) is None


def test_a_manifest_set_for_another_namespace_stops_the_attach(server):
    engine = tier(server)
    server.client().set(engine._prefix + "manifest", b'{"namespace": "another one"}', xx=True)
    with pytest.raises(TierError, match="was set for another namespace"):
        tier(server)


def test_a_record_under_another_namespaces_name_is_refused_and_quarantined(server):
    mine, other = tier(server), tier(server, attrs.evolve(NS, weights="updated"))
    other.put([(KEY, payload(1))])
    server.client().copy(other.name(KEY), mine.name(KEY))  # by hand, or a digest collision
    assert read(mine) is None and mine.counters["quarantined_namespace"] == 1
    assert not server.client().exists(mine.name(KEY)) and read(other) == payload(1)


@pytest.mark.parametrize("damage, reason", [(lambda v: v[:len(v) // 2], "short"),
                                            (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum"),
                                            (lambda v: b"garbage" * 10, "short"),
                                            (lambda v: v + b"tail", "length")])
def test_a_value_another_client_overwrote_is_detected_counted_and_deleted(server, damage, reason):
    writer, reader = tier(server), tier(server)
    writer.put([(KEY, payload(1))])
    client, name = server.client(), writer.name(KEY)
    client.set(name, damage(client.get(name)))
    assert read(reader) is None and reader.counters[f"quarantined_{reason}"] == 1
    assert not client.exists(name)  # never served again
    assert writer.put([(KEY, payload(1))]) == ["stored"] and read(reader) == payload(1)


def refuse(tier: RedisTier, name: str, value: bytes) -> None:
    """The tier's quarantine of ``value``, as if that was what it read under ``name``."""
    tier._quarantine(name, hashlib.sha1(value).hexdigest(), len(value), "checksum")


def test_a_quarantine_never_deletes_the_good_record_a_replica_wrote_since(server):
    reader = tier(server)
    reader.put([(KEY, payload(1))])
    client, name = server.client(), reader.name(KEY)
    good = client.get(name)
    refuse(reader, name, b"the damaged value this reader refused")
    assert client.get(name) == good


def test_a_killed_server_is_a_miss_and_a_dropped_write_then_serves_again_after_its_restart(server):
    engine = tier(server)
    engine.put([(KEY, payload(1))])
    server.kill()
    assert read(engine) is None and engine.counters["errors_connection"] == 1
    assert engine.put([(5, payload(2))]) == ["dropped:connection"]
    assert wait(engine.ask([KEY])) == [False]
    server.start()  # no persistence: it comes back empty
    assert read(engine) is None and engine.counters["misses"] == 1
    assert engine.put([(KEY, payload(3))]) == ["stored"] and read(engine) == payload(3)


def test_records_written_before_a_sigkill_come_back_whole_from_a_persistent_server():
    needs_redis_server()
    with RedisServer(persist=True) as server:
        engine = tier(server)
        keys = list(range(20))
        assert engine.put([(key, payload(key)) for key in keys]) == ["stored"] * 20
        server.kill()
        server.start()  # from its append-only file
        later = tier(server)
        assert [read(later, key) for key in keys] == [payload(key) for key in keys]
        assert not any(name.startswith("quarantined") for name in later.counters)


def test_a_frozen_server_costs_a_lookup_its_deadline_and_a_read_its_timeout_never_more(server):
    frozen_store_costs_its_timeout(tier(server, timeout=0.3), server, 1.0, "dropped:timeout")


def test_a_wrong_password_is_a_clear_error_at_start_up_that_names_the_key(server):
    with pytest.raises(TierError, match="shared_tier.password") as refused:
        RedisSettings(url=server.url, username=USER, password="not-it").check()
    assert "not-it" not in str(refused.value) and "not-it" not in repr(settings(server, password="not-it"))
    with pytest.raises(TierError, match="shared_tier.password"):
        RedisSettings(url=server.url).check()  # the default user is off
    with pytest.raises(TierError, match="shared_tier.url"):
        RedisSettings(url=f"redis://127.0.0.1:{redis_server.free_port()}/0", timeout=0.5).check()
    with pytest.raises(TierError, match="shared_tier.password_env"):
        RedisSettings(url=server.url, username=USER, password_env="KVOFFLOAD_NO_SUCH_VARIABLE").check()
    with pytest.raises(TierError, match="rediss://"):
        RedisSettings(url=server.url, tls_ca_file="/etc/ssl/ca.pem").check()


def test_a_password_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_TEST_REDIS_PASSWORD", PASSWORD)
    RedisSettings(url=server.url, username=USER, password_env="KVOFFLOAD_TEST_REDIS_PASSWORD").check()


def test_maxmemory_eviction_is_counted_misses_and_nothing_wrong_is_served():
    needs_redis_server()
    with RedisServer(maxmemory=4 << 20) as server:  # room for about a third of what is written
        engine = tier(server)
        keys = list(range(3000))  # 12 MiB of records
        for start in range(0, len(keys), 100):
            outcomes = engine.put([(key, payload(key)) for key in keys[start:start + 100]])
            assert set(outcomes) <= {"stored", "dropped:oom"}
        served = {key: read(engine, key) for key in keys}
        hits = [key for key, got in served.items() if got is not None]
        assert 0 < len(hits) < len(keys) and engine.counters["misses"] == len(keys) - len(hits)
        assert all(served[key] == payload(key) for key in hits)


def test_a_cluster_spreads_a_namespace_over_its_nodes_and_serves_it_back():
    needs_redis_server()
    with RedisCluster(3) as cluster:
        for node in cluster.nodes:  # a user limited as the README says
            node.client().execute_command("ACL", "SETUSER", "limited", "on", ">limited-secret", *CLUSTER_ACL.split())
        engine = RedisTier(RedisSettings(url=cluster.url, username="limited", password="limited-secret",
                                         cluster=True), NS, PAYLOAD)
        keys = list(range(60))
        assert engine.put([(key, payload(key)) for key in keys]) == ["stored"] * 60
        assert tier_reads(engine, keys) == [payload(key) for key in keys]
        assert engine.put([(0, payload(0))]) == ["present"]
        assert all(node.client().dbsize() > 0 for node in cluster.nodes)


def tier_reads(engine, keys):
    buffers = [bytearray(PAYLOAD) for _ in keys]
    found = engine.get(keys, [memoryview(b) for b in buffers])
    return [bytes(b) if ok else None for ok, b in zip(found, buffers)]


def test_over_tls_with_the_servers_certificate_checked():
    needs_redis_server()
    with RedisServer(tls=True) as server:
        settings = RedisSettings(url=server.url, username=USER, password=PASSWORD, tls_ca_file=str(server.ca))
        settings.check()
        engine = RedisTier(settings, NS, PAYLOAD)
        assert engine.put([(KEY, payload(1))]) == ["stored"] and read(engine) == payload(1)
        with pytest.raises(TierError, match="shared_tier.url"):  # a certificate no CA of ours signed
            RedisSettings(url=server.url, username=USER, password=PASSWORD).check()


ACL = "resetkeys ~kvoffload:* resetchannels -@all +ping +getrange +set +exists +del +eval"  # as README.md says
CLUSTER_ACL = ACL + " +cluster|slots +cluster|shards +command"


def test_a_user_limited_as_the_readme_says_can_do_all_the_tier_does():
    needs_redis_server()
    with RedisServer(acl=ACL) as server:
        settings(server).check()
        engine = tier(server)
        assert engine.put([(KEY, payload(1))]) == ["stored"] and read(engine) == payload(1)
        assert wait(engine.ask([KEY, 5])) == [True, False]
        refuse(engine, engine.name(KEY), b"a value that failed its check")
        engine.delete([KEY])
        assert read(engine) is None
        assert not any(name.startswith("errors") for name in engine.counters), engine.counters


def test_a_batch_that_failed_for_the_connector_may_still_be_done_on_the_server(server):
    """What the world's ``Store.break_connection`` models: a frozen server times the pipeline out (every put
    dropped for the connector), then, thawed, runs the commands it had received: the records are there."""
    engine = tier(server, timeout=0.3)
    server.freeze()
    try:
        assert engine.put([(key, payload(key)) for key in range(3)]) == ["dropped:timeout"] * 3
    finally:
        server.thaw()
    deadline = time.monotonic() + 5
    while engine.exists([0, 1, 2]) != [True] * 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [read(engine, key) for key in range(3)] == [payload(key) for key in range(3)]


def test_the_worlds_broken_connection_does_part_of_a_batch_and_fails_all_of_it():
    from kvoffload.spec.store import Store

    store = Store(capacity=8)
    view = store.open(NS, PAYLOAD)
    store.break_connection(1)
    assert view.put([(key, payload(key)) for key in range(3)]) == ["dropped:connection"] * 3
    assert view.exists([0, 1, 2]) == [True, False, False]  # the first was done on the server
    assert view.put([(1, payload(1))]) == ["stored"]  # the break was for one batch
    store.break_connection(0)
    buffers = [memoryview(bytearray(PAYLOAD)) for _ in range(2)]
    assert view.get([0, 1], buffers) == [False, False] and store.counters["errors_connection"] == 2
    assert view.get([0], buffers[:1]) == [True]


@pytest.mark.parametrize("cluster", [False, True])
def test_a_tier_opened_while_its_server_is_down_counts_misses_and_drops_and_starts_nothing(cluster):
    """A worker opens its tier when its first transfer comes, whatever the server's state then."""
    down = RedisSettings(url=f"redis://127.0.0.1:{redis_server.free_port()}/0", cluster=cluster, timeout=0.3)
    engine = RedisTier(down, NS, PAYLOAD)
    assert engine.put([(KEY, payload(1))]) == ["dropped:connection"]
    assert read(engine) is None and wait(engine.ask([KEY])) == [False]
    assert engine.counters["errors_connection"] == 3  # the manifest, the get, the check
    with pytest.raises(TierError, match="shared_tier.url"):
        down.check()
