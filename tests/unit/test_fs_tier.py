"""The filesystem tier on real files and real processes: the first writer wins, a killed writer leaves nothing that
is served, a damaged record is quarantined and counted, an I/O error is a miss that deletes nothing, and another
namespace never reads a record."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import attrs
import pytest

from kvoffload.impl.tiers import FileTier, SharedTier, TierError

from . import faulty_tiers
from kvoffload.spec.records import Namespace

NS = Namespace(model="tiny-llama", weights="sha256:0f3a", kv_dtype="bfloat16", kv_layout="kv_first", block_size=16,
               hash_block_size=16, hash_algorithm="sha256", hash_seed="none-hash:0")
PAYLOAD = 4096
KEY = bytes(range(32))


# NS with one field changed each: another KV dtype, other weights, another configuration, tenant and model
OTHER_NAMESPACES = (attrs.evolve(NS, kv_dtype="float8_e4m3fn"), attrs.evolve(NS, weights="updated"),
                    attrs.evolve(NS, config="rope_theta=500000"), attrs.evolve(NS, tenant="b"),
                    attrs.evolve(NS, model="other-model"))


def payload(seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(PAYLOAD))


def read(tier: SharedTier, key=KEY) -> bytes | None:
    buffer = bytearray(PAYLOAD)
    return bytes(buffer) if tier.get([key], [memoryview(buffer)])[0] else None


def wait(answer, limit=5.0):
    """An existence check's answer, once the tier has it (within ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not answer.done():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return answer.result()


def frozen_store_costs_its_timeout(engine: SharedTier, store, limit: float, dropped: str, recover: float = 0) -> None:
    """A store that stops answering (``store.freeze()``) costs a lookup its deadline and a read or write the tier's
    timeout (a read under ``limit`` seconds), each counted, never a wrong byte; thawed, it serves again (``recover``
    seconds on)."""
    engine.put([(KEY, payload(1))])
    store.freeze()
    try:
        answer = engine.ask([KEY])
        assert not answer.done()  # asking never waits for the store; the connector gives up at its deadline (0.1 s)
        time.sleep(0.1)  # (it was done by then once, in a full make test: the Mooncake tests time out at 0.3 s)
        assert answer.waited() >= 0.1
        began = time.monotonic()
        assert read(engine) is None
        assert time.monotonic() - began < limit and engine.counters["errors_timeout"] >= 1
        assert engine.put([(5, payload(2))]) == [dropped]
        assert wait(answer) == [False]  # the check itself ends at the timeout
    finally:
        store.thaw()
    time.sleep(recover)
    assert read(engine) == payload(1)  # a fresh call: no late reply is taken for this one


def test_a_record_comes_back_and_a_second_put_writes_nothing(tmp_path, tier_class=FileTier):
    tier = tier_class(tmp_path, NS, PAYLOAD)
    assert tier.put([(KEY, payload(1)), (5, payload(2))]) == ["stored", "stored"]
    assert tier.put([(KEY, payload(3))]) == ["present"]
    assert read(tier) == payload(1) and read(tier, 5) == payload(2)
    assert tier.exists([KEY, 5, 6]) == [True, True, False]
    assert read(tier, 6) is None and tier.counters["misses"] == 1
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_replica_attaching_later_reads_the_first_ones_records(tmp_path):
    FileTier(tmp_path, NS, PAYLOAD).put([(KEY, payload(1))])
    assert read(FileTier(tmp_path, NS, PAYLOAD)) == payload(1)


def test_another_namespace_never_reads_a_record(tmp_path):
    FileTier(tmp_path, NS, PAYLOAD).put([(KEY, payload(1))])
    for other in OTHER_NAMESPACES:
        assert read(FileTier(tmp_path, other, PAYLOAD)) is None


def test_a_record_copied_into_another_namespace_is_quarantined(tmp_path):
    """A record placed under another namespace's directory (by hand, or a digest collision) fails its check."""
    mine, other = FileTier(tmp_path, NS, PAYLOAD), FileTier(tmp_path, attrs.evolve(NS, weights="updated"), PAYLOAD)
    mine.put([(KEY, payload(1))])
    other.path(KEY).parent.mkdir(parents=True)
    os.link(mine.path(KEY), other.path(KEY))
    assert read(other) is None and other.counters["quarantined_namespace"] == 1
    assert not other.path(KEY).exists() and read(mine) == payload(1)


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:-1], "short"), (lambda data: data + b"x", "length"),
    (lambda data: data[:100] + bytes([data[100] ^ 4]) + data[101:], "checksum"),
    (lambda data: b"XXXX" + data[4:], "magic")])
