"""vLLM's ``SimpleCPUOffloadConnector`` (vLLM 0.32 and 0.33, eager and ``lazy_offload``) in black-box mode.

Unlike vLLM's ``OffloadingConnector``, it holds GPU blocks itself: vLLM binds the engine's GPU ``BlockPool`` to it
(``bind_gpu_block_pool``), and it ``touch``es every GPU block a transfer uses, so that the block outlives its
request's free, then frees it when the transfer completes (the kit's ``PINS`` protocol). In lazy mode it walks the
pool's free queue, in eviction order, and stores cached blocks no request holds before they are evicted. So the
world's own pool is bound to it, as vLLM's ``BlockPool`` reads (``WorldBlockPool``): every reference it takes or
frees is one in the world's pool, the blocks it walks are the world's free blocks, and a block's hash is the world's
cached key, told in vLLM's hashes.

Its metadata is one load event and one store event per step, each flat lists of GPU and CPU block ids (a CPU block
holds one GPU block: ``Config.k`` is 1). ``SimpleCPUTransfers`` reads it: a load event's blocks are told apart by
the requests it names; a store event names no request (``POOL_STORE``): its blocks are checked against the prefix
cache. Store completions go back by event in its worker metadata, loads by request in ``finished_recving``.
"""

from __future__ import annotations

from itertools import count
from typing import Any, Callable, Iterable, Iterator

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.simple_kv_offload.metadata import INVALID_JOB_ID, SimpleCPUOffloadWorkerMetadata

from kvoffload.spec import POOL_STORE, BlockPool, Key, require

from . import NULL_BLOCKS, Transfer


class SimpleCPUTransfers:
    """Reads ``SimpleCPUOffloadMetadata``. A preemption makes its worker wait for every transfer in flight
    (``need_flush``). Its worker has no failed transfers to report."""

    failures, fenced = False, False

    def __init__(self) -> None:
        self.holder: Callable[[int, list[str]], str | None] = lambda block, req_ids: None  # set by the black box
        self.job_ids = count()
        self.store_events: dict[int, int] = {}  # store job id -> its store event

    def transfers(self, metadata: Any) -> Iterator[Transfer]:
        if metadata.load_event != INVALID_JOB_ID:
            yield from self._loads(metadata.load_event, metadata.load_event_to_reqs[metadata.load_event],
                                   metadata.load_gpu_blocks, metadata.load_cpu_blocks)
        if metadata.store_event != INVALID_JOB_ID:
            job_id = next(self.job_ids)
            self.store_events[job_id] = metadata.store_event
            yield Transfer(job_id, POOL_STORE, "store", tuple(metadata.store_gpu_blocks),
                           tuple(metadata.store_cpu_blocks))

    def _loads(self, event: int, req_ids: list[str], gpu_blocks: list[int],
               cpu_blocks: list[int]) -> Iterator[Transfer]:
        """A load per request of the event: each GPU block goes to the request whose table holds it."""
        pairs: dict[str, list[tuple[int, int]]] = {}
        for gpu, cpu in zip(gpu_blocks, cpu_blocks):
            req_id = self.holder(gpu, req_ids)
            require(req_id is not None, "DST", f"load event {event} writes GPU block {gpu - NULL_BLOCKS}, which "
                                               f"the block table of none of its requests {req_ids} holds")
            pairs.setdefault(str(req_id), []).append((gpu, cpu))
        for req_id, blocks in pairs.items():
            yield Transfer(next(self.job_ids), req_id, "load", tuple(g for g, _c in blocks),
                           tuple(c for _g, c in blocks))

    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]:
        return set(submitted) if metadata.need_flush else set()

    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        events = {self.store_events.pop(job_id): 1 for job_id, _ok in job_results if job_id in self.store_events}
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=events) if events else None


class WorldBlock:
    """A block of the world's pool as vLLM's ``KVCacheBlock`` reads, live: vLLM's id is the world's + 1 (0 is the
    null block)."""

    __slots__ = ("pool", "block_id")

    def __init__(self, pool: WorldBlockPool, block_id: int) -> None:
        self.pool, self.block_id = pool, block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def ref_cnt(self) -> int:
        return 0 if self.is_null else self.pool.world.refs[self.block_id - NULL_BLOCKS]

    def _cached(self) -> tuple[Any, int, int] | None:
        key = None if self.is_null else self.pool.world.hash_of.get(self.block_id - NULL_BLOCKS)
        return None if key is None else self.pool.vllm_key(key)

    @property
    def block_hash(self) -> Any:
        cached = self._cached()
        return None if cached is None else make_block_hash_with_group_id(cached[0], cached[1])

    @property
    def block_hash_num_tokens(self) -> int | None:
        cached = self._cached()
        return None if cached is None else cached[2]


class FreeQueue:
    """The world's free blocks as vLLM's ``FreeKVCacheBlockQueue`` iterates them: the next to reuse first."""

    def __init__(self, pool: WorldBlockPool) -> None:
        self.pool = pool

    def iter_blocks_after(self, cursor: WorldBlock | None) -> Iterator[WorldBlock]:
        free = list(self.pool.world.free)
        if cursor is None:
            start = 0
        elif cursor.block_id - NULL_BLOCKS in self.pool.world.free:
            start = free.index(cursor.block_id - NULL_BLOCKS) + 1
        else:  # a block out of the queue has no next free block
            return
        for block in free[start:]:
            yield self.pool.blocks[block + NULL_BLOCKS]


class WorldBlockPool:
    """The world's GPU block pool (``spec.memory.BlockPool``) as vLLM's ``BlockPool`` is read and changed by a
    connector bound to it: ``touch`` and ``free_blocks`` take and release references in the world's pool. A world
    key is told in vLLM's hashes by ``vllm_key`` (its hash, group and tokens up to its block's end), and back by
    ``world_key``. A block has one hash in the world (no secondary ones)."""

    def __init__(self, world: BlockPool, vllm_key: Callable[[Key], tuple[Any, int, int]],
                 world_key: Callable[[Any, int], Key | None]) -> None:
        self.world, self.vllm_key, self.world_key = world, vllm_key, world_key
        self.blocks = [WorldBlock(self, b) for b in range(world.num_blocks + NULL_BLOCKS)]
        self.free_block_queue = FreeQueue(self)
        self.cached_block_hashes_by_block: dict[int, set[Any]] = {}

    def touch(self, blocks: Iterable[WorldBlock]) -> None:
        self.world.take([b.block_id - NULL_BLOCKS for b in blocks if not b.is_null])

    def free_blocks(self, ordered_blocks: Iterable[WorldBlock]) -> None:
        """Freed in the order given (the world's ``release`` frees the last first, as a request's blocks go)."""
        self.world.release([b.block_id - NULL_BLOCKS for b in ordered_blocks if not b.is_null][::-1])

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]) -> list[WorldBlock] | None:
        blocks = []
        for g in kv_cache_group_ids:
            key = self.world_key(block_hash, g)
            block = None if key is None else self.world.by_hash.get(key)
            if block is None:
                return None
            blocks.append(self.blocks[block + NULL_BLOCKS])
        return blocks
