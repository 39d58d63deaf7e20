"""KV cache groups: the layers of a hybrid model that share one block table, and what each group needs.

A hybrid model's layers do not all attend alike. vLLM puts layers of one kind in one KV cache group, and gives
every request one block table per group (its blocks come from one shared pool). Two kinds matter here:

  * full attention: every position attends to every earlier one, so a request needs all its blocks;
  * sliding-window attention over the last ``window`` tokens: once a request has processed ``n`` tokens, the
    positions before ``n - window + 1`` are never read again. vLLM frees the blocks that hold only such positions
    while the request runs and puts its null block (id 0) in their place in the group's block table.

A prefix hit (from the GPU prefix cache or from an offload tier) of ``e`` blocks is usable only if every group can
supply what a request resuming at block ``e`` reads: for full attention every block before ``e``, for a sliding
window the last ``ceil((window - 1) / block_size)`` of them (vLLM's ``find_longest_cache_hit``). Hits, stores and
loads are therefore per group: an offload key is a block hash *and* a group.
"""

from __future__ import annotations

from typing import Callable, Sequence

from attrs import frozen


@frozen
class Group:
    """One KV cache group (vLLM's ``KVCacheGroupSpec``): full attention, or a sliding window of ``window`` tokens."""

    window: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.window is not None and self.window < 2:
            from .config import ConfigError  # config.py imports this module
            raise ConfigError(f"a sliding window spans at least 2 tokens, got {self.window!r}")

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """Leading blocks no longer read once ``num_tokens`` tokens were processed (vLLM frees them)."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // block_size

    def blocks_read(self, num_tokens: int, block_size: int) -> range:
        """The blocks a request that has computed ``num_tokens`` tokens still reads (the last one may be partial):
        all of them for full attention, those from the first the window has not skipped for a sliding window."""
        return range(self.skipped_blocks(num_tokens, block_size), -(-num_tokens // block_size))

    def needed_for_hit(self, end: int, block_size: int) -> range:
        """The blocks a hit that ends at block ``end`` needs from this group."""
        return self.blocks_read(end * block_size, block_size)


FULL_ATTENTION = (Group(),)  # the groups of a model without sliding windows


def longest_hit(groups: Sequence[Group], block_size: int, num_blocks: int,
                cached: Callable[[int, int], bool]) -> int:
    """The longest prefix hit, in blocks (at most ``num_blocks``), that every group can supply; ``cached(group,
    block)`` says whether that group has block ``block`` of the prefix. (vLLM reaches the same length by a fixed
    point over the groups; taking the longest end that all of them accept is the same thing, stated directly.)"""
    return max(end for end in range(num_blocks + 1)
               if all(cached(g, b) for g, group in enumerate(groups) for b in group.needed_for_hit(end, block_size)))