def test_a_damaged_record_is_quarantined_counted_and_missed(tmp_path, damage, reason, tier_class=FileTier):
    tier = tier_class(tmp_path, NS, PAYLOAD)
    tier.put([(KEY, payload(1))])
    path = tier.path(KEY)
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(damage(data))
    assert read(tier) is None and tier.counters[f"quarantined_{reason}"] == 1
    assert not path.exists() and len(list((tier.dir / "quarantine").iterdir())) == 1
    assert tier.put([(KEY, payload(1))]) == ["stored"] and read(tier) == payload(1)  # written again, whole


def test_the_manifest_is_checked_at_attach(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    manifest = json.loads((tier.dir / "manifest.json").read_text())
    assert manifest["namespace"]["model"] == "tiny-llama"
    manifest["namespace"]["kv_dtype"] = "float16"
    (tier.dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TierError, match="another namespace"):
        FileTier(tmp_path, NS, PAYLOAD)


def _race(root, seed, barrier, results):
    tier = FileTier(root, NS, PAYLOAD)
    barrier.wait()
    results.put((seed, tier.put([(KEY, payload(seed))])[0]))


def test_the_first_writer_wins_across_processes(tmp_path):
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(6), context.Queue()
    writers = [context.Process(target=_race, args=(tmp_path, seed, barrier, results)) for seed in range(6)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(30)
    outcomes = dict(results.get(timeout=5) for _ in writers)
    winners = [seed for seed, outcome in outcomes.items() if outcome == "stored"]
    assert len(winners) == 1 and set(outcomes.values()) == {"stored", "present"}
    assert read(FileTier(tmp_path, NS, PAYLOAD)) == payload(winners[0])  # whole, the winner's
    assert not list(tmp_path.rglob("*.tmp"))


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    from kvoffload.impl.tiers import fs
    from tests.unit.test_fs_tier import KEY, NS, PAYLOAD, payload

    real_fsync = os.fsync
    def stall(fd):  # the record is written, not yet durable nor linked: the writer dies here
        print("writing", flush=True)
        time.sleep(60)
    fs.os.fsync = stall
    fs.FileTier(sys.argv[1], NS, PAYLOAD).put([(KEY, payload(1))])
""")


def test_a_writer_killed_mid_write_leaves_nothing_that_is_served(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    tier = FileTier(tmp_path, NS, PAYLOAD)
    assert list(tmp_path.rglob("*.tmp")) and not tier.exists([KEY])[0]  # only its temporary file is left
    assert read(tier) is None
    assert tier.put([(KEY, payload(2))]) == ["stored"] and read(tier) == payload(2)
    (torn,) = tmp_path.rglob("*.tmp")
    assert tier.reclaim(1 << 30) == 0 and torn.exists()  # within the budget, and it may be a live write
    stamp = time.time() - FileTier.ABANDONED - 1
    os.utime(torn, (stamp, stamp))
    size = torn.stat().st_size
    assert tier.reclaim(1 << 30) == size
    assert not torn.exists() and read(tier) == payload(2)  # the killed writer's file went, the record stayed


FD_STARVED_READER = textwrap.dedent("""
    import os, resource, sys
    from kvoffload.impl.tiers import FileTier
    from tests.unit import faulty_tiers
    from tests.unit.test_fs_tier import KEY, NS, PAYLOAD

    tier = getattr(faulty_tiers, sys.argv[2], FileTier)(sys.argv[1], NS, PAYLOAD)
    tier.ask([KEY]).result(timeout=5)  # the first listing ends before the descriptors run out
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    try:
        while True:
            held.append(open(os.devnull))
    except OSError:
        pass  # no descriptor left: every open fails with EMFILE now
    buffer = bytearray(PAYLOAD)
    print(tier.get([KEY], [memoryview(buffer)]), dict(tier.counters))
""")


def test_an_io_error_is_a_miss_that_deletes_nothing(tmp_path, tier_class=FileTier):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(KEY, payload(1))])
    done = subprocess.run([sys.executable, "-c", FD_STARVED_READER, str(tmp_path), tier_class.__name__],
                          capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), timeout=60)
    assert done.stdout.strip() == "[False] {'errors_EMFILE': 1}", done.stderr
    assert read(tier) == payload(1)  # still there, whole


def test_a_store_that_cannot_write_drops_the_record_and_says_why(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    (tier.dir / tier.path(KEY).parent.name).write_text("not a directory")  # the fan-out directory is a file
    assert tier.put([(KEY, payload(1))]) == ["dropped:EEXIST"] and tier.counters["dropped_EEXIST"] == 1
    assert read(tier) is None


def _age(tier: FileTier, keys, seconds_ago: float) -> None:
    for key in keys:
        stamp = time.time() - seconds_ago
        os.utime(tier.path(key), (stamp, stamp))


def test_the_budget_holds_for_the_whole_directory_oldest_first(tmp_path, tier_class=FileTier):
    """Two replicas (here: an engine before and after a weight update) share one directory and one budget."""
    old, new = tier_class(tmp_path, NS, PAYLOAD), tier_class(tmp_path, attrs.evolve(NS, weights="updated"), PAYLOAD)
    old.put([(i, payload(i)) for i in range(6)])
    new.put([(i, payload(i)) for i in range(6, 12)])
    _age(old, range(6), 600)
    _age(new, range(6, 12), 300)
    record = old.path(0).stat().st_size
    assert new.reclaim(budget=8 * record, lease=60) == 4 * record  # one budget, summed over both namespaces
    assert old.exists(range(6)) == [False] * 4 + [True] * 2 and all(new.exists(range(6, 12)))
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvr")) <= 8 * record


def test_a_record_looked_up_within_its_lease_is_never_reclaimed(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(i, payload(i)) for i in range(5)])
    _age(tier, range(5), 600)
    assert tier.exists([1, 3]) == [True, True]  # a lookup promises them: their leases start now
    tier.reclaim(budget=0, lease=60)
    assert [read(tier, i) for i in range(5)] == [None, payload(1), None, payload(3), None]


def test_a_killed_writers_temporary_file_is_reclaimed_once_old(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(KEY, payload(1))])
    stale = tier.path(KEY).with_name(".stale.tmp")
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 600, time.time() - 600))
    tier.reclaim(budget=tier.path(KEY).stat().st_size, lease=60)
    assert not stale.exists() and read(tier) == payload(1)


def test_a_file_tier_is_a_shared_tier_whose_existence_checks_answer_later(tmp_path):
    """The connector asks without waiting: the answer is read at a later step, and says how long it has waited."""
    tier: SharedTier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(KEY, payload(1))])
    answer = tier.ask([KEY, 5])
    assert answer.result(timeout=5) == [True, False] and answer.done() and 0 <= answer.waited() < 5


def test_a_fresh_ask_sees_a_record_another_process_quarantined(tmp_path):
    """The scheduler's tier and a worker's are two instances (two processes in vLLM): when the worker's get
    quarantines a damaged record, the scheduler's index still lists it until its next listing. A lookup's second
    ask, after that get failed, asks fresh: each file looked for, the quarantined one gone."""
    scheduler, worker = FileTier(tmp_path, NS, PAYLOAD), FileTier(tmp_path, NS, PAYLOAD)
    worker.put([(KEY, payload(1)), (5, payload(2))])
    eventually(lambda: scheduler.ask([KEY, 5]).result() == [True, True], "the scheduler's index never listed them")
    path = worker.path(5)
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    assert worker.get([KEY, 5], [memoryview(bytearray(PAYLOAD)) for _ in range(2)]) == [True, False]
    assert scheduler.ask([KEY, 5]).result(timeout=5) == [True, True]  # the index, listed before the quarantine
    assert scheduler.ask([KEY, 5], fresh=True).result(timeout=5) == [True, False]


def eventually(condition, what: str) -> None:
    """Poll ``condition`` (it waits on the tier's I/O threads) for up to 5 s."""
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_ask_renews_the_lease_of_each_record_it_finds(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(KEY, payload(1))])
    old = time.time() - 600
    os.utime(tier.path(KEY), (old, old))
    assert tier.ask([KEY, 5]).result(timeout=5) == [True, False]
    eventually(lambda: tier.path(KEY).stat().st_mtime > old + 500, "the lease was never renewed")


def test_a_record_found_again_soon_after_its_renewal_is_not_renewed_again(tmp_path):
    """Every lookup of a shared prefix finds its records: renewing each of them each time would keep an I/O thread
    busy (and taking the GIL from the scheduler thread) for leases that are far from running out."""
    tier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(KEY, payload(1))])
    old = time.time() - 600
    os.utime(tier.path(KEY), (old, old))
    tier.ask([KEY])
    eventually(lambda: tier.path(KEY).stat().st_mtime > old + 500, "the lease was never renewed")
    os.utime(tier.path(KEY), (old, old))
    tier.ask([KEY])
    eventually(lambda: not tier._found, "the renewal never ran")
    assert tier.path(KEY).stat().st_mtime == old  # renewed a moment ago: left alone
    tier.RENEW_AGAIN = 0.0
    tier.ask([KEY])
    eventually(lambda: tier.path(KEY).stat().st_mtime > old + 500, "the lease was never renewed once due")


