"""Moving KV blocks between the engine's cache tensors and one host pool.

A GPU block occupies one byte span in each *view*: a ``[num_blocks, bytes]`` uint8 view of a cache tensor (two per
layer for the K/V-split layout ``[2, num_blocks, ...]``; one for ``[num_blocks, ...]`` layouts: fused K/V, MLA, or
one cross-layer tensor). The host pool is one allocation (pinned when CUDA is present) carved into one
``[rows, bytes]`` region per view, so a run of consecutive blocks going to consecutive rows is one contiguous copy.
"""

from __future__ import annotations

import mmap
import time
from typing import Any, Callable, Mapping

import numpy as np
import torch

from kvoffload.spec.config import BlockIdError, ConfigError
from kvoffload.spec.types import Job, TransferKind

LAYOUTS = ("blocks_first", "kv_first")  # [num_blocks, ...] / [2, num_blocks, ...]


def block_views(caches: Mapping[str, Any], layout: str) -> list[torch.Tensor]:
    """``[num_blocks, bytes]`` uint8 views of every region a block occupies, in a fixed order, each once: in a
    hybrid model the KV cache groups overlay one allocation (a layer of each group on the same bytes, since a block
    belongs to one group at a time), and copying a block's bytes once copies it for whichever group holds it. A
    layer may be a list of tensors (a Mamba layer's conv and recurrent state), and a tensor may use only part of
    each block's page (vLLM pads state pages to the attention page size): such a region is strided, and dropped
    when another region of the same pages holds it."""
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")
    regions = [_byte_view(name, part) for name, layer in caches.items()
               for tensor in (layer if isinstance(layer, (list, tuple)) else (layer,))
               for part in ((tensor[0], tensor[1]) if layout == "kv_first" else (tensor,))]
    spans = [(v.untyped_storage().data_ptr(), v.stride(0), v.storage_offset(), v.storage_offset() + v.shape[1])
             for v in regions]
    views = [v for i, (v, (ptr, stride, start, end)) in enumerate(zip(regions, spans))
             if not any(p == ptr and s == stride and a <= start and end <= b and (j < i or (a, b) != (start, end))
                        for j, (p, s, a, b) in enumerate(spans) if j != i)]
    if not views or len({v.shape[0] for v in views}) != 1:
        raise ConfigError(f"KV caches disagree on the number of blocks: {[tuple(v.shape) for v in views]}")
    return views


def _byte_view(name: str, part: torch.Tensor) -> torch.Tensor:
    """One cache tensor's ``[num_blocks, bytes]`` uint8 view: its blocks' bytes, rows as far apart as its pages."""
    if part.is_contiguous():
        return part.reshape(part.shape[0], -1).view(torch.uint8)
    item, width = part.element_size(), part[0].numel() * part.element_size()
    if not part[0].is_contiguous() or part.stride(0) * item < width:
        raise ConfigError(f"KV cache {name!r} of shape {tuple(part.shape)} and strides {part.stride()} does not hold "
                          "each block in one span of bytes: its blocks cannot be copied as byte spans")
    pages = torch.empty(0, dtype=torch.uint8, device=part.device).set_(part.untyped_storage())
    return pages.as_strided((part.shape[0], width), (part.stride(0) * item, 1), part.storage_offset() * item)


def runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both indices advance by one."""
    if len(src) == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist()))


class HostPool:
    """One host allocation with a ``[rows, bytes]`` region per view, resident from the start: pinned memory is; other
    memory would fault in page by page as rows first take a store (in the engine's step) or a get (a shared hit's
    8 MiB took 3,000 faults, about a third of its time to first token here), so every page is touched here, once."""

    def __init__(self, views: list[torch.Tensor], rows: int) -> None:
        widths = [v.shape[1] for v in views]
        pin = any(v.is_cuda for v in views)
        self.buffer = torch.empty(rows * sum(widths), dtype=torch.uint8, pin_memory=pin)
        if not pin:
            self.buffer[::mmap.PAGESIZE] = 0
        self.regions, offset = [], 0
        for width in widths:
            self.regions.append(self.buffer[offset:offset + rows * width].view(rows, width))
            offset += rows * width
        self.row_bytes = sum(widths)


STRATEGIES = ("runs", "indexed", "staged")
WORDS = (torch.int64, torch.int32, torch.int16)


def as_words(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same ``[rows, bytes]`` tensors, each row seen as the widest integers that divide every row (and align
    every start): index kernels move one element at a time, and 8-byte elements made a CPU gather as fast as memcpy
    where bytes reached a tenth of it (``bench/cpu_copy.py``)."""
    dtype = next((d for d in WORDS if all(t.shape[1] % d.itemsize == 0 and t.data_ptr() % d.itemsize == 0
                                          for t in tensors)), torch.uint8)
    return [t.view(dtype) for t in tensors]


