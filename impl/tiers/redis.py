"""The Redis tier: one namespace's records as values on a Redis 7 or Valkey server, or a Redis Cluster, that engines
share (``kvoffload.spec.records`` says what a record is and what a reader checks)::

    kvoffload:<namespace digest>:manifest    the namespace's fields: set by the first engine, checked at each attach
    kvoffload:<namespace digest>:<key>       one record per offload block: header and payload in one value

**One key per record.** A record is written by one ``SET NX PX``: whole or not at all, the first writer wins, and
no header is ever written apart from its payload. A reader sizes nothing from what the server sent: it reads at most
its own config's record size plus one byte (``GETRANGE``), received straight into its own buffers, and checks that
against its config before the payload is used.

**Routing.** No hash tag: every batch is a pipeline of single-key commands, split by node (by redis-py's cluster
client, or here for gets), so a namespace's records spread over every node of a cluster (a tag on the namespace
would put one model's whole KV on one node).

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
import socket
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence, cast
from urllib.parse import urlsplit

import redis
from attrs import field, frozen
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvoffload.spec.records import Bytes, Namespace, RecordError, RecordKey, check_record, encode_key, header_size, seal

from .answers import FutureAnswer
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


class _Read:
    """One record's read: the reader's own buffers, sized by its config and filled as far as the value went (as from
    a file), the value's size, or the error that failed it."""

    __slots__ = ("header", "payload", "extra", "size", "error")

    def __init__(self, header_len: int, payload: memoryview) -> None:
        self.header, self.payload, self.extra = bytearray(header_len), payload, bytearray(1)
        self.size = 0
        self.error: Exception | None = None

    def parts(self) -> list[memoryview]:
        """Where the value's bytes go, in order: the header, the payload, one byte more (a value too long)."""
        return [memoryview(self.header), self.payload, memoryview(self.extra)]

    def digest(self) -> str:
        """SHA-1 of the bytes read, as the quarantine script computes it on the server."""
        sha, left = hashlib.sha1(), self.size
        for part in self.parts():
            sha.update(part[:left])
            left -= min(left, len(part))
        return sha.hexdigest()


class _Replies:
    """Replies read off a connection's socket by hand, each bulk string's bytes received straight into the reader's
    buffers, where redis-py's parser would copy a value into its own buffer, then into a bytes object, then we into
    ours (twice the GB/s of redis-py's plain pipelined GET, checksum included: ``bench/redis_tier.py``). Reads
    ahead at most ``AHEAD`` bytes."""

    AHEAD = 64

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.pending = sock, bytearray()

    def line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self._receive()
        line = bytes(self.pending[:end])
        del self.pending[:end + 2]
        return line

    def _receive(self) -> None:
        chunk = self.sock.recv(self.AHEAD)
        if not chunk:
            raise redis.ConnectionError("the server closed the connection mid-reply")
        self.pending += chunk

    def into(self, buffer: memoryview) -> None:
        """Exactly ``len(buffer)`` bytes."""
        have = min(len(self.pending), len(buffer))
        buffer[:have] = self.pending[:have]
        del self.pending[:have]
        while have < len(buffer):
            got = self.sock.recv_into(buffer[have:])
            if not got:
                raise redis.ConnectionError("the server closed the connection mid-reply")
            have += got

    def bulk(self, read: _Read) -> None:
        """One GETRANGE reply into ``read``: its bytes, or the server's error."""
        line = self.line()
        if line[:1] == b"-":
            read.error = redis.ResponseError(line[1:].decode(errors="replace"))
            return
        if line[:1] != b"$":
            raise redis.ConnectionError(f"not a GETRANGE reply: {line[:40]!r}")
        try:
            read.size = left = int(line[1:])
        except ValueError:
            raise redis.ConnectionError(f"not a GETRANGE reply: {line[:40]!r}") from None
        for part in read.parts():
            take = min(left, len(part))
            self.into(part[:take])
            left -= take
        if left or self.line():  # longer than asked for, or no CRLF after it
            raise redis.ConnectionError(f"a GETRANGE reply of {read.size} bytes: not what was asked for")


