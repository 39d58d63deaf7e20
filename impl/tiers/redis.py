"""The Redis tier: one namespace's records as values on a Redis 7 or Valkey server, or a Redis Cluster, that engines
share (``kvoffload.spec.records`` says what a record is and what a reader checks)::

    kvoffload:<namespace digest>:manifest    the namespace's fields: set by the first engine, checked at each attach
    kvoffload:<namespace digest>:<key>       one record per offload block: header and payload in one value

**One key per record.** A record is written by one ``SET NX PX``: whole or not at all, the first writer wins, and
no header is ever written apart from its payload. A reader sizes nothing from what the server sent: it reads at most
its own config's record size plus one byte (``GETRANGE``), and checks that against its config before the payload is
used.

**Routing.** No hash tag: every batch is a pipeline of single-key commands, which redis-py's cluster client splits by
node, so a namespace's records spread over every node of a cluster (a tag on the namespace would put one model's
whole KV on one node).

**Capacity** is the server's: its ``maxmemory`` with ``allkeys-lru`` (the records no one read for longest go first),
and a TTL on every record.

**Errors.** A timeout, a refused connection, a server that restarted empty: each is a miss or a dropped write,
counted by its kind, and deletes nothing. Only a record that fails its check is deleted, and only if its value is
still the one that failed (a script compares digests), so a replica's good record that replaced it stays.

**No engine waits.** ``ask`` runs its existence check on a thread of its own and answers when it is done; the
connector gives up on it at its deadline. Every command is bounded by the socket timeout, and never retried: a
retry would only push the engine's recompute later.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence
from urllib.parse import urlsplit

import redis
from attrs import field, frozen
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvoffload.spec.records import Bytes, Namespace, RecordError, RecordKey, check_record, encode_key, header_size, seal

from .fs import TierError

PREFIX = "kvoffload"
# redis-py's own pure-Python packer sends a large value from where it lies; hiredis' (its default, when installed)
# copies every command into one buffer first: 2.5x slower for 4 MiB values on a loopback (bench/redis_tier.py).
# Replies are still parsed by hiredis.
SENDS_IN_PLACE = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
# Deletes a record only if its value still hashes to what the reader refused (a quarantine never takes the good
# record a replica wrote since).
_DELETE_IF_SAME = "if redis.sha1hex(redis.call('GETRANGE', KEYS[1], 0, ARGV[2])) == ARGV[1] then return " \
                  "redis.call('DEL', KEYS[1]) end return 0"


@frozen
class RedisSettings:
    """How to reach the server: ``kv_connector_extra_config["shared_tier"]`` with ``backend: "redis"``."""

    url: str  # redis://host:port/db, rediss://... (TLS), unix:///path/to/socket
    username: str = ""
    password: str = field(default="", repr=False)  # never printed
    password_env: str = ""  # the environment variable that holds the password, if not the password itself
    cluster: bool = False  # a Redis Cluster: the url names any one node
    ttl: float = 86400.0  # seconds a record lives after its write
    timeout: float = 1.0  # seconds any command may take (connecting included)
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def secret(self) -> str | None:
        if self.password_env:
            if self.password_env not in os.environ:
                raise TierError(f"shared_tier.password_env names {self.password_env!r}, which is not set in the "
                                "environment")
            return os.environ[self.password_env]
        return self.password or None

    def client(self) -> redis.Redis | RedisCluster:
        """A client of its own (one connection pool per process: ``connect``)."""
        scheme = urlsplit(self.url).scheme
        tls = {name: value for name, value in (("ssl_ca_certs", self.tls_ca_file), ("ssl_certfile", self.tls_cert_file),
                                               ("ssl_keyfile", self.tls_key_file)) if value}
        if tls and scheme != "rediss":
            raise TierError(f"shared_tier.tls_* files need a rediss:// url (TLS), not {scheme}://")
        options: dict[str, Any] = dict(username=self.username or None, password=self.secret(),
                                       socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                                       retry=Retry(NoBackoff(), 0), command_packer=SENDS_IN_PLACE, **tls)
        if self.cluster:
            return RedisCluster.from_url(self.url, **options)
        return redis.Redis.from_url(self.url, **options)

    def check(self) -> None:
        """At start-up: the server answers this user, or a ``TierError`` names the key to fix."""
        try:
            connect(self).ping()
        except redis.AuthenticationError as error:
            raise TierError(f"shared_tier.password: the server at {self.url} refused user "
                            f"{self.username or 'default'!r}: {error}") from None
        except redis.ResponseError as error:
            raise TierError(f"shared_tier.username {self.username!r}: refused by the server at {self.url}: "
                            f"{error}") from None
        except redis.RedisError as error:
            raise TierError(f"shared_tier.url: the server at {self.url} cannot be reached: {error}") from None


@functools.cache
def connect(settings: RedisSettings) -> redis.Redis | RedisCluster:
    """One client per server per process: the scheduler's and every epoch's tiers share its connections. A cluster
    client asks a node for the slots as it is made: a cluster that cannot answer is a ``redis.ConnectionError``, like
    any other server that cannot (and no client is kept: the next call tries again)."""
    try:
        return settings.client()
    except RedisClusterException as error:
        raise redis.ConnectionError(f"the cluster at {settings.url}: {error}") from error


def _reason(error: Exception) -> str:
    """A counter's suffix for an error: timeout, connection, or the server's error code (oom, noperm, ...)."""
    if isinstance(error, redis.TimeoutError):
        return "timeout"
    if isinstance(error, redis.ConnectionError):
        return "connection"
    if isinstance(error, redis.ResponseError):  # redis-py keeps the server's code apart when it knows it
        return str(getattr(error, "status_code", None) or (str(error).split() or ["error"])[0]).lower()
    return type(error).__name__


class RedisAnswer:
    """An existence check running on the tier's ask thread."""

    __slots__ = ("asked_at", "future")

    def __init__(self, future: Future[list[bool]]) -> None:
        self.asked_at, self.future = time.monotonic(), future

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> list[bool]:
        return self.future.result()

    def waited(self) -> float:
        return time.monotonic() - self.asked_at


