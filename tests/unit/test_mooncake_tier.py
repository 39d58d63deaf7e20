"""The Mooncake tier against a real ``mooncake_master`` on loopback ports, its client in this process (over TCP):
records come back whole, the first writer wins, another namespace never reads a record, a damaged object is
refused, counted and removed, and a master that is killed or frozen costs a miss or a dropped write, never a wrong
byte and never a wait past the timeout; so does a killed store node, and a full pool evicts or refuses."""

import os
import time

import numpy
import pytest
import torch

from kvoffload.impl.testing import mooncake_master
from kvoffload.impl.testing.mooncake_master import MooncakeMaster
from kvoffload.impl.shared import STAGING_KEPT, record_copy
from kvoffload.impl.tiers import TierError
from kvoffload.impl.transfer import HostPool
from kvoffload.spec.records import seal

from ..conftest import needs_mooncake
from .test_fs_tier import KEY, NS, OTHER_NAMESPACES, PAYLOAD, frozen_store_costs_its_timeout, payload, read, wait

# Mooncake's client reads its call timeout from the environment, once per process, which only an operator (or a test)
# sets: 300 ms here, for the killed and frozen master's tests.
os.environ.setdefault("MC_RPC_TIMEOUT_MS", "300")


@pytest.fixture(autouse=True)
def mooncake_here():
    needs_mooncake()


if mooncake_master.missing() is None:
    from kvoffload.impl.tiers.mooncake import MooncakeSettings, MooncakeTier, client


@pytest.fixture
def master():
    with MooncakeMaster(lease_ms=50) as master:  # a read object may be removed 50 ms on
        yield master


def settings(server, **options) -> "MooncakeSettings":
    return MooncakeSettings(**{"master": server.address, "metadata": server.metadata, "buffer_bytes": 16 << 20,
                               "lease": 0.05, **options})


def tier(master, namespace=NS, **options) -> "MooncakeTier":
    return MooncakeTier(settings(master, **options), namespace, PAYLOAD)


def overwrite(master, name: str, value: bytes) -> None:
    """Another client of the pool replaces the object ``name`` with ``value`` (once its lease is over)."""
    store = client(settings(master))
    time.sleep(0.1)
    assert store.remove(name) == 0
    assert store.put(name, value) == 0


def test_a_record_comes_back_and_a_second_writer_writes_nothing(master):
    first, second = tier(master), tier(master)
    assert first.put([(KEY, payload(1)), (5, payload(2))]) == ["stored", "stored"]
    assert second.put([(KEY, payload(3)), (6, payload(4))]) == ["present", "stored"]
    assert read(second) == payload(1) and read(second, 5) == payload(2) and read(second, 6) == payload(4)
    assert second.exists([KEY, 5, 7]) == [True, True, False] and wait(second.ask([7, 5])) == [False, True]
    assert read(second, 7) is None and second.counters["misses"] == 1 and second.counters["hits"] == 3


def test_one_batch_reads_hits_misses_and_damaged_objects_each_for_itself(master):
    engine = tier(master)
    assert engine.put([(1, payload(1)), (9, payload(9))]) == ["stored", "stored"]
    good = client(settings(master)).get(engine.name(1))
    store = client(settings(master))
    store.put(engine.name(3), good + b"!")
    store.put(engine.name(4), good[:-1])
    keys = [1, 2, 3, 4, 9]
    buffers = [bytearray(PAYLOAD) for _ in keys]
    assert engine.get(keys, list(map(memoryview, buffers))) == [True, False, False, False, True]
    assert bytes(buffers[0]) == payload(1) and bytes(buffers[-1]) == payload(9)
    assert engine.counters["misses"] == 1
    assert engine.counters["quarantined_length"] == 1 and engine.counters["quarantined_short"] == 1


