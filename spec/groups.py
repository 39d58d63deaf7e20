"""KV cache groups: the layers of a hybrid model that share one block table, and what each group needs.

A hybrid model's layers do not all attend alike. vLLM puts layers of one kind in one KV cache group, and gives
every request one block table per group (its blocks come from one shared pool). Two kinds matter here:

  * full attention: every position attends to every earlier one, so a request needs all its blocks;
  * sliding-window attention over the last ``window`` tokens: once a request has processed ``n`` tokens, the
    positions before ``n - window + 1`` are never read again. vLLM frees the blocks that hold only such positions
    while the request runs and puts its null block (id 0) in their place in the group's block table.

Groups may have blocks of different sizes: vLLM gives every group blocks of one byte size, so a group whose layers
keep fewer bytes per token gets blocks of more tokens (``unify_kv_cache_spec_page_size``). Block hashes are then
computed per ``Config.block_size`` tokens (vLLM's hash block size), and every group's block size is a multiple of it.

A prefix hit (from the GPU prefix cache or from an offload tier) of ``e`` tokens is usable only if it ends on a block
boundary of every group and every group can supply what a request resuming at token ``e`` reads: for full attention
every block before ``e``, for a sliding window the last ``ceil((window - 1) / block_size)`` of them (vLLM's
``find_longest_cache_hit``). Hits, stores and loads are therefore per group: an offload key is a block hash *and* a
group.
"""

from __future__ import annotations

from math import lcm
from typing import Callable, Sequence

from attrs import frozen


@frozen
class Group:
    """One KV cache group (vLLM's ``KVCacheGroupSpec``): full attention, or a sliding window of ``window`` tokens;
    blocks of ``block_size`` tokens (None: the model's, ``Config.block_size``)."""

    window: int | None = None
    block_size: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.window is not None and self.window < 2:
            _refuse(f"a sliding window spans at least 2 tokens, got {self.window!r}")
        size: object = self.block_size
        if size is not None and (not isinstance(size, int) or size <= 0):
            _refuse(f"a group's block_size must be a positive integer, got {size!r}")

    def __str__(self) -> str:
        """``full``, or the window in tokens; ``@`` and the block size when the group has its own: ``8@4``."""
        kind = "full" if self.window is None else str(self.window)
        return kind if self.block_size is None else f"{kind}@{self.block_size}"

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """Leading blocks no longer read once ``num_tokens`` tokens were processed (vLLM frees them)."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // block_size

    def blocks_read(self, num_tokens: int, block_size: int) -> range:
        """The blocks a request that has computed ``num_tokens`` tokens still reads (the last one may be partial):
        all of them for full attention, those from the first the window has not skipped for a sliding window."""
        return range(self.skipped_blocks(num_tokens, block_size), -(-num_tokens // block_size))


def parse_groups(text: str) -> tuple[Group, ...]:
    """A model's KV cache groups as ``str(Group)`` writes them, comma-separated: ``"4,full@4"`` is
    ``(Group(4), Group(block_size=4))``, a window in tokens or full attention, a block size of its own after ``@``."""
    def group(part: str) -> Group:
        kind, at, size = part.strip().partition("@")
        try:
            return Group(None if kind == "full" else int(kind), int(size) if at else None)
        except ValueError:
            _refuse(f"cannot read KV cache group {part!r}: a window in tokens or 'full', then optionally @block_size")
            raise
    return tuple(map(group, text.split(",")))


def _refuse(message: str) -> None:
    from .config import ConfigError  # config.py imports this module
    raise ConfigError(message)


FULL_ATTENTION = (Group(),)  # the groups of a model without sliding windows


def longest_hit(groups: Sequence[Group], block_sizes: Sequence[int], num_tokens: int,
                cached: Callable[[int, int], bool]) -> int:
    """The longest prefix hit, in tokens (at most ``num_tokens``), that every group can supply: it ends on a block
    boundary of every group (a multiple of vLLM's scheduler block size, the lcm of theirs), and ``cached(group,
    block)`` says whether that group has block ``block`` of the prefix, in blocks of ``block_sizes[group]`` tokens.
    (vLLM reaches the same length by a fixed point over the groups; taking the longest end that all of them accept
    is the same thing, stated directly.)"""
    return max(end for end in range(0, num_tokens + 1, lcm(*block_sizes))
               if all(cached(g, b) for g, (group, size) in enumerate(zip(groups, block_sizes))
                      for b in group.blocks_read(end, size)))
