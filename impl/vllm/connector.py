"""``KVOffloadConnector``: vLLM's connector API (``KVConnectorBase_V1``, ``SupportsHMA``) on ``OffloadConnector``,
one instance per role, and the metadata the roles exchange."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, cast

import torch
from attrs import evolve
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata, KVConnectorRole,
                                                               KVConnectorTransferResults, KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvoffload.spec.config import ConfigError
from kvoffload.spec.records import Namespace
from kvoffload.spec.types import SHARED_MEDIUM, BlockIds, TransferPlan, WorkerOutput

from ..connector import OffloadConnector
from ..shadow import ShadowMonitor
from ..shared import IOExecutor
from ..tiers import FileTier
from .config import SharedTierConfig, config_from_vllm
from .identity import (KVOffloadHandshake, calling_model_runner, combined, lora_salt, namespace_from_vllm,
                       weights_digest)
from .metrics import COUNTERS, LATENCIES, MOVED, KVOffloadPromMetrics, KVOffloadStats
from .views import BlockTables, CacheTensors, VllmRequestView, named

# A step that schedules nothing while our puts or gets run: vLLM steps again at once, and a loop that spins holding the
# GIL starves our I/O threads, which take the GIL back after every system call and wait up to its 5 ms switch
# interval each time (a shared-tier get of 2k tokens took 6.3 s that way, 0.6 s with the interval at 0.5 ms:
# bench/ttft.py). Such a step yields to them for this long: it had nothing to compute.
IDLE_YIELD = 0.001
# Steps a lookup waits for the workers' fingerprints of their weights after a reset (they come with the next step's
# output): past them, lookups go on without the shared tier until the fingerprints arrive.
IDENTITY_STEPS = 4


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    plan: TransferPlan
    namespace: Namespace | None = None  # the engine's, with the shared tier: each worker's records are its shard's
    identity: int = 0  # resets so far: a worker fingerprints its weights again when this moves on


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: transfer results, and bytes and seconds moved per direction."""

    job_results: tuple[tuple[int, bool], ...] = ()
    moved: dict[str, float] = field(default_factory=dict)  # bytes_stored, bytes_loaded, store_seconds, ...
    latencies: tuple[tuple[str, float], ...] = ()  # ("get" or "put", seconds) of the shared tier's transfers
    weights: tuple[tuple[int, int, str], ...] = ()  # (resets so far, rank, digest): weights fingerprinted again

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM's ``KVOutputAggregator`` merges the workers' metadata with this. Every worker reports every job,
        so a job id appears once per worker; the scheduler side counts the reports (``Config.num_workers``)."""
        assert isinstance(other, KVOffloadWorkerMetadata)
        moved = {k: self.moved.get(k, 0) + other.moved.get(k, 0) for k in {*self.moved, *other.moved}}
        return KVOffloadWorkerMetadata(self.job_results + other.job_results, moved, self.latencies + other.latencies,
                                       self.weights + other.weights)


def worker_rank() -> int:
    """This worker's shard: its rank among every worker of the engine (tensor x pipeline parallel)."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_world_group().rank_in_group
    except AssertionError:  # no distributed state: one worker
        return 0


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = config_from_vllm(vllm_config, kv_cache_config)
        self.tables = BlockTables(self.config)
        self.offload = OffloadConnector(self.config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.shared = SharedTierConfig.parse(extra["shared_tier"]) if "shared_tier" in extra else None
        if self.shared and role == KVConnectorRole.SCHEDULER:
            self.shared.check()
        if self.shared and extra.get("verify"):
            raise ConfigError("kv_connector_extra_config verify=True does not cover shared_tier yet: use one or the "
                              "other")
        self.shadow = ShadowMonitor(self.config, self.offload, self._engine_table) if extra.get("verify") else None
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        events = vllm_config.kv_events_config  # off by default: vLLM's own connectors then emit none either
        self.emits_events = events is not None and events.enable_kv_cache_events
        self.steps = 0
        self._reclaimer: ThreadPoolExecutor | None = None  # the scheduler side keeps the shared tier in its budget
        self._reclaim: Future[int] | None = None
        self.kv_cache_manager: Any = None
        self.logged = dict.fromkeys(COUNTERS, 0)  # counters at the last get_kv_connector_stats
        self.views: dict[str, VllmRequestView] = {}
        self.job_results: list[tuple[int, bool]] = []
        # scheduler side: what the workers moved (totals), and GPU prefix hits the engine admitted
        self.moved: dict[str, float] = dict.fromkeys((*MOVED, "engine_hit_tokens"), 0)
        self.reported = dict.fromkeys(MOVED, 0.0)  # worker side: totals already sent
        self.latencies: list[tuple[str, float]] = []  # scheduler side: the workers' shared-tier transfers, unlogged
        # the engine's identity: resets so far, the workers' digests of their weights since the last one (scheduler
        # side), steps a lookup has waited for them; a worker's model runner, what it fingerprinted last
        self.resets, self.weights, self.unidentified_steps = 0, dict[int, str](), 0
        self.model_runner: Any = None
        self.fingerprinted = 0
        self.weight_reports: list[tuple[int, int, str]] = []

    # ---- scheduler side ----
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv_cache_manager = kv_cache_manager

    def _engine_table(self, req_id: str) -> BlockIds | None:
        """The engine's own block tables for a request, in the connector's form (what the shadow monitor checks
        tracking against); None when the engine has none."""
        if self.kv_cache_manager is None:
            return None
        try:
            return cast(BlockIds, self.tables.of(self.kv_cache_manager.get_block_ids(req_id)))
        except (KeyError, IndexError):
            return None

    def _view(self, request: Any) -> VllmRequestView:
        view = self.views.get(request.request_id)
        if view is None:
            view = self.views[request.request_id] = VllmRequestView(request, lora_salt(request))
        return view

    def _identify(self) -> bool:
        """Attach the shared tier with the engine's identity once every worker's digest of the weights it holds has
        come (at start-up through vLLM's handshake, after a reset with a step's output); at a lookup, since vLLM
        sets the hash seed the namespace names after it built this connector. False: not yet."""
        if self.offload.identified:
            return True
        shared = cast(SharedTierConfig, self.shared)
        if len(self.weights) < self.config.num_workers:
            return False
        namespace = namespace_from_vllm(self.vllm_config, self.kv_cache_config, self.config, shared.tenant,
                                        combined(self.weights))
        self.offload.attach_shared_tier(shared.open, namespace)
        if shared.backend == "fs" and self._reclaimer is None:  # a server keeps itself in its own memory budget
            self._reclaimer = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-reclaim")
        return True

    def _weights_reported(self, resets: int, rank: int, digest: str) -> None:
        if resets == self.resets:  # a digest from before the last reset may be of the weights replaced since
            self.weights[rank] = digest

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler side, at start-up: every worker's digest of the weights it loaded."""
        for handshake in metadata.values():
            if isinstance(handshake, KVOffloadHandshake):
                self._weights_reported(0, handshake.rank, handshake.weights)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
                                             ) -> None:
        self.set_xfer_handshake_metadata(dict(enumerate(metadata.values())))  # each names its own rank

    def _keep_in_budget(self) -> None:
        """Once the store is attached, and every 64 steps after, on a thread: the least recently used records of the
        whole directory go, past the budget (never one read within the lease)."""
        self.steps += 1
        if self._reclaimer is None or (self._reclaim is not None and (self.steps % 64 or not self._reclaim.done())):
            return
        store = cast(FileTier, cast(Any, self.offload.shared).at())
        self._reclaim = self._reclaimer.submit(store.reclaim, cast(SharedTierConfig, self.shared).options["bytes"])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.shared and not self._identify() and self.unidentified_steps < IDENTITY_STEPS:
            return None, False  # ask again: the workers' fingerprints of their weights come with the next step
        view = self._view(request)
        view.num_computed_tokens = view.uncommitted_hit = num_computed_tokens
        answer = self.offload.get_num_new_matched_tokens(view, num_computed_tokens)
        if self.shadow:
            self.shadow.lookup(view, num_computed_tokens, answer)
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids, view = self.tables.of(blocks.get_block_ids()), self._view(request)
        self.moved["engine_hit_tokens"] += view.uncommitted_hit  # this admission got its blocks: the hit is used
        view.uncommitted_hit = 0
        self.offload.update_state_after_alloc(view, block_ids, num_external_tokens)
        if self.shadow:
            self.shadow.alloc(view, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        neutral = self.tables.batch(scheduler_output)
        plan = self.offload.build_connector_meta(neutral)
        if self.shadow:
            self.shadow.batch(named(neutral))
        self._keep_in_budget()
        self.unidentified_steps = 0 if self.offload.identified else self.unidentified_steps + 1
        if not scheduler_output.total_num_scheduled_tokens and self._io_in_flight():
            time.sleep(IDLE_YIELD)
        shared = self.offload.shared
        return KVOffloadMetadata(plan, shared.namespace if shared else None, self.resets)

    def _io_in_flight(self) -> bool:
        """A put or a get runs on our I/O threads (loads and stores run in the engine step on a CPU, and on CUDA
        streams on a GPU: a spinning engine starves neither, and a step that waits for a load must not sleep)."""
        return any(t.kind in ("put", "get") for t in self.offload.unfinished.values())

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVOffloadWorkerMetadata):
            return
        for key, value in meta.moved.items():
            self.moved[key] += value
        self.latencies += meta.latencies
        for report in meta.weights:
            self._weights_reported(*report)
        output = WorkerOutput(job_results=meta.job_results)
        self.offload.update_connector_output(output)
        if self.shadow:
            self.shadow.results(output)

    def reset_cache(self) -> bool:
        """vLLM's cache reset (``reset_prefix_cache(reset_connector=True)``, after a weight update): the tier's
        entries hold KV computed with the old weights, so none may be loaded again, and the engine's identity is
        derived again: the workers fingerprint the weights they hold at the next step."""
        done = self.offload.reset_cache()
        self.resets, self.weights, self.unidentified_steps = self.resets + 1, {}, 0
        if self.shadow:
            self.shadow.reset(done)
        return done

    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while this is True, requests or none: a transfer still in flight when the last request
        finished (a put to the shared tier, most often) is reported, its tier entry unpinned and its bytes counted,
        and the last request's stores are put into the shared tier (the plan after they land makes the put: without
        that step, an engine that goes idle kept them from the fleet until its next request)."""
        return self.offload.has_pending_push_work()

    def get_finished_count(self) -> int:
        """Every worker reports every request's finished transfers: vLLM's aggregator waits for all of them,
        as our scheduler side waits for every worker's report of a job."""
        return self.config.num_workers

    def stats(self) -> dict[str, Any]:
        """Scheduler-side counters plus what the workers moved (and what their shared-tier records went through)."""
        verdict = {"shadow": self.shadow.verdict()} if self.shadow else {}
        shared = self.offload.shared
        store = cast(Any, shared.at()) if shared else None
        reclaimed = {"shared_reclaimed_bytes": store.counters["reclaimed_bytes"] if store else 0,
                     "shared_used_bytes": getattr(store, "used_bytes", None)}  # known once a reclaim counted them
        return {**self.offload.stats(), **self.moved, **reclaimed, **verdict}

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this (``SupportsHMA``) once per finished request, with every group's block ids."""
        view = self.views.pop(request.request_id, None)
        if view is None or request.request_id not in self.offload.requests:  # never looked up: nothing to hold
            return False, None
        tables = self.tables.of(block_ids)
        delay = self.offload.request_finished(view, tables)
        if self.shadow:
            self.shadow.finished(view, tables, delay)
        return delay, None

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        """Scheduler side: what changed since the last call (the workers' bytes already arrived in metadata)."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        now = self.stats()
        delta: dict[str, Any] = {name: now[name] - self.logged[name] for name in COUNTERS}
        self.logged = {name: now[name] for name in COUNTERS}
        taken, self.latencies = self.latencies, []
        for kind, name in LATENCIES.items():
            delta[name] = [seconds for k, seconds in taken if k == kind]
        if not any(delta.values()):
            return None
        if now["shared_used_bytes"] is not None:
            delta["shared_used_bytes"] = now["shared_used_bytes"]
        return KVOffloadStats(delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVOffloadPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Tier events as vLLM's, one per KV cache group: the block hashes (vLLM's) and the group; none unless the
        engine publishes KV cache events (``kv_events_config``), though the tier's are taken either way."""
        origin, events = self.offload.origin, self.offload.take_events()
        for event in events if self.emits_events else ():
            medium = self.shared.backend.upper() if self.shared and event.medium == SHARED_MEDIUM else event.medium
            by_group: dict[int, list] = {}
            for key in event.keys:  # group 0's key is the hash; a later group's was recorded when it was stored
                block_hash, group = origin.get(key, (key, 0))
                by_group.setdefault(group, []).append(maybe_convert_block_hash(cast(BlockHash, block_hash)))
            for group, hashes in by_group.items():
                if event.kind == "stored":
                    yield BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                      block_size=self.config.offload_block_sizes[group], lora_id=None,
                                      medium=medium,
                                      lora_name=None, group_idx=group)
                else:
                    yield BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)

    # ---- worker side ----
    def get_handshake_metadata(self) -> KVOffloadHandshake | None:
        """At start-up, with the shared tier: the digest of the weights this worker loaded."""
        if self.model_runner is None:
            return None
        return KVOffloadHandshake(worker_rank(), weights_digest(self.model_runner.get_model()))

    def _fingerprint_again(self, metadata: KVOffloadMetadata) -> None:
        """After a reset: the weights this worker holds now (an update in place changed them, or not), for the
        scheduler side's next identity."""
        if self.model_runner is not None and metadata.identity != self.fingerprinted:
            self.fingerprinted = metadata.identity
            self.weight_reports.append((metadata.identity, worker_rank(),
                                        weights_digest(self.model_runner.get_model())))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.shared:  # the shared tier's records are named by the weights this worker computes with
            self.model_runner = calling_model_runner()
        first = next(iter(kv_caches.values()))
        if first.shape[0] == self.config.num_gpu_blocks:
            layout = "blocks_first"
        elif first.shape[0] == 2 and first.shape[1] == self.config.num_gpu_blocks:
            layout = "kv_first"
        else:
            raise ConfigError(f"cannot tell the block dimension of KV cache shape {tuple(first.shape)} "
                              f"with {self.config.num_gpu_blocks} blocks")
        self.offload.register_kv_caches(CacheTensors(dict(kv_caches), layout))

    def _metadata(self) -> KVOffloadMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVOffloadMetadata), f"foreign connector metadata {type(metadata).__name__}"
        return metadata

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls it before the forward pass (and start_load_kv after it): the plan's flushes happen here."""
        assert isinstance(kv_connector_metadata, KVOffloadMetadata)
        self.offload.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._metadata()
        if metadata.namespace is not None and self.offload.worker_store is None:
            self.offload.attach_worker_store(cast(SharedTierConfig, self.shared).open,
                                             evolve(metadata.namespace, tp_rank=worker_rank()))
        self._fingerprint_again(metadata)
        self.offload.start_load_kv(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A synchronous load is waited for whole in start_load_kv; an asynchronous one, by its request. Not layer by
        # layer: a full CUDA graph's replay skips this call, so vLLM would have to run piecewise graphs only
        # (``requires_piecewise_for_cudagraph``), slowing every decode step to hide one copy.
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # whole blocks are stored after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self.offload.wait_for_save(self._metadata().plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM's model runner asks each step: finished frees and loads, and loads that failed as a whole
        (a hybrid model's: vLLM takes no invalid block ids for several groups)."""
        output = self.offload.get_finished(frozenset(finished_req_ids))
        self.job_results += output.job_results
        return KVConnectorTransferResults(set(output.finished_sending), set(output.finished_recving),
                                          set(output.failed_recving))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.offload.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        if not self.job_results and not self.weight_reports:
            return None
        totals = self.offload.stats()
        moved = {key: totals[key] - self.reported[key] for key in MOVED}
        self.reported = {key: totals[key] for key in MOVED}
        results, self.job_results = tuple(self.job_results), []
        io = self.offload.io
        latencies = tuple(io.take_latencies()) if isinstance(io, IOExecutor) else ()
        reports, self.weight_reports = tuple(self.weight_reports), []
        return KVOffloadWorkerMetadata(results, moved, latencies, reports)