class Copier:
    """Copies blocks between the views and the host regions with one of three strategies:

    - ``runs``: one copy per run of consecutive blocks going to consecutive rows;
    - ``indexed``: one gather or scatter per view (both sides on one device: CPU);
    - ``staged``: one gather or scatter per view through a staging buffer on the views' device (CUDA).

    ``strategy=None`` chooses per transfer (``choose``): on CUDA ``runs`` for one or two runs, else ``staged``; on CPU
    ``runs`` for large runs, else ``indexed``.
    Forcing one lets every strategy run (and be tested) on CPU tensors too."""

    def __init__(self, views: list[torch.Tensor], pool: HostPool, strategy: str | None = None) -> None:
        self.on_cuda = views[0].is_cuda
        if strategy is not None and strategy not in STRATEGIES:
            raise ConfigError(f"unknown copy strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        if strategy == "indexed" and self.on_cuda:  # index_select/index_copy_ cannot cross devices
            raise ConfigError("copy strategy 'indexed' needs the KV caches on the CPU; on CUDA use 'staged'")
        self.pool, self.strategy = pool, strategy
        words = as_words([*views, *pool.regions])
        self.views, self.regions = words[:len(views)], words[len(views):]
        self.num_blocks = views[0].shape[0]
        self.large_run = 1 << 20  # bytes per run from which per-run copies beat indexed ones (measured, CPU)
        self.staging_bytes = 64 << 20  # per view: what a staged transfer holds on the device at once

    def check(self, blocks: np.ndarray) -> None:
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise BlockIdError(f"GPU block ids {blocks.tolist()} out of range [0, {self.num_blocks})")

    def plan(self, kind: TransferKind, blocks: np.ndarray, rows: np.ndarray) -> Callable[[], None]:
        """A closure that performs the copy; all indexing work is done here, at submit time. The pairs go in host row
        order: a request's blocks descend through its tokens (vLLM frees tail first), and so do the rows the tier
        gave them (``OffloadTier._follow_blocks``), where each pair in token order would be a run of its own (on
        CUDA, a DMA each)."""
        order = np.argsort(rows, kind="stable")
        blocks, rows = blocks[order], rows[order]
        if kind == "store":
            src_idx, dst_idx, pairs = blocks, rows, list(zip(self.regions, self.views))  # (dst, src)
        else:
            src_idx, dst_idx, pairs = rows, blocks, list(zip(self.views, self.regions))
        spans = runs(src_idx, dst_idx)
        strategy = self.strategy or self.choose(len(blocks), len(spans))
        if strategy == "runs":
            return self._plan_runs(pairs, spans)
        if strategy == "indexed":
            return self._plan_indexed(pairs, src_idx, dst_idx)
        return self._plan_staged(kind, pairs, src_idx, dst_idx)

    def choose(self, num_blocks: int, num_runs: int) -> str:
        """The strategy for ``num_blocks`` blocks that coalesce into ``num_runs`` runs. On CUDA each copy is a launch
        from the engine's step thread (13 µs, H100: 256 runs cost 3.4 ms), and a gather on the device is cheap beside
        the DMA: more than two runs go through a staging buffer. On CPU, few large runs are each one memcpy; many
        small ones cost less as one indexed copy per view (``bench/cpu_copy.py``)."""
        if self.on_cuda:
            return "runs" if num_runs <= 2 else "staged"
        run_bytes = self.pool.row_bytes // len(self.views) * num_blocks // max(num_runs, 1)
        return "runs" if run_bytes >= self.large_run else "indexed"

    def _plan_runs(self, pairs: list, spans: list[tuple[int, int, int]]) -> Callable[[], None]:
        def copy_runs() -> None:
            for dst, src in pairs:
                for s, d, n in spans:
                    dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
        return copy_runs

    def _plan_indexed(self, pairs: list, src_idx: np.ndarray, dst_idx: np.ndarray) -> Callable[[], None]:
        """Gathers straight into place when the destination is a few ranges of rows, in whatever order they are
        named (vLLM hands a request blocks in descending runs: it frees blocks tail first): one per range and view,
        at memcpy speed; else one scatter per view, at about two thirds of it (``bench/cpu_copy.py``)."""
        order = np.argsort(dst_idx, kind="stable")
        ranges = runs(dst_idx[order], np.arange(len(order)))  # (first destination row, position in order, rows)
        if len(ranges) * 4 <= len(dst_idx) or len(ranges) == 1:
            gathers = [(d, n, torch.from_numpy(src_idx[order[p:p + n]])) for d, p, n in ranges]

            def gather() -> None:
                for dst, src in pairs:
                    for d, n, index in gathers:
                        torch.index_select(src, 0, index, out=dst[d:d + n])
            return gather
        src_t, dst_t = torch.from_numpy(src_idx), torch.from_numpy(dst_idx)
        s0, src_is_run = int(src_idx[0]), _contiguous(src_idx)

        def scatter() -> None:
            for dst, src in pairs:
                dst.index_copy_(0, dst_t, src[s0:s0 + len(src_idx)] if src_is_run else src.index_select(0, src_t))
        return scatter

    def _plan_staged(self, kind: TransferKind, pairs: list, src_idx: np.ndarray,
                     dst_idx: np.ndarray) -> Callable[[], None]:
        """Gather scattered blocks into a staging buffer on the views' device with one kernel per view, then move
        it with one copy per run of host rows (usually one): on CUDA, one DMA instead of one per block. A staging
        buffer holds at most ``staging_bytes``: a larger transfer goes in chunks, each reusing the last one's memory
        in stream order."""
        device_idx = torch.from_numpy(src_idx if kind == "store" else dst_idx)
        if self.on_cuda:  # the index upload is asynchronous only from pinned memory
            device_idx = device_idx.pin_memory()
        host_idx = dst_idx if kind == "store" else src_idx
        per_chunk = max(1, self.staging_bytes // max(view[0].nbytes for view in self.views))
        chunks = []  # (first block, [(staging row, host row, length)])
        for a in range(0, len(host_idx), per_chunk):
            part = host_idx[a:a + per_chunk]
            chunks.append((a, runs(np.arange(len(part)), part)))
        device = self.views[0].device

        def staged() -> None:  # runs on the transfer stream: index upload, gather/scatter and DMA stay ordered
            uploaded = device_idx.to(device, non_blocking=True)
            for a, host_spans in chunks:
                idx = uploaded[a:a + per_chunk]
                for dst, src in pairs:
                    if kind == "store":
                        staging = src.index_select(0, idx)
                        for s, h, length in host_spans:
                            dst[h:h + length].copy_(staging[s:s + length], non_blocking=True)
                    else:
                        staging = torch.empty((len(idx), src.shape[1]), dtype=src.dtype, device=device)
                        for s, h, length in host_spans:
                            staging[s:s + length].copy_(src[h:h + length], non_blocking=True)
                        dst.index_copy_(0, idx, staging)
        return staged


def _contiguous(idx: np.ndarray) -> bool:
    return bool(len(idx)) and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and bool((np.diff(idx) == 1).all())


class InlineExecutor:
    """Runs each transfer at submit (CPU tensors: the copy is synchronous). A copy that raises is a failed
    transfer, reported as such; it never propagates into the engine."""

    def __init__(self) -> None:
        self.done: list[tuple[int, bool]] = []
        self.seconds = {"store": 0.0, "load": 0.0}

    def submit(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            success = job.run() is not False
        except Exception:  # noqa: BLE001 - any copy failure becomes success=False
            success = False
        self.seconds[job.kind] += time.perf_counter() - start
        self.done.append((job.job_id, success))

    def flush(self, job_ids: set[int]) -> None:
        pass  # everything already ran

    wait = flush  # a synchronous load: ran at submit, reported at the next poll

    def poll(self) -> list[tuple[int, bool]]:
        done, self.done = self.done, []
        return done


class CudaStreamExecutor:
    """One stream per direction. A store first waits for the compute stream (the forward pass writes the blocks it
    reads); completion is an event, polled without blocking. Only a flush (preemption) synchronises."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {kind: torch.cuda.Stream(device) for kind in ("store", "load")}
        self.in_flight: list[tuple[Job, torch.cuda.Event, torch.cuda.Event, bool]] = []
        self.seconds = {"store": 0.0, "load": 0.0}

    def submit(self, job: Job) -> None:
        stream = self.streams[job.kind]
        if job.kind == "store":
            stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            try:
                job.run()
                success = True
            except Exception:  # noqa: BLE001 - a failed launch is a failed transfer
                success = False
            end.record(stream)
        self.in_flight.append((job, start, end, success))

    def flush(self, job_ids: set[int]) -> None:
        for job, _start, end, _success in self.in_flight:
            if job.job_id in job_ids:
                end.synchronize()

    wait = flush  # a synchronous load: done before the forward pass is launched, reported at the next poll

    def poll(self) -> list[tuple[int, bool]]:
        done, pending = [], []
        for item in self.in_flight:
            job, start, end, success = item
            if end.query():
                self.seconds[job.kind] += start.elapsed_time(end) / 1000
                done.append((job.job_id, success))
            else:
                pending.append(item)
        self.in_flight = pending
        return done
