"""The tiers below the CPU tier that engines share: one backend per medium, each a ``SharedTier``
(``kvoffload.spec.store``), each storing records as ``kvoffload.spec.records`` states them (namespace, key echo,
length and checksum, checked before use).

``fs``: a directory (one host, or a shared filesystem), the embedded default.
``redis``: a Redis or Valkey server, or a Redis Cluster (``kvoffload.impl.tiers.redis``; needs redis-py, imported
only by those who use it).
``mooncake``: a Mooncake Store pool (``kvoffload.impl.tiers.mooncake``; needs Mooncake's store client, imported only
by those who use it).
"""

from __future__ import annotations

from kvoffload.spec.store import SharedTier

from .fs import FileTier, TierError

__all__ = ["FileTier", "SharedTier", "TierError"]