def test_another_replicas_record_is_found_once_the_directory_is_listed_again(tmp_path):
    mine, theirs = FileTier(tmp_path, NS, PAYLOAD, refresh=0.05), FileTier(tmp_path, NS, PAYLOAD)
    assert mine.ask([KEY]).result(timeout=5) == [False]
    theirs.put([(KEY, payload(1))])
    eventually(lambda: mine.ask([KEY]).result()[0], "a replica's record was never found")
    assert read(mine) == payload(1)


def test_after_an_idle_spell_the_keys_the_index_lacks_are_looked_for_before_the_answer(tmp_path):
    mine, theirs = FileTier(tmp_path, NS, PAYLOAD, refresh=0.02), FileTier(tmp_path, NS, PAYLOAD)
    assert mine.ask([KEY]).result() == [False]
    theirs.put([(KEY, payload(1)), (5, payload(2))])
    time.sleep(0.2)  # more than four periods: the index is too old to answer from
    assert [mine.ask([KEY]).result(), mine.ask([5, 6]).result()] == [[True], [True, False]]


class HeldListing(FileTier):
    """A directory whose listings after attach take as long as the test holds them (a large one)."""

    def __init__(self, *args, **kwargs) -> None:
        self.listing = threading.Event()
        self.release = None
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def _scan(self):
        if self.release is not None:
            self.listing.set()
            self.release.wait(timeout=5)
        return super()._scan()


