"""The Mooncake tier: one namespace's records as objects in a Mooncake Store pool that engines share (the distributed
KV pool of Kimi's serving, SGLang HiCache's L3, vLLM's ``MooncakeStoreConnector``; ``kvoffload.spec.records`` says
what a record is and what a reader checks)::

    kvoffload/<namespace digest>/manifest    the namespace's fields: set by the first engine, checked at each attach
    kvoffload/<namespace digest>/<key>       one record per offload block: header and payload in one object

**One object per record, written once.** The pool never replaces an object: a second put of a name succeeds and
changes nothing, so the first writer wins (it moves no bytes either: 0.2-0.3 ms for a batch of 16 MiB here). A put
asks which of its records are there, to count them as present, not stored (on another thread, while it seals them:
the question crosses the network to the master), and sends only the others. A batch of ``hashing.SPLIT_BYTES`` or
more is sealed, and checked when got, on two threads. Objects become visible only once whole (Mooncake's put is a
start, the copies, and an end).

**No copy of a payload, one piece per record.** The engine stages a put's or a get's payloads in this thread's
registered memory (``staging``), each with room for its header just before it: a put writes the header there and
sends the record as one piece, a get lands it whole and checks it in place (a second piece per record cost the
transfer engine as much as a 256 KiB memcpy). A payload that lies elsewhere moves from or into where it lies, its
header through this thread's header buffer. A get takes exactly our config's record size (the pool refuses an
object of another size: then its size is asked, and a wrong one is damaged), and checks the record before the tier
serves it.

**Capacity** is the pool's: the memory its store nodes lend it (``mooncake_client --global_segment_size``), and
``segment_bytes`` of each engine's, if it lends any (records there leave the pool with the engine). The master
evicts the least recently used objects when the pool is full (``eviction_high_watermark_ratio``); a record read
recently is leased (``default_kv_lease_ttl``): the pool keeps it that long. A get whose transfer outlasts that lease
fails (``lease_expired``): the lease must be well above a batch's transfer time (5 s by default is).

**Errors.** A timeout, a master that is down or frozen, a segment gone with its engine: each is a miss or a dropped
write, counted by its kind, and deletes nothing. Every call is bounded by Mooncake's ``MC_RPC_TIMEOUT_MS``, which
only the operator sets (the engine's environment is not ours to change); unset, a frozen master holds a call 30 s,
and the tier says so when it joins the pool. A master that is gone costs more: the client tries to reconnect in
every call, about 4 s each. So once a call could not reach the master, the pool counts as down for ``retry_after``
seconds: every call fails at once (counted as ``down``), then one call at a time tries again. Only a record that
fails its check is removed: the pool refuses while the read that found it holds its lease, so the tier refuses it
unread until it can remove it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import numpy
from attrs import frozen

from kvoffload.spec.records import Bytes, Namespace, RecordError, RecordKey, check_record, encode_key, header_size, seal

from ..shared import STAGING_KEPT
from .answers import FutureAnswer
from .fs import TierError
from .hashing import each

PREFIX = "kvoffload"
# Mooncake's error codes (mooncake-store's types.h) that the counters name; any other is counted by its number
REACH_TIMEOUT = 2.0  # seconds the master and the metadata server may take to accept a connection at start-up
logger = logging.getLogger("kvoffload.tiers.mooncake")
ERRORS = {-704: "missing", -706: "leased", -707: "lease_expired", -600: "too_large", -900: "rpc", -901: "timeout",
          -10: "buffer", -200: "pool_full", -800: "transfer", -703: "not_ready"}
UNREACHED = (-900, -901)  # the master could not be reached, or did not answer in time
DOWN = -1_000_000  # ours: not called, the pool counts as down
RAISED = -1_000_001  # ours: the client raised instead of answering (logged)
ERRORS |= {DOWN: "down", RAISED: "raised"}
PUTS_ASKING = 4  # puts whose question runs beside their sealing (more wait for a thread)
FRAME_ALIGN = 64  # bytes: each staged header's room and payload start at a multiple of it


@frozen
class MooncakeSettings:
    """How to reach the pool: ``kv_connector_extra_config["shared_tier"]`` with ``backend: "mooncake"``."""

    master: str  # the master's RPC address, host:port
    metadata: str  # its metadata server: http://host:port/metadata (the master's own, or etcd://...)
    local_host: str = "127.0.0.1"  # this host's address as other hosts reach its segment
    protocol: str = "tcp"  # or "rdma"
    device: str = ""  # the RDMA devices to use ("" over TCP)
    segment_bytes: int = 0  # host memory this engine lends the pool (records there leave with the engine)
    buffer_bytes: int = 128 << 20  # the client's own transfer buffer
    lease: float = 5.0  # seconds the pool keeps an object after a read (the master's default_kv_lease_ttl)
    retry_after: float = 1.0  # seconds every call fails at once after one could not reach the master

    def check(self) -> None:
        """At start-up: the master and its metadata server accept a connection within ``REACH_TIMEOUT`` and the
        client joins the pool, or a ``TierError`` names the key to fix (the client's own join retries for 90 s,
        holding the GIL)."""
        host, _, port = self.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT).close()
        except (OSError, ValueError) as error:
            raise TierError(f"shared_tier.master: the Mooncake master at {self.master} cannot be reached: "
                            f"{error}") from None
        url = urlsplit(self.metadata)
        if url.scheme == "http":
            try:
                socket.create_connection((url.hostname, url.port or 80), timeout=REACH_TIMEOUT).close()
            except OSError as error:
                raise TierError(f"shared_tier.metadata: the metadata server at {self.metadata} cannot be reached: "
                                f"{error}") from None
        client(self)


@functools.cache
def client(settings: MooncakeSettings) -> Any:
    """One client per pool per process: it mounts this engine's segment once, and every epoch's tiers share it."""
    if "MC_RPC_TIMEOUT_MS" not in os.environ:
        logger.warning("MC_RPC_TIMEOUT_MS is not set: a call to a frozen Mooncake master may take 30 s before the "
                       "shared tier counts it a miss (set it in the engine's environment, e.g. 1000)")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        raise TierError(f"shared_tier.backend 'mooncake' needs the Mooncake store client (pip install "
                        f"kvoffload[mooncake]; its library needs Debian's libibverbs1): {error}") from None
    store = MooncakeDistributedStore()
    code = store.setup(settings.local_host, settings.metadata, settings.segment_bytes, settings.buffer_bytes,
                       settings.protocol, settings.device, settings.master)
    if code != 0:
        raise TierError(f"shared_tier.master: the Mooncake master at {settings.master} (metadata {settings.metadata}) "
                        f"cannot be reached: error {code}")
    return store


class _Buffer:
    """This thread's memory that the pool reads from and writes into: registered once, grown when a batch needs
    more (fresh memory for each transfer page-faults at a third of memcpy's speed)."""

    def __init__(self, store: Any, size: int) -> None:
        self.store, self.bytes = store, bytearray(max(size, 1 << 20))
        self.view = memoryview(self.bytes)
        self.address = ctypes.addressof((ctypes.c_char * len(self.bytes)).from_buffer(self.bytes))
        store.register_buffer(self.address, len(self.bytes))
        self.room = self.stride = self.frames = 0  # the frames of the last ``staging`` in it

    def release(self) -> None:
        self.store.unregister_buffer(self.address)

    def framed(self, address: int, head: int) -> bool:
        """Whether ``address`` is a payload's place in this buffer's last staging, with room for ``head`` bytes of
        header before it."""
        offset = address - self.address - self.room
        return head <= self.room and 0 <= offset < self.frames * self.stride and offset % self.stride == 0


_Pieces = tuple[memoryview, list[int], list[int]]  # one record's header place, and the pieces the pool moves


class MooncakeTier:
    def __init__(self, settings: MooncakeSettings, namespace: Namespace, payload_len: int) -> None:
        self.settings, self.namespace, self.payload_len = settings, namespace, payload_len
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._asks = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-mooncake-ask")
        # a put's question which of its records are there, answered while it seals them: one per put in flight
        self._present = ThreadPoolExecutor(PUTS_ASKING, thread_name_prefix="kvoffload-mooncake-present")
        self._buffers = threading.local()
        self._condemned: dict[str, float] = {}  # objects that failed their check -> when to try removing them again
        self._down_until: float | None = None  # the pool counts as down until then (None: up)
        self._trying = False  # a call is trying a pool that was down
        self._prefix = f"{PREFIX}/{namespace.digest.hex()}/"
        self._attach()

    @property
    def store(self) -> Any:
        return client(self.settings)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counters[what] += n

    def _error(self, code: int) -> str:
        return ERRORS.get(code, f"mooncake{-code}")

    def _call(self, call: Callable[..., Any], *args: Sequence[Any]) -> Any:
        """``call(*args)``: its error code per name (the first argument), or one code if it names one object. While
        the pool counts as down (for ``retry_after`` seconds after a call could not reach the master, and while
        another call tries it again), ``DOWN`` at once."""
        with self._lock:
            if self._down_until is not None:
                if self._trying or time.monotonic() < self._down_until:
                    return DOWN if isinstance(args[0], str) else [DOWN] * len(args[0])
                self._trying = True
        result = None
        try:
            result = call(*args)
            return result
        except Exception:  # an answer like any error's: counted by the caller, and never a failed transfer
            logger.exception("the Mooncake client raised in %s", getattr(call, "__name__", call))
            return RAISED if isinstance(args[0], str) else [RAISED] * len(args[0])
        finally:
            unreached = result is None or not set(UNREACHED).isdisjoint(result if isinstance(result, list)
                                                                        else [result])
            with self._lock:
                self._trying = False
                self._down_until = time.monotonic() + self.settings.retry_after if unreached else None

    def _buffer(self, size: int, kind: str = "heads") -> _Buffer:
        """This thread's buffer of ``kind``: "heads" (the headers of payloads that lie elsewhere) or "frames"
        (``staging``)."""
        buffer: _Buffer | None = getattr(self._buffers, kind, None)
        if buffer is None or len(buffer.bytes) < size:
            if buffer is not None:
                buffer.release()
            buffer = _Buffer(self.store, size)
            setattr(self._buffers, kind, buffer)
        return buffer

    def staging(self, keys: Sequence[RecordKey], payload_len: int) -> numpy.ndarray | None:
        """Where the engine stages the payloads of one put or get of ``keys`` on this thread: ``[keys, payload_len]``
        bytes in registered memory, each row with room for its key's header before it, so that each record moves as
        one piece. Valid until this thread's next staging. None past ``STAGING_KEPT`` bytes of payload (stage
        elsewhere)."""
        if len(keys) * payload_len > STAGING_KEPT:
            return None
        room = -(-max(map(header_size, keys)) // FRAME_ALIGN) * FRAME_ALIGN
        stride = room + -(-payload_len // FRAME_ALIGN) * FRAME_ALIGN  # rows start aligned: the copies move words
        buffer = self._buffer(len(keys) * stride, "frames")
        buffer.room, buffer.stride, buffer.frames = room, stride, len(keys)
        rows = numpy.frombuffer(buffer.bytes, dtype=numpy.uint8)[room:]
        return numpy.lib.stride_tricks.as_strided(rows, (len(keys), payload_len), (stride, 1))

    def _attach(self) -> None:
        """The namespace's manifest: put by the first engine, compared by every other. A pool that cannot answer
        now is counted: the records carry their namespace anyway, and every read checks it."""
        wanted = json.dumps(self.namespace.manifest(), sort_keys=True).encode()
        name = self._prefix + "manifest"
        if self.store.put(name, wanted) != 0:
            self._count("errors_manifest")
            return
        found = self.store.get(name)
        if found and found != wanted:  # (none: evicted already)
            raise TierError(f"{name} in the Mooncake pool at {self.settings.master} was set for another namespace "
                            f"than this engine's: {found!r} (this engine: {wanted.decode()})")

    def name(self, key: RecordKey) -> str:
        return self._prefix + encode_key(key).hex()

    def exists(self, keys: Sequence[RecordKey]) -> list[bool]:
        self._remove_condemned()
        names, found = list(map(self.name, keys)), []
        for name, code in zip(names, self._call(self.store.batch_is_exist, names)):
            if code < 0:
                self._count(f"errors_{self._error(code)}")
            found.append(code == 1 and name not in self._condemned)
        return found

    def ask(self, keys: Sequence[RecordKey], fresh: bool = False) -> FutureAnswer:
        """The pool's answer, on the tier's ask thread: always fresh."""
        return FutureAnswer(self._asks.submit(self.exists, list(keys)))

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        """Each record straight where it goes, its payload into ``into`` (in one piece with its header where the
        engine staged it here), then checked; the pool refuses an object larger than our record."""
        self._remove_condemned()
        names = list(map(self.name, keys))
        rows = [memoryview(target).cast("B")[:self.payload_len] for target in into]
        arrays = [numpy.frombuffer(row, dtype=numpy.uint8) for row in rows]  # held until the call returns
        pieces = self._pieces(list(map(header_size, keys)), arrays)
        codes = self._call(self.store.batch_get_into_multi_buffers, names, [p[1] for p in pieces],
                           [p[2] for p in pieces])
        got = [(key, name, code, header, row) for key, name, code, (header, _, _), row
               in zip(keys, names, codes, pieces, rows)]
        return each(lambda one: self._take(*one), got, len(got) * self.payload_len)

    def _pieces(self, heads: list[int], payloads: Sequence[numpy.ndarray]) -> list[_Pieces]:
        """Where each record moves from or to: one piece, its header's room and its payload, for a payload staged in
        this thread's frames; else its header in this thread's header buffer, then its payload where it lies."""
        frames: _Buffer | None = getattr(self._buffers, "frames", None)
        loose = 0  # header bytes of payloads that lie elsewhere
        pieces: list[Any] = []  # (a loose header's size, until it has a place)
        for head, payload in zip(heads, payloads):
            address = payload.ctypes.data
            if frames is not None and frames.framed(address, head):
                start = address - head - frames.address
                pieces.append((frames.view[start:start + head], [address - head], [head + payload.nbytes]))
            else:
                pieces.append((head, [address], [payload.nbytes]))
                loose += head
        if loose:  # each header before its payload, as two pieces
            buffer, at = self._buffer(loose), 0
            for i, (head, pointers, sizes) in enumerate(pieces):
                if isinstance(head, int):
                    pieces[i] = (buffer.view[at:at + head], [buffer.address + at, *pointers], [head, *sizes])
                    at += head
        return pieces

    def _take(self, key: RecordKey, name: str, code: int, header: memoryview, payload: memoryview) -> bool:
        if name in self._condemned:  # read before the pool let us remove it: refused again, counted once
            return False
        if code == -704:
            self._count("misses")
            return False
        if code in (-600, -800):  # the pool refused our buffers: an object of another size, or an error
            size, expected = self._call(self.store.get_size, name), len(header) + self.payload_len
            if size >= 0 and size != expected:
                self._quarantine(name, "length" if size > expected else "short")
                return False
        if code < 0:
            self._count(f"errors_{self._error(code)}")
            return False
        try:
            check_record(header, payload, code, self.namespace, key)
        except RecordError as bad:
            self._quarantine(name, bad.reason)
            return False
        self._count("hits")
        return True

    def _quarantine(self, name: str, reason: str) -> None:
        """Never served again: removed once the pool lets us. Our own read just leased it, and no put can replace
        it meanwhile (the pool keeps the first object of a name), so until then this tier refuses it unread."""
        self._count(f"quarantined_{reason}")
        with self._lock:
            self._condemned[name] = 0.0
        self._remove_condemned()

    def _remove_condemned(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [name for name, when in self._condemned.items() if when <= now]
            for name in due:
                self._condemned[name] = now + self.settings.lease
        for name in due:
            code = self._call(self.store.remove, name)
            if code in (0, -704):
                with self._lock:
                    self._condemned.pop(name, None)
            elif code != -706:  # still leased: tried again once the lease is over
                self._count(f"errors_{self._error(code)}")

    def put(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[str]:
        self._remove_condemned()
        names = [self.name(key) for key, _ in records]
        asked = self._present.submit(self._call, self.store.batch_is_exist, names)  # the client lets go of the GIL
        every = each(lambda record: seal(self.namespace, *record), records,  # meanwhile (few are there)
                     len(records) * self.payload_len)
        outcomes = ["present" if code == 1 else f"dropped:{self._error(code)}" if code < 0 else ""
                    for code in asked.result()]
        todo = [i for i, outcome in enumerate(outcomes) if not outcome]
        if todo:
            sealed = [every[i] for i in todo]
            arrays = [numpy.frombuffer(payload, dtype=numpy.uint8) for _, payload in sealed]  # held until it returns
            pieces = self._pieces([len(header) for header, _ in sealed], arrays)
            for (place, _, _), (header, _) in zip(pieces, sealed):
                place[:] = header
            codes = self._call(self.store.batch_put_from_multi_buffers, [names[i] for i in todo],
                               [p[1] for p in pieces], [p[2] for p in pieces])
            for i, code in zip(todo, codes):
                outcomes[i] = "stored" if code == 0 else f"dropped:{self._error(code)}"
        with self._lock:
            self.counters.update(outcome.replace(":", "_") for outcome in outcomes)
        return outcomes

    def delete(self, keys: Sequence[RecordKey]) -> None:
        for key in keys:
            self._call(self.store.remove, self.name(key))
