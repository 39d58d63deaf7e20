"""A batch's records sealed or checked on two threads. xxhash lets go of the GIL while it hashes, so a helper thread
hashes the first half of a batch while the I/O thread that has it hashes the rest: 32 MiB of 1 MiB records hashed in
1.0 ms on one thread here and in 0.5 ms on two. A Mooncake put of 16 such records spent 0.5-0.6 ms of its 8-9 ms
sealing them, a time the raw client's put does not have (``bench/mooncake_tier.py``). The Redis tier's puts and
gets, bound by the server's socket here, gained nothing measurable from it, and hash on one thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

SPLIT_BYTES = 8 << 20  # from this many bytes hashed: below, the hand-off cost more than it saved (4 MiB batches)
_helper = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-hash")


def each(hash_one: Callable[[Item], Result], items: Sequence[Item], nbytes: int) -> list[Result]:
    """``[hash_one(item) for item in items]``, in order; from ``SPLIT_BYTES`` hashed in all (``nbytes``), the first
    half on the helper thread meanwhile."""
    if nbytes < SPLIT_BYTES or len(items) < 2:
        return [hash_one(item) for item in items]
    half = len(items) // 2
    first = _helper.submit(lambda: [hash_one(item) for item in items[:half]])
    rest = [hash_one(item) for item in items[half:]]
    return first.result() + rest
