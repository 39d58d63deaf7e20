"""The shared tier's records: what a record says about itself, and what a reader checks before any of its bytes
reaches a GPU block. Stated once here; every backend (a directory, a key-value server) stores records in this form.

A **namespace** is everything that changes a block's bytes for the same tokens: the model, a digest of the weights
the engine computes with (taken again at every reset: a weight update made in place changes it, a reset with the
same weights keeps it; never a count of resets, which two engines with other weights both reach), a digest of the
model's configuration, the KV dtype and layout, the block and hash-block sizes, the hash algorithm and its seed,
the tensor-parallel shard, and a tenant salt. Engines of equal namespaces share records; an engine of any other
namespace never reads one, since every record carries its namespace's digest and a reader compares it with its own.

A **record** is one offload block, header then payload::

    magic   4 bytes   b"KVOR"
    version u16       1
    key_len u16       length of the key echo below
    ns      16 bytes  the namespace digest
    length  u64       payload bytes
    check   u64       xxh3_64 of everything before it, the key echo and the payload
    key     key_len   the record's key, encoded by ``encode_key``
    payload length

A reader sizes its read from its own config (``header_size`` and its payload size), never from a header, and
``check_record`` accepts the bytes only if every field is what the reader expected: a torn write, a short or long
record, another namespace, another key under this name, a flipped bit all fail it, before the payload is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from typing import Any

from attrs import asdict, frozen

from .types import Key

MAGIC, VERSION = b"KVOR", 1
_HEAD = struct.Struct("<4sHH16sQ")  # magic, version, key_len, namespace digest, payload length
_CHECK = struct.Struct("<Q")
RecordKey = Key | bytes  # the spec's keys are ints; vLLM's block hashes (group 0's keys) are bytes
Bytes = bytes | bytearray | memoryview
FAILURES = ("short", "magic", "version", "namespace", "key", "length", "checksum")  # why a record is refused


class RecordError(ValueError):
    """A record that must not be served; ``reason`` is one of ``FAILURES``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@frozen
class Namespace:
    """An engine's KV identity: records are shared exactly between engines whose namespaces are equal."""

    model: str
    weights: str  # a digest of the weights the engine computes with now (every byte: updates in place included)
    kv_dtype: str
    kv_layout: str
    block_size: int  # tokens per GPU block (per offload block: ``block_size * k``)
    hash_block_size: int
    hash_algorithm: str  # vLLM's prefix_caching_hash_algo: sha256, sha256_cbor, xxhash, ...
    hash_seed: str  # what seeds the first block's hash (vLLM's NONE_HASH; PYTHONHASHSEED where it matters)
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""  # a salt: two tenants on one store never share a record
    config: str = ""  # a digest of the model's configuration as the engine runs it (rope, quantization, overrides)

    @property
    def digest(self) -> bytes:
        """16 bytes that change with any field: the namespace as every record and directory names it."""
        return _digest(self)

    def manifest(self) -> dict[str, Any]:
        """What a store keeps beside a namespace's records, to check at every attach."""
        return {"format": VERSION, "namespace": asdict(self)}


@functools.lru_cache(maxsize=64)  # every record written and read asks for it
def _digest(namespace: Namespace) -> bytes:
    return hashlib.blake2b(json.dumps(asdict(namespace), sort_keys=True).encode(), digest_size=16).digest()


def encode_key(key: RecordKey) -> bytes:
    """A key as records echo it: vLLM's block hashes are bytes, the spec's and a later group's keys are ints."""
    if isinstance(key, bytes):
        return b"b" + key
    return b"i" + int(key).to_bytes(8, "little", signed=True)


def decode_key(echo: bytes) -> RecordKey:
    """The key ``encode_key`` encoded (a store that names records by key lists them back to keys)."""
    if echo[:1] == b"b":
        return echo[1:]
    if echo[:1] == b"i" and len(echo) == 9:
        return int.from_bytes(echo[1:], "little", signed=True)
    raise ValueError(f"not an encoded record key: {echo!r}")


def header_size(key: RecordKey) -> int:
    """Bytes before the payload in ``key``'s record."""
    return _HEAD.size + _CHECK.size + len(encode_key(key))


def _checksum(*parts: Bytes) -> int:
    import xxhash  # the spec itself needs only attrs: real bytes need xxhash

    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return int(h.intdigest())


def seal(namespace: Namespace, key: RecordKey, payload: Bytes) -> tuple[bytes, Bytes]:
    """``key``'s record of ``payload``: its header, then the payload itself (not copied), to write in that order."""
    echo = encode_key(key)
    head = _HEAD.pack(MAGIC, VERSION, len(echo), namespace.digest, len(payload))
    return head + _CHECK.pack(_checksum(head, echo, payload)) + echo, payload


def check_record(header: Bytes, payload: Bytes, size: int, namespace: Namespace,
                 key: RecordKey) -> None:
    """Raise ``RecordError`` unless ``header`` and ``payload`` are ``key``'s record in ``namespace``, whole and
    unchanged. They are the reader's buffers, ``header_size(key)`` bytes and the payload size of the reader's own
    config, filled as far as the record went; ``size`` is how many bytes the record had. Call it before the payload
    goes anywhere."""
    expected = header_size(key) + len(payload)
    if size != expected:
        raise RecordError("short" if size < expected else "length", f"{size} bytes, expected {expected}")
    echo = encode_key(key)
    magic, version, key_len, digest, length = _HEAD.unpack_from(header)
    body = memoryview(header)[_HEAD.size + _CHECK.size:]
    for reason, ok, got in (("magic", magic == MAGIC, magic), ("version", version == VERSION, version),
                            ("namespace", digest == namespace.digest, digest.hex()),
                            ("key", key_len == len(echo) and body == echo, "another key"),
                            ("length", length == len(payload), f"{length} payload bytes")):
        if not ok:
            raise RecordError(reason, f"record says {got}")
    (check,) = _CHECK.unpack_from(header, _HEAD.size)
    if check != _checksum(memoryview(header)[:_HEAD.size], body, payload):
        raise RecordError("checksum", "the bytes changed since they were sealed")
