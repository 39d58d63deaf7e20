"""The tiers below the CPU tier that engines share: one backend per medium, each behind ``SharedTier``, each storing
records as ``kvoffload.spec.records`` states them (namespace, key echo, length and checksum, checked before use).

``fs``: a directory (one host, or a shared filesystem), the embedded default.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvoffload.spec.records import Bytes, Namespace, RecordKey

from .fs import FileTier, TierError

__all__ = ["FileTier", "SharedTier", "TierError"]


class SharedTier(Protocol):
    """A shared store of one namespace's records. No method raises on what a store may do to a running engine (an
    I/O error, a vanished or corrupt record): each is a miss or a dropped write, counted in ``counters``."""

    namespace: Namespace

    def exists(self, keys: Sequence[RecordKey]) -> list[bool]: ...

    def get(self, keys: Sequence[RecordKey], into: Sequence[memoryview]) -> list[bool]:
        """Each key's checked payload into its buffer; False: a miss (the buffer's bytes are then undefined)."""
        ...

    def put(self, records: Sequence[tuple[RecordKey, Bytes]]) -> list[str]:
        """Publish each record: "stored", "present" (another writer was first), or "dropped:<reason>"."""
        ...

    def delete(self, keys: Sequence[RecordKey]) -> None: ...
