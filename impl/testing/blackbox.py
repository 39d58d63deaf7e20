"""Black-box mode: any vLLM KV connector (``KVConnectorBase_V1``, scheduler side) driven by the kit's world.

``BlackBox`` is a kit adapter. It feeds the connector real vLLM ``Request``, ``KVCacheBlocks`` and
``SchedulerOutput`` objects built from the world, and plays the worker side itself: each transfer the connector's
metadata asks for becomes a world job that the environment executes, holds back and reorders, and completions go
back in the connector's own worker metadata. Nothing inside the connector is read; the checks come from what it
emits:

  * every GPU block a store or load names must be in that request's block table, at a full block (a connector
    whose tracked table drifted, as in the v0.11 seed bug, names blocks the request does not hold, or wrong ones);
  * the world then checks the bytes each store reads as it executes (SRC), every computed block after every rule
    (CONTENT: a load from the wrong tier slot shows here), delayed frees, flushes before reuse, completions once.

A connector's metadata format is its own, so a small ``Transfers`` reader translates it. One ships for vLLM's
``OffloadingConnector`` (``offloading_connector`` builds it with its real CPU manager). GPU block ids are shifted by
one on the way in and out: vLLM reserves block 0 as its null block, the world does not.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Protocol

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_request_block_hasher, init_none_hash,  # noqa: E402
                                         make_block_hash_with_group_id)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvoffload.spec import (FENCED_FREES, GARBAGE, REFUSE_STORE, RESET, TRANSFER_FAILURES, Config,  # noqa: E402
                            Copy, Event, Executor, Job, ListKV, Request, SchedulerOutput, State, TransferKind,
                            WorkerOutput, key_index, registered, require)

from .harness import LAYERS, make_configs  # noqa: E402

NULL_BLOCKS = 1  # vLLM's block 0 is the null block: world block b is vLLM block b + 1


class Transfer(NamedTuple):
    """One transfer a connector's metadata asks for, read by its ``Transfers`` reader."""

    job_id: int
    req_id: str
    kind: str  # "load" | "store"
    gpu_blocks: tuple[int, ...]  # vLLM ids
    tier_slots: tuple[Hashable, ...]  # where each GPU block's bytes live in the tier
    first_position: int | None = None  # the first block's index in the request, if the metadata says
    keys: tuple[Hashable, ...] | None = None  # the offload key each GPU block is copied under, if the metadata says


class Transfers(Protocol):
    """A connector's metadata format: the transfers it asks for, the jobs to flush, and completions back."""

    failures: bool  # the connector accepts failed transfers (success=False)
    fenced: bool  # it frees under in-flight stores and names them in a flush list (types.FENCED_FREES)

    def transfers(self, metadata: Any) -> Iterator[Transfer]: ...
    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]: ...
    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any: ...