def test_after_an_idle_spell_any_directory_answers_at_once_and_exactly(tmp_path):
    """The scheduler thread never waits for a listing, and a listing that runs behind costs no hit: the asked keys
    are looked for one by one."""
    mine, theirs = HeldListing(tmp_path, NS, PAYLOAD, refresh=0.02), FileTier(tmp_path, NS, PAYLOAD)
    theirs.put([(KEY, payload(1))])
    time.sleep(0.2)
    try:
        assert mine.ask([KEY, 6]).result() == [True, False]
        assert mine.listing.wait(timeout=5) and mine._listing  # the listing it started is still held
    finally:
        mine.release.set()
    eventually(lambda: not mine._listing, "the listing never ended")
    assert mine.ask([KEY]).result() == [True]
    assert read(mine) == payload(1)


class SlowLookups(FileTier):
    """A network filesystem: each file looked for costs a round trip (here 20 ms); those the thread that made the
    tier looked for are counted (the I/O threads' renewals are not)."""

    looked_for = 0

    def __init__(self, *args, **kwargs) -> None:
        self.asker = threading.get_ident()
        super().__init__(*args, **kwargs)

    def _file(self, key):
        if threading.get_ident() == self.asker:
            self.looked_for += 1
            time.sleep(0.02)
        return super()._file(key)


def test_after_an_idle_spell_an_ask_spends_a_bounded_time_looking_for_files(tmp_path):
    """A long prompt's lookup may lack thousands of keys, on a filesystem where each costs a round trip: the
    scheduler thread looks for files for ``IDLE_LOOKING`` seconds at most, the rest answered from the index."""
    mine, theirs = SlowLookups(tmp_path, NS, PAYLOAD, refresh=0.02), FileTier(tmp_path, NS, PAYLOAD)
    theirs.put([(KEY, payload(1)), (5, payload(2))])
    time.sleep(0.2)
    assert mine.ask([KEY, 5, 6]).result() == [True, False, False]
    assert mine.looked_for == 1  # past the 5 ms, after the first


def test_a_listing_that_waited_does_not_put_off_the_next(tmp_path):
    """Beside a busy scheduler thread a listing waits for the GIL at every file it reads (2,000 records: 4 ms alone,
    150 ms beside a thread that never lets go): the next listing is put off by its CPU time, not its wall time."""
    mine = HeldListing(tmp_path, NS, PAYLOAD, refresh=0.02)
    time.sleep(0.05)
    mine.ask([KEY])
    assert mine.listing.wait(timeout=5)
    time.sleep(0.3)  # the listing waits, as for the GIL
    mine.release.set()
    eventually(lambda: not mine._listing, "the listing never ended")
    mine.listing.clear()
    time.sleep(0.05)  # past the refresh period, well short of ten times the listing's wall time
    mine.ask([KEY])
    assert mine.listing.wait(timeout=1), "no listing started"