def _read_ranges(server: redis.Redis, names: list[str], ends: list[int], reads: list[_Read]) -> None:
    """``GETRANGE name 0 end`` of each name, in one round trip on one of ``server``'s connections, each reply into
    its read. A connection that fails mid-way is dropped (where its stream stands is unknown), and every reply not
    read yet fails with its error."""
    pool, done = server.connection_pool, 0
    try:
        connection = pool.get_connection()
    except redis.RedisError as error:  # no connection, and none made
        for read in reads:
            read.error = error
        return
    try:
        connection.send_packed_command(connection.pack_commands([("GETRANGE", name, 0, end)
                                                                  for name, end in zip(names, ends)]))
        sock = cast("socket.socket | None", connection._sock)  # typed None in redis-py: set once connected
        if sock is None:
            raise redis.ConnectionError("the connection closed before its replies")
        replies = _Replies(sock)
        for read in reads:
            replies.bulk(read)
            done += 1
        if replies.pending:
            raise redis.ConnectionError("more bytes than the replies asked for")
    except (redis.RedisError, OSError) as error:
        connection.disconnect()
        failed = error if isinstance(error, redis.RedisError) else (
            redis.TimeoutError(str(error)) if isinstance(error, TimeoutError) else redis.ConnectionError(str(error)))
        for read in reads[done:]:
            read.error = failed
    finally:
        pool.release(connection)


def _server(client: redis.Redis | RedisCluster, name: str) -> redis.Redis:
    """The server that holds ``name``: a cluster's node for its slot."""
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(name))
    return client


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

    def ask(self, keys: Sequence[RecordKey], fresh: bool = False) -> FutureAnswer:
        """The server's answer, on the tier's ask thread: always fresh."""
        return FutureAnswer(self._asks.submit(self.exists, list(keys)))

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        """Each record's first ``header + payload + 1`` bytes (no value, whatever its size, takes more memory here
        than our config's record: one byte more tells a long one), read straight into ``into``; a pipeline per
        server (a cluster's keys grouped by node)."""
        names, ends = list(map(self.name, keys)), [header_size(key) + self.payload_len for key in keys]
        by_server: dict[int, tuple[redis.Redis, list[int]]] = {}
        try:
            client = self.client
            for i, name in enumerate(names):
                server = _server(client, name)
                by_server.setdefault(id(server), (server, []))[1].append(i)
        except (redis.RedisError, RedisClusterException) as error:  # a cluster that cannot say where a key lives
            self._failed(redis.ConnectionError(str(error)))
            return [False] * len(keys)
        found = [False] * len(keys)
        for server, part in by_server.values():
            reads = [_Read(header_size(keys[i]), memoryview(into[i]).cast("B")[:self.payload_len]) for i in part]
            _read_ranges(server, [names[i] for i in part], [ends[i] for i in part], reads)
            for i, read in zip(part, reads):
                found[i] = self._take(keys[i], names[i], read)
        return found

    def _take(self, key: RecordKey, name: str, read: _Read) -> bool:
        if read.error is not None:
            self._failed(read.error)
            return False
        if not read.size:  # GETRANGE of a missing key (no record is empty)
            self._count("misses")
            return False
        try:
            check_record(read.header, read.payload, read.size, self.namespace, key)
        except RecordError as bad:
            self._quarantine(name, read.digest(), read.size, bad.reason)
            return False
        self._count("hits")
        return True

    def _quarantine(self, name: str, digest: str, size: int, reason: str) -> None:
        """Delete the record if its first ``size`` bytes still hash to ``digest``: the bytes refused (a record's,
        or a record's and one more)."""
        self._count(f"quarantined_{reason}")
        try:
            self.client.eval(_DELETE_IF_SAME, 1, name, digest, size - 1)
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