class OffloadingTransfers:
    """vLLM's ``OffloadingConnector``: load/store jobs keyed by job id, a flush list, ``completed_jobs`` back.
    A job's CPU chunks hold ``blocks_per_chunk`` GPU blocks each; its GPU blocks fill them in order, the first
    entered at the offset of ``block_indices[0]`` (the first block's index in the request), as vLLM's CPU worker
    copies them. (The chunks need not be consecutive in the request: those already in the tier are skipped.)
    Its worker asserts that every transfer succeeded, so no failure is ever injected."""

    failures, fenced = False, True

    def __init__(self, blocks_per_chunk: int = 1) -> None:
        self.k = blocks_per_chunk

    def transfers(self, metadata: Any) -> Iterator[Transfer]:
        for kind, jobs in (("load", metadata.load_jobs), ("store", metadata.store_jobs)):
            for job_id, job in jobs.items():
                gpu, tier = (job.dst_spec, job.src_spec) if kind == "load" else (job.src_spec, job.dst_spec)
                chunks, first = list(map(int, tier.block_ids)), int(gpu.block_indices[0])
                places = range(first % self.k, first % self.k + len(gpu.block_ids))  # sub-slots, chunk by chunk
                require(not len(places) or places[-1] // self.k < len(chunks), "TRACK",
                        f"{kind} job {job_id} of {job.req_id}: {len(places)} GPU blocks need more than its "
                        f"{len(chunks)} CPU chunks")
                slots = tuple((chunks[i // self.k], i % self.k) for i in places)
                yield Transfer(job_id, job.req_id, kind, tuple(map(int, gpu.block_ids)), slots, first)

    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]:
        return set(metadata.jobs_to_flush or ())

    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        return OffloadingWorkerMetadata({job_id: 1 for job_id, _success in job_results}) if job_results else None


class KVOffloadTransfers:
    """Our ``KVOffloadConnector``: a plan of transfers; a preempted request's stores are flushed."""

    failures, fenced = True, False

    def transfers(self, metadata: Any) -> Iterator[Transfer]:
        for t in (*metadata.plan.loads, *metadata.plan.stores):
            yield Transfer(t.job_id, t.req_id, t.kind, tuple(t.gpu_blocks), tuple(t.host_rows),
                           keys=tuple(key for _block, key, _sub in t.copies))

    def flushes(self, metadata: Any, submitted: dict[int, Transfer]) -> set[int]:
        return {job_id for job_id, t in submitted.items() if t.kind == "store" and t.req_id in metadata.preempted}

    def worker_meta(self, job_results: list[tuple[int, bool]]) -> Any:
        from ..vllm_connector import KVOffloadWorkerMetadata
        return KVOffloadWorkerMetadata(tuple(job_results)) if job_results else None


class BlackBox:
    """A vLLM connector's scheduler side, plus a played worker side, as a kit adapter."""

    def __init__(self, config: Config, connector: Any, transfers: Transfers,
                 refuse: Callable[[], None] | None = None) -> None:
        self.config, self.connector, self.reader = config, connector, transfers
        resets = type(connector).reset_cache is not KVConnectorBase_V1.reset_cache  # the base class does nothing
        self.capabilities = frozenset({name for name, on in ((FENCED_FREES, transfers.fenced), (REFUSE_STORE, refuse),
                                                             (TRANSFER_FAILURES, transfers.failures), (RESET, resets))
                                       if on})
        if refuse:
            self.refuse_next_store = refuse
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(config.block_size, sha256)
        self.seen: dict[str, tuple[Request, VllmRequest]] = {}  # world request, vLLM request
        self.metadata: Any = None  # this step's, for handle_preemptions (the world passes only the ids)
        self.pending: dict[int, tuple[Transfer, tuple[Copy, ...]]] = {}  # asked for this step, not submitted
        self.draining: set[str] = set()  # request_finished returned True; not reported in finished_sending yet
        self.submitted: dict[int, Transfer] = {}  # submitted, not polled
        self.tier: dict[Hashable, int] = {}  # tier slot -> content
        self.load_errors: set[int] = set()
        self._kv: ListKV | None = None
        self._executor: Executor | None = None
        self.local_and_tier_hits = 0  # admissions that took a GPU prefix hit and a tier hit on top of it

    # ---- world -> vLLM ---------------------------------------------------------------------------------------
    def _vllm(self, req: Request) -> VllmRequest:
        """The vLLM request mirroring ``req``: same tokens (so the same block hashes), same progress."""
        if req.req_id not in self.seen:
            vreq = VllmRequest(req.req_id, list(req.prompt), SamplingParams(max_tokens=req.max_tokens), None,
                               block_hasher=self.hasher)
            self.seen[req.req_id] = (req, vreq)
            self.connector.on_new_request(vreq)
        vreq = self.seen[req.req_id][1]
        for token in req.tokens[vreq.num_tokens:req.num_tokens]:  # the tokens the engine has seen
            vreq.append_output_token_ids(token)
        vreq.num_computed_tokens = req.num_computed_tokens
        return vreq

    def _blocks(self, req: Request, block_ids: list[int]) -> KVCacheBlocks:
        blocks = [KVCacheBlock(b + NULL_BLOCKS) for b in block_ids]
        vreq = self.seen[req.req_id][1]
        for block, block_hash in zip(blocks[:req.num_cached_blocks], vreq.block_hashes):  # the GPU prefix hit
            block.set_block_hash(make_block_hash_with_group_id(block_hash, 0))
        return KVCacheBlocks((blocks,))

    @staticmethod
    def _ids(block_ids: tuple[int, ...] | None) -> tuple[list[int]] | None:
        return None if block_ids is None else ([b + NULL_BLOCKS for b in block_ids],)

    def _scheduler_output(self, out: SchedulerOutput) -> VllmSchedulerOutput:
        new, cached = [], CachedRequestData.make_empty()
        for s in out.scheduled:
            req, vreq = self.seen[s.req_id]
            self._vllm(req)
            vreq.num_computed_tokens, vreq.status = s.num_computed_tokens, RequestStatus.RUNNING
            if s.kind == "new":
                new.append(NewRequestData.from_request(vreq, ([b + NULL_BLOCKS for b in s.block_ids or ()],)))
                continue
            cached.req_ids.append(s.req_id)
            if s.kind == "resumed":
                cached.resumed_req_ids.add(s.req_id)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(self._ids(s.block_ids))
            cached.num_computed_tokens.append(s.num_computed_tokens)
            cached.num_output_tokens.append(vreq.num_output_tokens)
        for req_id in out.preempted_req_ids:
            vreq = self.seen[req_id][1]
            if not vreq.is_finished():  # preempted, then finished before this step: it stays finished
                vreq.status, vreq.num_computed_tokens = RequestStatus.PREEMPTED, 0
        return VllmSchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens={s.req_id: s.num_scheduled_tokens for s in out.scheduled},
            total_num_scheduled_tokens=sum(s.num_scheduled_tokens for s in out.scheduled),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
            finished_req_ids=set(out.finished_req_ids), free_encoder_mm_hashes=[],
            preempted_req_ids=set(out.preempted_req_ids))

    # ---- scheduler side ----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector.get_num_new_matched_tokens(self._vllm(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        vreq = self._vllm(request)
        self.local_and_tier_hits += bool(num_external_tokens and request.num_computed_tokens)
        self.connector.update_state_after_alloc(vreq, self._blocks(request, block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self.metadata = self.connector.build_connector_meta(self._scheduler_output(scheduler_output))
        self.pending = {t.job_id: (t, self._copies(t)) for t in self.reader.transfers(self.metadata)}
        return self.metadata

    def _copies(self, t: Transfer) -> tuple[Copy, ...]:
        """What the transfer copies, as (world GPU block, its offload block's key, index inside it). A block that
        is not where the job says in the request's table, or whose offload block is not full, is a violation here,
        before anything is copied (each check counted, through ``require``).

        Which invariant a bad block names: the job's blocks are the connector's tracked table as it emits it, so
        wherever the job itself places a block (its first position, its blocks in request order, the key it files a
        block under) and the request's real table disagree, the table drifted: TRACK, both tables shown. Only a job
        whose claims all agree with the real table and that still reaches a position not yet hashed stored too far
        ahead: CURSOR. (A drifted table often also reaches unhashed positions; naming it CURSOR hid the cause.)"""
        (req, vreq), k = self.seen[t.req_id], self.config.k
        blocks = [b - NULL_BLOCKS for b in t.gpu_blocks]
        tables = f"\n  request's block table: {req.blocks}\n  job's GPU blocks:      {blocks}"
        claims = f"{t.kind} job {t.job_id} of {t.req_id}"
        require(not blocks or t.first_position is None or req.blocks[t.first_position:t.first_position + 1]
                == blocks[:1], "TRACK", f"{claims} starts at GPU block {blocks[:1]} for position {t.first_position}, "
                                        f"but the request's block table is {req.blocks}{tables}")
        for block in blocks:  # a load into a block the request does not own would write another request's block
            require(block in req.blocks, "TRACK" if t.kind == "store" else "DST",
                    f"{claims} names GPU block {block}, which is not in the request's block table {req.blocks}"
                    f"{tables}")
        positions = [req.blocks.index(block) for block in blocks]
        require(all(a < b for a, b in zip(positions, positions[1:])), "TRACK",
                f"{claims}: its GPU blocks are not in request order (positions {positions}){tables}")
        copies = []
        for i, (block, position) in enumerate(zip(blocks, positions)):
            last = key_index(position // k, k)  # the key of the offload block holding this position
            hashed = last < len(req.block_hashes)
            if t.keys is not None:  # the job says where it files the block (a key in vLLM's hashes): elsewhere?
                require(last < len(vreq.block_hashes) and t.keys[i] == vreq.block_hashes[last], "TRACK",
                        f"{claims} files GPU block {block} (position {position}) under key {t.keys[i]!r}, not under "
                        f"its offload block's key: the tracked table drifted{tables}")
            require(hashed, "CURSOR", f"{claims} covers position {position}, whose offload block is not full "
                                      f"({len(req.block_hashes)} full GPU blocks)")
            copies.append((block, req.block_hashes[last], position % k))
        return tuple(copies)

    def update_connector_output(self, output: WorkerOutput) -> None:
        self.connector.update_connector_output(KVConnectorOutput(
            finished_sending=set(output.finished_sending) or None,
            finished_recving=set(output.finished_recving) or None,
            kv_connector_worker_meta=self.reader.worker_meta(list(output.job_results))))

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        vreq = self._vllm(request)
        aborted = request.state is State.ABORTED
        vreq.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        delay, _params = self.connector.request_finished(vreq, [b + NULL_BLOCKS for b in block_ids])
        if delay:
            self.draining.add(request.req_id)
        return delay

    def reset_cache(self) -> bool:
        return self.connector.reset_cache() is not False  # vLLM treats None as done

    def take_events(self) -> list[Event]:
        list(self.connector.take_events())  # its keys are vLLM's hashes: drained, not compared
        return []

    # ---- the played worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv: ListKV, executor: Executor) -> None:
        self._kv, self._executor = kv, executor

    @property
    def kv(self) -> ListKV:
        return registered(self._kv, "kv")

    @property
    def executor(self) -> Executor:
        return registered(self._executor, "executor")

    def handle_preemptions(self, req_ids: frozenset[str]) -> None:
        flush = self.reader.flushes(self.metadata, self.submitted)
        self._submit("store", flush)  # a flushed job of this very step is submitted first, as vLLM's worker does
        self.executor.flush(flush)

    def start_load_kv(self, metadata: Any) -> None:
        self._submit("load")

    def wait_for_save(self, metadata: Any) -> None:
        self._submit("store")

    def _submit(self, kind: TransferKind, only: set[int] | None = None) -> None:
        for job_id, (t, copies) in list(self.pending.items()):
            if t.kind != kind or (only is not None and job_id not in only):
                continue
            del self.pending[job_id]
            self.submitted[job_id] = t
            pairs = [(b - NULL_BLOCKS, slot) for b, slot in zip(t.gpu_blocks, t.tier_slots)]
            self.executor.submit(Job(job_id, t.req_id, kind, copies, partial(self._copy, kind, pairs)))

    def _copy(self, kind: str, pairs: list[tuple[int, Hashable]]) -> None:
        for block, slot in pairs:
            if kind == "store":
                self.tier[slot] = self.kv.read(block)
            else:
                self.kv.write(block, self.tier.get(slot, GARBAGE))

    def get_finished(self, finished_req_ids: frozenset[str]) -> WorkerOutput:
        results = self.executor.poll()
        done = [self.submitted.pop(job_id) for job_id, _success in results]
        self.load_errors |= {b - NULL_BLOCKS for t, (_id, success) in zip(done, results)
                             if t.kind == "load" and not success for b in t.gpu_blocks}
        busy = {t.req_id for t in self.submitted.values()}
        sending = {r for r in self.draining if r not in busy}
        self.draining -= sending
        return WorkerOutput(frozenset(sending), frozenset(t.req_id for t in done if t.kind == "load"), tuple(results))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors


def _create(config: Config, name: str, module: str | None, extra: Callable[[int], dict[str, Any]]) -> Any:
    """A vLLM connector's scheduler side, built as vLLM builds it, over a KV cache shaped like ``config``'s, with
    ``extra(bytes of one GPU block over all layers)`` as its extra config (to size its tier)."""
    from .demo import build_tiny_llama  # vLLM's configs are built from a model config

    model = build_tiny_llama(Path(os.environ.get("KVOFFLOAD_MODEL_DIR", ".cache/tiny-llama")))
    vllm_config, kv_cache_config = make_configs(model, config.num_gpu_blocks + NULL_BLOCKS, name, module, {},
                                                block_size=config.block_size)
    block_bytes = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes * len(LAYERS)
    assert vllm_config.kv_transfer_config is not None  # make_configs always names the connector
    vllm_config.kv_transfer_config.kv_connector_extra_config.update(extra(block_bytes))
    return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def vllm_offloading_connector(config: Config) -> BlackBox:
    """A kit factory: vLLM's own ``OffloadingConnector`` with its real CPU manager, sized from the config
    (``offload_block_size`` tokens per CPU chunk, ``tier_blocks`` chunks, eviction ``policy``), store refusals
    injected at its manager (the manager contract: None means no room)."""
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    connector = _create(config, "OffloadingConnector", None, lambda block_bytes: {
        "cpu_bytes_to_use": -(-block_bytes * config.k // align) * align * config.tier_blocks,
        "eviction_policy": config.policy, "block_size": config.offload_block_size})
    manager = connector.scheduler.manager
    prepare_store = manager.prepare_store
    refusing: list[bool] = []

    def prepare_or_refuse(*args: Any, **kwargs: Any) -> Any:
        return None if refusing and refusing.pop() else prepare_store(*args, **kwargs)

    manager.prepare_store = prepare_or_refuse
    return BlackBox(config, connector, OffloadingTransfers(config.k), refuse=lambda: refusing.append(True))


def kvoffload_connector(config: Config, name: str = "KVOffloadConnector",
                        module: str = "kvoffload.impl.vllm_connector") -> BlackBox:
    """A kit factory: our own vLLM connector (or a subclass, by name and module) in black-box mode."""
    connector = _create(config, name, module, lambda block_bytes: {
        "tier_bytes": block_bytes * config.k * config.tier_blocks, "offload_block_size": config.offload_block_size,
        "policy": config.policy})
    return BlackBox(config, connector, KVOffloadTransfers(), refuse=connector.offload.refuse_next_store)


def main(argv: list[str] | None = None) -> int:
    """Hunt: run a connector through the kit over a grid of configurations, one line per configuration."""
    import argparse
    import itertools
    import logging
    import time

    from kvoffload.spec.kit import Scenario, run_conformance

    parser = argparse.ArgumentParser(description="vLLM connectors through the kvoffload kit, in black-box mode")
    parser.add_argument("--connector", choices=("vllm", "ours"), default="vllm",
                        help="vLLM's OffloadingConnector, or our KVOffloadConnector")
    parser.add_argument("--profile", default="nightly", help="Hypothesis profile (pr, nightly, mutation)")
    parser.add_argument("--examples", type=int, default=150, help="programs per configuration")
    parser.add_argument("--chunk-blocks", type=int, nargs="+", default=[1, 2, 3], help="GPU blocks per CPU chunk")
    parser.add_argument("--traces", type=Path, default=Path("kvoffload-traces"))
    args = parser.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # the hunt's own lines, not vLLM's warnings
    factory = vllm_offloading_connector if args.connector == "vllm" else kvoffload_connector
    grid = list(itertools.product(args.chunk_blocks, (0, 1, 3), (1, 3, 8), (True, False), ("lru", "arc")))
    failed = 0
    for n, (k, delay, tier, prefix_caching, policy) in enumerate(grid, 1):
        config = Config(num_gpu_blocks=18, offload_block_size=2 * k, tier_blocks=tier, prefix_caching=prefix_caching,
                        policy=policy)
        scenario, start = Scenario(config, delay=delay, failures=args.connector == "ours"), time.perf_counter()
        trace = args.traces / f"{args.connector}-{n}.jsonl"
        try:
            coverage = run_conformance(factory, scenario, profile=args.profile, trace=trace,
                                       max_examples=args.examples)
            verdict = f"ok   {coverage.world['steps']} steps, {coverage.world['blocks_loaded']} blocks loaded"
        except Exception as exc:  # a finding: report it and go on with the grid
            failed += 1
            verdict = f"FAIL {str(exc).splitlines()[0]} (program: {trace})"
        print(f"[{n}/{len(grid)}] {scenario}: {verdict} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{len(grid) - failed} of {len(grid)} configurations passed")
    return 1 if failed else 0


if __name__ == "__main__":
    import sys
    import warnings

    warnings.simplefilter("ignore", category=UserWarning)  # skipped rules are listed once per run otherwise
    sys.exit(main())
