"""GPU memory as the engine sees it: the KV blocks (one content id each; the torch versions hold real bytes), and
vLLM's block pool with its prefix cache.
"""

from __future__ import annotations

from attrs import define, field

from .config import BlockIdError


PARTIAL = -1  # content of a block whose tokens are only partly computed
GARBAGE = -2  # content of a block nothing has written yet


@define
class ListKV:
    """GPU KV memory holding one content id per block (the torch version holds real bytes)."""

    num_blocks: int
    data: list[int] = field()

    @data.default
    def _garbage(self) -> list[int]:
        return [GARBAGE] * self.num_blocks

    def check(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise BlockIdError(f"GPU block id {block_id} out of range [0, {self.num_blocks})")
        return block_id

    def write(self, block_id: int, content: int) -> None:
        self.data[self.check(block_id)] = content

    def read(self, block_id: int) -> int:
        return self.data[self.check(block_id)]

    def holds(self, block_id: int, content: int) -> bool:
        return self.read(block_id) == content


@define
class BlockPool:
    """vLLM's block pool: ref counts, prefix cache by hash, free blocks reused least-recently-freed first."""

    num_blocks: int
    refs: list[int] = field()
    free: dict[int, None] = field()  # an ordered set: the head is reused first
    hash_of: dict[int, int] = field(factory=dict)  # cached block -> hash
    by_hash: dict[int, int] = field(factory=dict)  # hash -> cached block

    @refs.default
    def _no_refs(self) -> list[int]:
        return [0] * self.num_blocks

    @free.default
    def _all_free(self) -> dict[int, None]:
        return dict.fromkeys(range(self.num_blocks))

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free.pop(b, None)
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        blocks = list(self.free)[:n]
        for b in blocks:
            del self.free[b]
            if b in self.hash_of:  # reusing a cached block evicts it from the prefix cache
                del self.by_hash[self.hash_of.pop(b)]
            self.refs[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail blocks first, so they are reused first (vLLM's order)
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def evict(self, blocks: list[int]) -> None:
        """Out of the prefix cache, held or not (vLLM's ``evict_blocks``)."""
        for b in blocks:
            if b in self.hash_of:
                del self.by_hash[self.hash_of.pop(b)]

    def cache(self, block: int, block_hash: int) -> None:
        if block_hash not in self.by_hash and block not in self.hash_of:
            self.by_hash[block_hash] = block
            self.hash_of[block] = block_hash
