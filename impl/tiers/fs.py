"""The filesystem tier: one namespace's records in a directory that engines share, on one host or on a shared
filesystem (``kvoffload.spec.records`` says what a record is and what a reader checks)::

    <root>/<namespace digest>/manifest.json     the namespace's fields: written at the first attach, checked at each
    <root>/<namespace digest>/<hh>/<key>.kvr    one record per offload block
    <root>/<namespace digest>/quarantine/       records that failed a check: kept to inspect, never read again

Publishing is atomic and idempotent: a record is written under a unique temporary name beside its final one,
fsynced, and linked to the final name, which fails if that name exists (the first writer wins, and no reader ever
sees part of a record); once per batch, each directory it linked into is fsynced. A writer killed midway leaves a
temporary file no reader opens.

Reading sizes the read from our config, never from the file, and checks the record before its payload is used. A
record that fails the check is moved to quarantine and counted. Any other error (EIO, EMFILE, a record that vanished)
is a miss, counted by its errno, and deletes nothing: other replicas may be reading that record.

Capacity is one byte budget for the whole directory, whoever wrote into it: ``reclaim`` counts every namespace's
records (old epochs included) and deletes the least recently used first. A lookup or a read renews a record's lease
(its mtime; a lookup's renewal runs on an I/O thread, at most once per ``RENEW_AGAIN``), and no record is reclaimed
within ``lease`` seconds of that, so one promised at lookup is still there at the load. (A reader that has the file
open keeps reading it whatever happens to its name.)

Existence checks (``ask``, on the scheduler's thread) are answered at once from an index of the namespace's keys,
listed at attach, listed again on an I/O thread at most every ``refresh`` seconds (more, if a listing takes much CPU),
and told of this engine's own puts at once (``learn``). After an idle spell, when replicas may have written much
since, each asked key the index lacks is looked for on disk on the asking thread, for ``IDLE_LOOKING`` seconds at
most (2-5 µs a key here; a lookup's keys, never the whole directory, which a listing reads whatever its size), while
the listing runs behind. An index that is behind only costs hits: a record it lists that is gone by the get is a
miss like any other, and the engine recomputes.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

from kvoffload.spec.records import (Bytes, Namespace, RecordError, RecordKey, check_record, decode_key, encode_key,
                                    header_size, seal)

from .answers import FutureAnswer, IndexAnswer


T = TypeVar("T")


class TierError(Exception):
    """A shared tier that cannot be attached as configured (named in the message): raised at start-up only."""


def _reason(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, type(error).__name__)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileTier:
    LEASE = 30.0  # seconds: no record used within this long is reclaimed
    ABANDONED = 600.0  # seconds: a temporary file this old is a killed writer's (a live write takes milliseconds)
    RENEW_EVERY = 0.05  # seconds: found records' leases are renewed this late at most
    RENEW_AGAIN = LEASE / 6  # seconds: a record found again sooner after its renewal is not renewed again
    # seconds an ask spends looking for files after an idle spell at most (over 1,000 files here; a network
    # filesystem's uncached lookups cost a round trip each): the rest are answered from the index
    IDLE_LOOKING = 0.005

    def __init__(self, root: str | os.PathLike[str], namespace: Namespace, payload_len: int,
                 io_threads: int = 4, refresh: float = 0.5) -> None:
        self.root, self.namespace, self.payload_len = Path(root), namespace, payload_len
        self.dir = self.root / namespace.digest.hex()
        self.counters: Counter[str] = Counter()  # stored, present, hits, misses, dropped_*, errors_*, quarantined_*
        self._lock = threading.Lock()  # the I/O threads count, list and renew too
        self.used_bytes: int | None = None  # the whole directory's records, after the last reclaim
        # the index: the namespace's keys as last listed, with what was learned since
        self._index: set[RecordKey] = set()
        self._learned: set[RecordKey] = set()  # learned while a listing runs: it may have missed them
        self._listed_at = 0.0  # when the last listing began
        self._period, self._refresh, self._listing = refresh, refresh, True
        self._found: list[RecordKey] = []  # records found by asks, their leases not renewed yet
        self._renewed: set[RecordKey] = set()  # records renewed since ``_renewed_at``: not renewed again till later
        self._renewed_at = time.monotonic()
        # a batch's records are read and written in parallel: the reads, writes, fsyncs and checksums release the GIL
        self._pool, self._threads = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-fs"), io_threads
        self._attach()
        self._list()

    def _in_parallel(self, each: Callable[..., T], items: list[tuple[Any, ...]]) -> list[T]:
        """``each(*item)`` for every item, in order; a contiguous slice of the batch per I/O thread."""
        share = -(-len(items) // self._threads) or 1
        slices = [items[i:i + share] for i in range(0, len(items), share)]
        return [r for part in self._pool.map(lambda part: [each(*item) for item in part], slices) for r in part]

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counters[what] += n

    def _attach(self) -> None:
        """The namespace's directory and its manifest: written by the first engine, compared by every other."""
        manifest, wanted = self.dir / "manifest.json", self.namespace.manifest()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not manifest.exists():  # else, or if another engine links it first, its manifest is checked
                self._publish(manifest, [json.dumps(wanted, indent=1, sort_keys=True).encode()])
                _fsync_directory(self.dir)
            found = json.loads(manifest.read_text())
        except (OSError, ValueError) as error:
            raise TierError(f"shared tier directory {self.dir}: {error}") from error
        if found != json.loads(json.dumps(wanted)):
            raise TierError(f"{manifest} was written for another namespace than this engine's: {found} "
                            f"(this engine: {wanted})")

    def path(self, key: RecordKey) -> Path:
        return Path(self._file(key))

    def _file(self, key: RecordKey) -> str:
        """``path`` as a string: 2 µs a key, where building the ``Path`` costs 3 more."""
        name = encode_key(key).hex()
        return f"{self.dir}/{name[2:4]}/{name}.kvr"

    def exists(self, keys: Sequence[RecordKey]) -> list[bool]:
        """Which records are there; each one found has its lease renewed (a load of it is likely to follow)."""
        return [self._renew(self.path(key)) for key in keys]

    def ask(self, keys: Sequence[RecordKey], fresh: bool = False) -> IndexAnswer | FutureAnswer:
        """Which records are there, by the index. An index older than ``refresh`` seconds is listed again on an I/O
        thread, the answer given from the one at hand; one older than four periods (an idle spell) answers for the
        keys it lacks by looking for their files, on the spot (for ``IDLE_LOOKING`` seconds at most). ``fresh``: each
        file is looked for on an I/O thread (the index may still hold a record that another process's get
        quarantined a moment ago)."""
        if fresh:
            return FutureAnswer(self._pool.submit(self.exists, list(keys)))
        with self._lock:
            age = time.monotonic() - self._listed_at
            if age >= self._period and not self._listing:
                self._listing = True
                self._pool.submit(self._list)
            found = [key in self._index for key in keys]
        if age >= 4 * self._period and False in found:
            looked = self._look_for([key for key, there in zip(keys, found) if not there])
            found = [there or key in looked for key, there in zip(keys, found)]
            self.learn(looked)
        if True in found:
            with self._lock:
                self._renew_later([key for key, there in zip(keys, found) if there])
        return IndexAnswer(found)

    def _look_for(self, keys: list[RecordKey]) -> set[RecordKey]:
        """Those of ``keys`` whose files are there, looked for in order for ``IDLE_LOOKING`` seconds at most."""
        there, until = set(), time.monotonic() + self.IDLE_LOOKING
        for key in keys:
            if time.monotonic() >= until:
                break
            if os.path.exists(self._file(key)):
                there.add(key)
        return there

    def learn(self, keys: Iterable[RecordKey]) -> None:
        """Records known to be there (this engine's workers published them from other processes, or an ask found
        their files): in the index at once."""
        with self._lock:
            self._index.update(keys)
            if self._listing:
                self._learned.update(keys)

    def _list(self) -> None:
        """List the namespace's records into the index (``_listing`` is set): on this thread at attach, on an I/O
        thread after."""
        began, cpu, keys = time.monotonic(), time.thread_time(), None
        try:
            keys = self._scan()
        except OSError as error:  # the index stays as it was: asks go on, from what it knows
            self._count(f"errors_{_reason(error)}")
        finally:
            with self._lock:
                if keys is not None:
                    self._index = keys | self._learned
                self._learned, self._listing, self._listed_at = set(), False, began
                # listings take a tenth of a core at most: CPU time, not wall time, which waiting for the GIL at every
                # file read stretches beside a busy scheduler thread (2,000 records: 4 ms alone, 150 ms beside one)
                self._period = max(self._refresh, 10 * (time.thread_time() - cpu))

    def _scan(self) -> set[RecordKey]:
        keys = set()
        with os.scandir(self.dir) as shards:
            for shard in shards:
                if len(shard.name) != 2 or not shard.is_dir():
                    continue
                with os.scandir(shard.path) as names:
                    for name in names:
                        if name.name.endswith(".kvr") and not name.name.startswith("."):
                            try:
                                keys.add(decode_key(bytes.fromhex(name.name[:-4])))
                            except ValueError:  # not a record's name: never asked about
                                pass
        return keys

    def _renew_later(self, keys: list[RecordKey]) -> None:  # under the lock
        """Leases of records an ask found, renewed on an I/O thread in one batch for the asks of ``RENEW_EVERY``
        seconds: a wake per ask would take the GIL from the scheduler thread at every lookup."""
        if not self._found:
            self._pool.submit(self._renew_found)
        self._found += keys

    def _renew_found(self) -> None:
        time.sleep(self.RENEW_EVERY)  # the asks meanwhile join this batch
        with self._lock:
            keys, self._found = self._found, []
        if time.monotonic() - self._renewed_at > self.RENEW_AGAIN:
            self._renewed, self._renewed_at = set(), time.monotonic()
        for key in dict.fromkeys(keys):  # a shared prefix is found by many asks: renewed once in a while
            if key not in self._renewed:
                self._renewed.add(key)
                self._renew(self.path(key))

    def _renew(self, path: Path) -> bool:
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:  # e.g. a read-only directory: the record is there, its lease just not renewed
            self._count(f"errors_{_reason(error)}")
            return path.exists()

    def put(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[str]:
        outcomes = self._in_parallel(self._put, list(records))
        for directory in {self.path(key).parent for (key, _), outcome in zip(records, outcomes) if outcome == "stored"}:
            try:
                _fsync_directory(directory)
            except OSError as error:  # the records are whole either way: a crash may only lose their names
                self._count(f"errors_{_reason(error)}")
        return outcomes

    def _put(self, key: RecordKey, payload: Bytes) -> str:
        final = self.path(key)
        try:
            if final.exists():  # no write amplification: the record is there already
                outcome = "present"
            else:
                final.parent.mkdir(exist_ok=True)
                outcome = "stored" if self._publish(final, list(seal(self.namespace, key, payload))) else "present"
        except OSError as error:  # a full disk, a read-only directory: the engine goes on without this record
            outcome = f"dropped:{_reason(error)}"
        self._count(outcome.replace(":", "_"))
        if outcome in ("stored", "present"):
            self.learn([key])
        return outcome

    @staticmethod
    def _publish(final: Path, pieces: list[Bytes]) -> bool:
        """Write, fsync, link: ``final`` appears whole or not at all, and never replaces a record. False: another
        writer linked it first."""
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        return self._in_parallel(self._get, list(zip(keys, into)))

    def _get(self, key: RecordKey, into: memoryview) -> bool:
        path, header = self.path(key), bytearray(header_size(key))
        payload = memoryview(into).cast("B")[:self.payload_len]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._count("misses")
            return False
        except OSError as error:
            self._read_failed(path, error)
            return False
        try:
            got = os.preadv(fd, [header, payload], 0)
            size = got if got < len(header) + len(payload) else os.fstat(fd).st_size  # a longer file is refused
            self._check(header, payload, size, key)
        except RecordError as bad:
            self._quarantine(path, bad.reason)
            return False
        except OSError as error:  # transient or not, it deletes nothing
            self._read_failed(path, error)
            return False
        finally:
            os.close(fd)
        self._count("hits")
        self._renew(path)
        return True

    def _check(self, header: Bytes, payload: Bytes, size: int, key: RecordKey) -> None:
        check_record(header, payload, size, self.namespace, key)

    def _read_failed(self, path: Path, error: OSError) -> None:
        """A record that could not be opened (EMFILE, EACCES, EIO...) is a miss, counted; it stays for the others."""
        self._count(f"errors_{_reason(error)}")

    def _quarantine(self, path: Path, reason: str) -> None:
        self._count(f"quarantined_{reason}")
        self._forget([decode_key(bytes.fromhex(path.stem))])
        quarantine = self.dir / "quarantine"
        try:
            quarantine.mkdir(exist_ok=True)
            os.replace(path, quarantine / f"{path.stem}.{reason}.{uuid.uuid4().hex[:8]}")
        except OSError:  # moved by another reader already, or the directory refuses: it is never served either way
            pass

    def delete(self, keys: Sequence[RecordKey]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)
        self._forget(keys)

    def _forget(self, keys: Iterable[RecordKey]) -> None:
        with self._lock:
            self._index.difference_update(keys)
            self._learned.difference_update(keys)

    def _budgeted(self, pattern: str) -> Iterable[Path]:
        return self.root.glob(pattern)

    def reclaim(self, budget: int, lease: float = LEASE, abandoned: float = ABANDONED) -> int:
        """Delete the temporary files killed writers left (older than ``abandoned`` seconds), then the least
        recently used records of every namespace under the root until they fit ``budget`` bytes, never one used
        within ``lease`` seconds; the bytes freed."""
        files = []
        # every namespace's directory, one budget for the root; records' and manifests' temporary files
        for pattern in ("*/*/*.kvr", "*/*/.*.tmp", "*/.*.tmp"):
            for path in self._budgeted(pattern):
                try:
                    stat = path.stat()
                except FileNotFoundError:  # reclaimed by another replica meanwhile
                    continue
                files.append((stat.st_mtime, stat.st_size, path))
        used, freed, now = sum(size for _, size, _ in files), 0, time.time()
        for mtime, size, path in files:
            if path.suffix == ".tmp" and now - mtime > abandoned:  # whatever the budget: it is never published
                path.unlink(missing_ok=True)
                freed += size
        for mtime, size, path in sorted(files):
            if used - freed <= budget or now - mtime < lease:
                break
            path.unlink(missing_ok=True)
            freed += size
            if path.parent.parent == self.dir and path.suffix == ".kvr":
                self._forget([decode_key(bytes.fromhex(path.stem))])
        self._count("reclaimed_bytes", freed)
        self.used_bytes = used - freed
        return freed