class RedisTier:
    def __init__(self, settings: RedisSettings, namespace: Namespace, payload_len: int) -> None:
        self.settings, self.namespace, self.payload_len = settings, namespace, payload_len
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._asks = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-redis-ask")
        self._scratch = threading.local()  # each I/O thread's buffer for the records it puts
        self._prefix = f"{PREFIX}:{namespace.digest.hex()}:"
        self._attach()

    @property
    def client(self) -> redis.Redis | RedisCluster:
        return connect(self.settings)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counters[what] += n

    def _attach(self) -> None:
        """The namespace's manifest: set by the first engine, compared by every other. A server that cannot answer
        now is counted: the records carry their namespace anyway, and every read checks it."""
        wanted = json.dumps(self.namespace.manifest(), sort_keys=True)
        name = self._prefix + "manifest"
        try:
            self.client.set(name, wanted, nx=True)
            found = self.client.getrange(name, 0, len(wanted))  # one byte more than ours tells a longer one
        except redis.RedisError as error:
            self._count(f"errors_{_reason(error)}")
            return
        if found and found != wanted.encode():  # (none: evicted already)
            raise TierError(f"{name} on {self.settings.url} was set for another namespace than this engine's: "
                            f"{found!r} (this engine: {wanted})")

    def name(self, key: RecordKey) -> str:
        return self._prefix + encode_key(key).hex()

    def _pipeline(self, command: str, names: Sequence[str], *args: Any, **options: Any) -> list[Any]:
        """One command per name, in one round trip: each one's reply, or the error that failed it (a batch that
        failed as a whole fails each of its commands)."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for i, name in enumerate(names):
                    getattr(pipe, command)(name, *(arg[i] for arg in args), **options)
                return list(pipe.execute(raise_on_error=False))
        except redis.RedisError as error:
            return [error] * len(names)

    def _failed(self, reply: Any) -> bool:
        if isinstance(reply, Exception):
            self._count(f"errors_{_reason(reply)}")
            return True
        return False

    def exists(self, keys: Sequence[RecordKey]) -> list[bool]:
        replies = self._pipeline("exists", list(map(self.name, keys)))
        return [not self._failed(reply) and reply == 1 for reply in replies]

    def ask(self, keys: Sequence[RecordKey]) -> RedisAnswer:
        return RedisAnswer(self._asks.submit(self.exists, list(keys)))

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        """Each record's first ``header + payload + 1`` bytes: no value, whatever its size, takes more memory here
        than our config's record (one byte more tells a long one)."""
        names, ends = list(map(self.name, keys)), [header_size(key) + self.payload_len for key in keys]
        values = self._pipeline("getrange", names, [0] * len(keys), ends)
        return [self._take(key, name, value, buffer) for key, name, value, buffer in zip(keys, names, values, into)]

    def _take(self, key: RecordKey, name: str, value: bytes | Exception, into: memoryview) -> bool:
        if value == b"":  # GETRANGE of a missing key (no record is empty)
            self._count("misses")
            return False
        if self._failed(value):
            return False
        assert isinstance(value, bytes)
        # the reader's own buffers, sized by its config and filled as far as the value goes, as from a file
        size, record = header_size(key), memoryview(value)
        header, payload = bytearray(size), memoryview(into).cast("B")[:self.payload_len]
        header[:len(record[:size])] = record[:size]
        chunk = record[size:size + self.payload_len]
        payload[:len(chunk)] = chunk
        try:
            check_record(header, payload, len(value), self.namespace, key)
        except RecordError as bad:
            self._quarantine(name, value, bad.reason)
            return False
        self._count("hits")
        return True

    def _quarantine(self, name: str, value: bytes, reason: str) -> None:
        self._count(f"quarantined_{reason}")
        try:  # the bytes it read: a record's, or a record's and one more
            self.client.eval(_DELETE_IF_SAME, 1, name, hashlib.sha1(value).hexdigest(), len(value) - 1)
        except redis.RedisError as error:  # it fails its check again at the next read
            self._count(f"errors_{_reason(error)}")

    def _sealed(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[memoryview]:
        """Each record's bytes, header then payload, laid in this thread's scratch buffer: grown when a batch needs
        more, reused after (fresh memory for every put page-faults at a third of memcpy's speed). Valid until this
        thread's next put."""
        pieces = [seal(self.namespace, key, payload) for key, payload in records]
        need = sum(len(header) + len(payload) for header, payload in pieces)
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or len(scratch) < need:
            scratch = self._scratch.buffer = bytearray(need)
        view, values, at = memoryview(scratch), [], 0
        for header, payload in pieces:
            middle, end = at + len(header), at + len(header) + len(payload)
            view[at:middle], view[middle:end] = header, memoryview(payload).cast("B")
            values.append(view[at:end])
            at = end
        return values

    def put(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[str]:
        values = self._sealed(records)
        replies = self._pipeline("set", [self.name(key) for key, _ in records], values, nx=True,
                                 px=int(self.settings.ttl * 1000))
        outcomes = ["stored" if reply is True else f"dropped:{_reason(reply)}" if isinstance(reply, Exception)
                    else "present" for reply in replies]  # SET NX replies None where the record was there
        with self._lock:
            self.counters.update(outcome.replace(":", "_") for outcome in outcomes)
        return outcomes

    def delete(self, keys: Sequence[RecordKey]) -> None:
        self._pipeline("delete", [self.name(key) for key in keys])