def test_the_schedulers_index_learns_its_workers_puts_at_once(tmp_path):
    """In vLLM the workers put in other processes: the scheduler side learns of them when the put ends."""
    scheduler_side, worker_side = FileTier(tmp_path, NS, PAYLOAD, refresh=60), FileTier(tmp_path, NS, PAYLOAD)
    assert scheduler_side.ask([KEY]).result(timeout=5) == [False]
    worker_side.put([(KEY, payload(1))])
    assert scheduler_side.ask([KEY]).result(timeout=5) == [False]  # listed a minute ago at the earliest
    scheduler_side.learn([KEY])
    assert scheduler_side.ask([KEY]).result(timeout=5) == [True]


def test_what_a_reclaim_deletes_leaves_the_index(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD, refresh=60)
    tier.put([(i, payload(i)) for i in range(3)])
    for i in range(3):
        os.utime(tier.path(i), (time.time() - 600 + i, time.time() - 600 + i))
    tier.reclaim(budget=tier.path(2).stat().st_size, lease=60)
    assert tier.ask([0, 1, 2]).result(timeout=5) == [False, False, True]


def test_a_quarantined_record_leaves_the_index(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD, refresh=60)
    tier.put([(KEY, payload(1))])
    data = tier.path(KEY).read_bytes()
    tier.path(KEY).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert read(tier) is None and tier.ask([KEY]).result(timeout=5) == [False]


def test_a_directory_that_cannot_be_listed_is_counted_and_every_ask_is_answered(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD, refresh=0.01)
    tier.put([(KEY, payload(1))])
    assert tier.ask([KEY]).result(timeout=5) == [True]
    moved = tier.dir.rename(tmp_path / "away")
    tier.dir.write_bytes(b"")  # a file where the directory was: every listing fails (ENOTDIR)
    time.sleep(0.1)  # past four periods: the first ask lists, which fails
    answers = [tier.ask([KEY, 5]) for _ in range(3)]
    assert [a.result(timeout=5) for a in answers] == [[True, False]] * 3  # what the index knew, kept
    assert tier.counters["errors_ENOTDIR"] >= 1
    tier.dir.unlink()
    moved.rename(tier.dir)


def test_an_engine_learns_its_puts_in_the_namespace_they_were_made_in(tmp_path):
    from kvoffload.impl.shared import SharedStore

    opened = []

    def open_tier(namespace, payload_len):
        opened.append(FileTier(tmp_path, namespace, payload_len, refresh=60))
        return opened[-1]

    store = SharedStore(open_tier, NS, PAYLOAD)
    first = store.at()
    store.namespace = attrs.evolve(NS, weights="updated")  # a reset, and the weights the engine holds after it
    store.published(NS.weights, [KEY])  # a put made before the reset ended after it
    assert first.ask([KEY]).result(timeout=5) == [True] and store.at().ask([KEY]).result(timeout=5) == [False]
    assert [t.namespace.weights for t in opened] == [NS.weights, "updated"]


@pytest.mark.parametrize("variant, test", [
    (faulty_tiers.ServesUncheckedRecords,
     lambda path, cls: test_a_damaged_record_is_quarantined_counted_and_missed(
         path, lambda data: data[:100] + bytes([data[100] ^ 4]) + data[101:], "checksum", cls)),
    (faulty_tiers.DeletesOnAnyError, test_an_io_error_is_a_miss_that_deletes_nothing),
    (faulty_tiers.BudgetPerReplica, test_the_budget_holds_for_the_whole_directory_oldest_first),
    (faulty_tiers.RewritesPresentRecords, test_a_record_comes_back_and_a_second_put_writes_nothing),
], ids=lambda v: getattr(v, "__name__", ""))
def test_every_faulty_file_tier_is_caught(variant, test, tmp_path):
    """Each known bug of a filesystem tier fails the test written for it (and FileTier passes it)."""
    test(tmp_path / "real", FileTier)
    with pytest.raises(AssertionError):
        test(tmp_path / "faulty", variant)


def test_checks_asked_together_are_each_answered_with_their_own_records(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD)
    tier.put([(key, payload(key)) for key in range(0, 40, 3)])
    answers = [tier.ask([key, key + 1, key + 2]) for key in range(40)]
    for key, answer in enumerate(answers):
        assert answer.result(timeout=5) == [k % 3 == 0 and k < 40 for k in (key, key + 1, key + 2)]


def test_a_name_in_the_directory_that_is_not_a_record_is_never_an_answer(tmp_path):
    tier = FileTier(tmp_path, NS, PAYLOAD, refresh=0.01)
    tier.put([(KEY, payload(1))])
    (tier.path(KEY).parent / "zz.kvr").write_bytes(b"x")  # not a key's name
    time.sleep(0.1)
    assert tier.ask([KEY]).result(timeout=5) == [True]
    assert all(answer.result(timeout=5) == [True] for answer in [tier.ask([KEY]) for _ in range(3)])
