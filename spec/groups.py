"""KV cache groups: the layers of a hybrid model that share one block table, and what each group needs.

A hybrid model's layers do not all attend alike. vLLM puts layers of one kind in one KV cache group, and gives
every request one block table per group (its blocks come from one shared pool). Three kinds matter here:

  * full attention: every position attends to every earlier one, so a request needs all its blocks;
  * sliding-window attention over the last ``window`` tokens: once a request has processed ``n`` tokens, the
    positions before ``n - window + 1`` are never read again. vLLM frees the blocks that hold only such positions
    while the request runs and puts its null block (id 0) in their place in the group's block table;
  * recurrent state (Mamba, gated delta net: vLLM's ``MambaSpec`` in ``mamba_cache_mode="align"``): a layer keeps
    no per-token KV, only a state, and block ``i`` of the group holds the state after exactly its last token,
    ``(i + 1) * block_size``. That state is a function of the whole prefix, not of the block's own tokens. A
    request resuming at token ``n`` reads the state of the block holding token ``n - 1`` only, so vLLM frees every
    block before it (``get_num_skipped_tokens``: ``n - 1``), as for a window of 2 tokens. Unlike a window, state
    is written only where a chunk ends: vLLM allocates one block for the end of each chunk, leaves the null block
    at the positions a chunk passes (``allocate_new_blocks``), and ends prefill chunks on block boundaries so that
    each one leaves a state a later request can hit (the scheduler's ``_mamba_block_aligned_split``). Which of
    those states, and which of a window's blocks, the prefix cache keeps is ``retained``'s to say.

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
    """One KV cache group (vLLM's ``KVCacheGroupSpec``): full attention, a sliding window of ``window`` tokens, or
    recurrent ``state``; blocks of ``block_size`` tokens (None: the model's, ``Config.block_size``)."""

    window: int | None = None
    block_size: int | None = None
    state: bool = False

    def __attrs_post_init__(self) -> None:
        if self.window is not None and self.window < 2:
            _refuse(f"a sliding window spans at least 2 tokens, got {self.window!r}")
        if self.state and self.window is not None:
            _refuse("a group holds recurrent state or a sliding window of KV, not both")
        size: object = self.block_size
        if size is not None and (not isinstance(size, int) or size <= 0):
            _refuse(f"a group's block_size must be a positive integer, got {size!r}")

    def __str__(self) -> str:
        """``full``, ``state``, or the window in tokens; ``@`` and the block size when the group has its own:
        ``8@4``."""
        kind = "state" if self.state else "full" if self.window is None else str(self.window)
        return kind if self.block_size is None else f"{kind}@{self.block_size}"

    @property
    def reach(self) -> int | None:
        """How many tokens before a position the group still reads there: all of them (None) for full attention,
        ``window - 1`` for a window, 1 for state (the state after the last token)."""
        return 1 if self.state else None if self.window is None else self.window - 1

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """Leading blocks no longer read once ``num_tokens`` tokens were processed (vLLM frees them)."""
        return 0 if self.reach is None else max(0, num_tokens - self.reach) // block_size

    def blocks_read(self, num_tokens: int, block_size: int) -> range:
        """The blocks a request that has computed ``num_tokens`` tokens still reads (the last one may be partial):
        all of them for full attention, those from the first the window has not skipped for a sliding window."""
        return range(self.skipped_blocks(num_tokens, block_size), -(-num_tokens // block_size))


def parse_groups(text: str) -> tuple[Group, ...]:
    """A model's KV cache groups as ``str(Group)`` writes them, comma-separated: ``"4,full@4"`` is
    ``(Group(4), Group(block_size=4))``, a window in tokens, full attention or state, a block size of its own after
    ``@``."""
    def group(part: str) -> Group:
        kind, at, size = part.strip().partition("@")
        try:
            return Group(None if kind in ("full", "state") else int(kind), int(size) if at else None, kind == "state")
        except ValueError:
            _refuse(f"cannot read KV cache group {part!r}: a window in tokens, 'full' or 'state', then optionally "
                    "@block_size")
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


def state_chunk(start: int, n: int, num_prompt_tokens: int, num_tokens: int, block_size: int, budget: int,
                shared_prefix_boundary: int = 0, checkpoint_alignment: int | None = None) -> int:
    """How many of the ``n`` tokens from ``start`` a model with recurrent state computes in one step (vLLM's
    ``_mamba_block_aligned_split``): a prefill chunk ends where a state can be cached, on a block boundary, and at
    latest on the last one before the last known token. The prompt's last chunk is not clipped (decode carries its
    state to the boundary), nor a chunk inside a block wider than the ``budget``; 0: no block-aligned chunk fits.
    A chunk also stops on the last block boundary before the ``shared_prefix_boundary``: where the request's prefix
    stops being cached in some group although the others had it (vLLM's Marconi-style junction), so that the state
    there is cached for the next request that shares it. A model whose state layers save a prefill checkpoint
    (``checkpoint_alignment``, vLLM's Mamba2 and KDA layers) runs the prompt's last chunk past the last state
    position when the forward pass saves the state there itself (``checkpoint_saved``)."""
    prefill_end = max(num_prompt_tokens, num_tokens - 1)  # a resumed request replays its outputs as prefill
    if start >= prefill_end:
        return n
    end = start + n
    last_state = (num_tokens - 1) // block_size * block_size  # one token is always left to compute
    checkpoint = (prefill_end - 1) // block_size * block_size
    if checkpoint_alignment and end >= prefill_end and \
            checkpoint_saved(start, end, checkpoint, block_size, checkpoint_alignment):
        last_state = 0  # the forward pass saves it inside the chunk
    if end < prefill_end:
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= budget:
            end = aligned_end
    junction = start + (shared_prefix_boundary - start) // block_size * block_size
    stops = ((start // block_size + 1) * block_size if start % block_size else 0, last_state,
             junction if start < shared_prefix_boundary < end else 0)
    end = min((stop for stop in stops if start < stop < end), default=end)
    return max(end - start, 0)


def checkpoint_saved(start: int, end: int, position: int, block_size: int, alignment: int) -> bool:
    """Whether a chunk computing tokens ``start`` to ``end`` saves the state after the first ``position`` tokens (a
    block boundary) into that position's block, inside the chunk (vLLM's ``is_mamba_prefill_checkpoint_valid``):
    the chunk starts on a boundary, reaches at least a block past it and past ``position``, and ``position`` lies a
    whole block after its start and a multiple of ``alignment`` tokens from it."""
    return (start % block_size == 0 and -(-end // block_size) - 2 > (start - 1) // block_size
            and start + block_size <= position < end and (position - start) % alignment == 0)


def retained(group: Group, block: int, size: int, unit: int, boundaries: Sequence[int], interval: int | None) -> bool:
    """Whether the prefix cache keeps block ``block`` of a group of ``size``-token blocks once it is computed (vLLM's
    ``reachable_block_mask``, hits aligned to ``unit`` tokens): every block of full attention; of a sliding window,
    the blocks a hit at a kept boundary reads; of a state group, the block ending on a kept boundary. The kept
    boundaries: every ``unit`` tokens when ``interval`` is None (dense), else every ``interval`` tokens (none for 0,
    vLLM's default), and always the ``boundaries`` where a later request resumes (the prompt's last token, a
    shared-prefix junction), floored to the unit. A block no boundary needs gets no hash: no request hits it."""
    if group.reach is None:
        return True
    kept = [b // unit * unit // size for b in boundaries] if interval is not None else []  # blocks ending there
    if group.state:
        per = (interval or 0) // size
        return interval is None or (interval > 0 and (per <= 1 or (block + 1) % per == 0)) or block + 1 in kept
    need = -(-group.reach // size)  # the blocks a hit reads
    per = (unit if interval is None else interval) // size
    return (per > 0 and (need >= per or block % per >= per - need)) or any(end - need <= block < end for end in kept)