def test_records_staged_where_the_tier_asks_move_whole_and_are_checked_in_place(master):
    """Payloads staged in the tier's own memory (``staging``, as the engine's I/O threads stage them) are put and got
    each as one piece, its header in the room before it: the pool holds the very record a put from elsewhere makes,
    a reader reads it either way, a damaged one is refused in place, and a payload elsewhere in the same batch goes
    as before."""
    writer, reader = tier(master), tier(master)
    keys = [KEY, 5]
    rows = writer.staging(keys, PAYLOAD)
    for row, seed in zip(rows, (1, 2)):
        row[:] = numpy.frombuffer(payload(seed), dtype=numpy.uint8)
    assert writer.put([(key, row.data) for key, row in zip(keys, rows)] + [(7, payload(7))]) == ["stored"] * 3
    store = client(settings(master))
    for key, seed in ((KEY, 1), (5, 2), (7, 7)):
        assert store.get(writer.name(key)) == b"".join(seal(NS, key, payload(seed)))
    assert read(reader) == payload(1) and read(reader, 7) == payload(7)
    overwrite(master, writer.name(5), b"".join(seal(NS, 5, payload(3)))[:-1] + b"!")
    store.put(writer.name(6), b"".join(seal(NS, 6, payload(6)))[:-1])
    keys, elsewhere = [7, KEY, 5, 6], bytearray(PAYLOAD)
    landing = reader.staging(keys[1:], PAYLOAD)
    assert reader.get(keys, [memoryview(elsewhere)] + [row.data for row in landing]) == [True, True, False, False]
    assert bytes(elsewhere) == payload(7) and landing[0].tobytes() == payload(1)
    assert reader.counters["quarantined_checksum"] == reader.counters["quarantined_short"] == 1
    assert writer.staging([KEY] * 2, STAGING_KEPT // 2 + 1) is None  # too big to keep: the engine stages it elsewhere


@pytest.mark.parametrize("staging", ["the tier's", "the thread's own"])
def test_an_engines_put_and_get_move_its_host_rows_exactly(master, staging):
    """The I/O threads' copies (``record_copy``) between a host pool's rows and records, staged in the tier's frames
    or, where the tier has none, in the thread's own buffer: three regions, two rows a record. Each object is the
    record of its rows, region after region, and a get lands them in other rows unchanged."""
    views = [torch.empty(1, width, dtype=torch.uint8) for width in (96, 40, 128)]
    pool, k, keys = HostPool(views, 8), 2, [KEY, 5]
    pool.buffer.copy_(torch.arange(pool.buffer.numel()) * 7 % 251)
    writer, reader = (MooncakeTier(settings(master), NS, k * pool.row_bytes) for _ in range(2))
    if staging == "the thread's own":
        writer.staging = reader.staging = lambda keys, payload_len: None
    assert record_copy("put", writer, pool, keys, [6, 0, 3, 1], k)()
    store = client(settings(master))
    for key, rows in ((KEY, [6, 0]), (5, [3, 1])):
        payload = b"".join(bytes(region[row].tolist()) for region in pool.regions for row in rows)
        assert store.get(writer.name(key)) == b"".join(seal(NS, key, payload))
    assert record_copy("get", reader, pool, keys, [2, 7, 4, 5], k)()
    in_one_piece = not hasattr(writer._buffers, "heads") and not hasattr(reader._buffers, "heads")
    assert in_one_piece == (staging == "the tier's")  # no header went apart from its payload
    for region in pool.regions:
        assert torch.equal(region[[2, 7, 4, 5]], region[[6, 0, 3, 1]])


def test_another_namespace_never_reads_a_record(master):
    tier(master).put([(KEY, payload(1))])
    for other in OTHER_NAMESPACES:
        assert read(tier(master, other)) is None


def test_a_manifest_set_for_another_namespace_stops_the_attach(master):
    engine = tier(master)
    overwrite(master, engine._prefix + "manifest", b'{"namespace": "another one"}')
    with pytest.raises(TierError, match="was set for another namespace"):
        tier(master)


@pytest.mark.parametrize("damage, reason", [(lambda v: v[:len(v) // 2], "short"),
                                            (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum"),
                                            (lambda v: v + b"tail", "length")])
def test_an_object_another_client_replaced_is_detected_counted_and_removed(master, damage, reason):
    writer, reader = tier(master), tier(master)
    writer.put([(KEY, payload(1))])
    store = client(settings(master))
    overwrite(master, writer.name(KEY), damage(store.get(writer.name(KEY))))
    assert read(reader) is None and reader.counters[f"quarantined_{reason}"] == 1
    assert read(reader) is None and reader.counters[f"quarantined_{reason}"] == 1  # refused unread: leased still
    time.sleep(0.1)  # the lease of its read is over: the tier removes it at its next call
    assert reader.exists([KEY]) == [False] and store.is_exist(writer.name(KEY)) == 0  # never served again
    assert writer.put([(KEY, payload(1))]) == ["stored"] and read(reader) == payload(1)


def test_a_killed_master_is_a_miss_and_a_dropped_write_at_once_until_it_is_back(master):
    """The first call after the kill finds the master's connection closed; every call after it would try to
    reconnect, about 4 s each. Instead the pool counts as down, and every call fails at once for ``retry_after``,
    then one call at a time tries again. Nothing is quarantined; after the restart, writes are stored again."""
    engine = tier(master, retry_after=1.0)
    engine.put([(KEY, payload(1))])
    master.kill()
    assert read(engine) is None and engine.counters["errors_rpc"] == 1
    began = time.monotonic()
    assert engine.put([(5, payload(2))]) == ["dropped:down"] and read(engine) is None
    assert wait(engine.ask([KEY, 5])) == [False, False]
    assert time.monotonic() - began < 0.5 and engine.counters["errors_down"] == 3  # at once, each counted
    assert not any(name.startswith("quarantined") for name in engine.counters)
    master.start()  # it comes back empty: the pool's objects were its metadata
    began = time.monotonic()
    while engine.put([(KEY, payload(3))]) != ["stored"]:  # the next try once retry_after is over, until the
        assert time.monotonic() - began < 30  # client has mounted its segment again
        time.sleep(0.2)
    print(f"stored again {time.monotonic() - began:.1f} s after the restart")
    assert read(engine) == payload(3)


def test_a_client_call_that_raises_is_an_error_code_and_the_pool_counts_as_down(master):
    """The client raises (here: refusing an argument) instead of answering: each name gets the tier's ``RAISED``
    code, which puts and gets count as a dropped write or an error (never a failed transfer, uncounted), and the
    pool counts as down for ``retry_after``."""
    from kvoffload.impl.tiers.mooncake import RAISED

    engine = tier(master, retry_after=30.0)
    assert engine._call(engine.store.batch_is_exist, [None, None]) == [RAISED, RAISED]
    assert engine.put([(5, payload(2))]) == ["dropped:down"]


def test_a_killed_store_node_is_a_miss_and_a_dropped_write_until_another_node_lends_memory(master):
    """The store node holding the pool's memory dies: the master still names its objects, but reading one fails
    (Mooncake's TRANSFER_FAIL): a miss, counted, never another record's bytes; a write is placed in the dead node's
    memory, fails the same way and is dropped. Once a node lends memory again, writes are stored."""
    engine = tier(master)
    engine.put([(KEY, payload(1)), (5, payload(2))])
    master.kill_nodes()
    assert read(engine) is None and read(engine, 5) is None and engine.counters["errors_transfer"] == 2
    assert engine.put([(6, payload(3))]) == ["dropped:transfer"] and read(engine, 6) is None
    assert not any(name.startswith("quarantined") for name in engine.counters)
    master.add_node()
    began = time.monotonic()
    while engine.put([(6, payload(3))]) != ["stored"]:
        assert time.monotonic() - began < 30
        time.sleep(0.2)
    assert read(engine, 6) == payload(3)


def test_a_full_pool_evicts_old_records_and_drops_writes_and_serves_nothing_wrong():
    """More records than the pool holds (a 16 MiB node, records of 256 KiB): the master evicts the least recently
    used objects and refuses puts while it is full (NO_AVAILABLE_HANDLE); an evicted record is a miss. Every read
    is the record's own bytes or a miss, and every refusal is counted."""
    size = 256 << 10
    records = {i.to_bytes(32, "big"): bytes([i % 251]) * size for i in range(120)}
    with MooncakeMaster(lease_ms=50, node_bytes=16 << 20) as small:
        engine = MooncakeTier(settings(small), NS, size)
        written = [outcome for key, value in records.items() for outcome in engine.put([(key, value)])]
        buffer = bytearray(size)
        read_back = [bytes(buffer) if engine.get([key], [memoryview(buffer)])[0] else None for key in records]
    assert written.count("stored") < len(records) and set(written) == {"stored", "dropped:pool_full"}
    assert engine.counters["dropped_pool_full"] == written.count("dropped:pool_full")
    assert all(got in (None, value) for got, value in zip(read_back, records.values()))
    assert 0 < sum(got is not None for got in read_back) <= written.count("stored")
    print(f"{written.count('stored')} of {len(records)} stored, {sum(got is not None for got in read_back)} read back")


def test_a_get_that_outlasts_its_lease_is_a_counted_error_never_a_record():
    """The master leases what a get reads for ``default_kv_lease_ttl``, and fails a get whose transfer takes longer
    (LEASE_EXPIRED): with a 1 ms lease, 16 records of 1 MiB are each an error counted by name, and none is served."""
    size = 1 << 20
    with MooncakeMaster(lease_ms=1) as short:
        engine = MooncakeTier(settings(short), NS, size)
        assert engine.put([(i, bytes([i]) * size) for i in range(16)]) == ["stored"] * 16
        assert engine.get(list(range(16)), [memoryview(bytearray(size)) for _ in range(16)]) == [False] * 16
    assert engine.counters["errors_lease_expired"] == 16 and engine.counters["hits"] == 0


def test_a_frozen_master_costs_a_lookup_its_deadline_and_a_read_its_timeout_never_more(master):
    """Its first calls cost the timeout; the pool then counts as down, and a write fails at once."""
    frozen_store_costs_its_timeout(tier(master, retry_after=0.5), master, 1.5, "dropped:down", recover=0.5)


def test_a_master_or_metadata_server_that_cannot_be_reached_is_a_clear_error_that_names_the_key(master):
    with pytest.raises(TierError, match="shared_tier.master: .* cannot be reached"):  # at once, not in 90 s
        settings(master, master="127.0.0.1:1").check()
    with pytest.raises(TierError, match="shared_tier.metadata: .* cannot be reached"):
        settings(master, metadata="http://127.0.0.1:1/metadata").check()
    settings(master).check()


def test_a_pool_whose_node_cannot_join_starts_again_on_new_ports(monkeypatch):
    """A node that cannot join the master on its port goes on to other ports, where no one waits for it (seen under a
    busy suite): the master and the node start again, on new ports, and the pool serves."""
    real, failed = MooncakeMaster.add_node, []

    def add_node(self):
        if not failed:
            failed.append(self.port)
            raise RuntimeError("node-0 did not start: Failed to create client on port 1, retry 1/20")
        return real(self)
    monkeypatch.setattr(MooncakeMaster, "add_node", add_node)
    with MooncakeMaster() as pool:
        assert failed and pool.port != failed[0] and len(pool.nodes) == 1
        assert tier(pool).put([(KEY, payload(1))]) == ["stored"]
