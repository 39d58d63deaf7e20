"""Connector variants the engine tests load by module path: one whose transfers really fail, one whose copies run
late, one that records the KV events it hands vLLM, one killed mid-write into the shared tier, one with the seed
bug and one that swaps a hybrid model's groups (for the shadow monitor and black-box mode to catch); and vLLM's
OffloadingConnector with transfer failures injected (a known divergence)."""

from __future__ import annotations

import dataclasses
import os
import signal

from kvoffload.impl import OffloadConnector
from kvoffload.spec.types import TransferPlan
from kvoffload.impl.transfer import InlineExecutor
from kvoffload.impl.testing.blackbox import vllm_offloading_past_known
from kvoffload.impl.tiers import FileTier
from kvoffload.impl.vllm import KVOffloadConnector
from kvoffload.impl.vllm.config import SharedTierConfig


class FlakyExecutor(InlineExecutor):
    """Every other transfer copies part of its data and then raises, as a failing DMA would."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def submit(self, job) -> None:
        self.count += 1
        if self.count % 2 == 0:
            real = job.run

            def half_then_fail() -> None:
                real()
                raise RuntimeError("injected transfer failure")
            job.run = half_then_fail
        super().submit(job)


class LateExecutor(InlineExecutor):
    """Runs each copy one step late: at the next step's poll, after that step's forward pass, as a GPU copy stream
    behind a busy compute stream may; a flush runs the copies it names at once. (The CPU engine's own executor
    copies at submit, where no order of the worker hooks can matter.)"""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list = []  # submitted since the last poll
        self.late: list = []  # submitted before it: they run at the next poll

    def submit(self, job) -> None:
        self.waiting.append(job)

    def flush(self, job_ids: set[int]) -> None:
        for job in [j for j in self.late + self.waiting if j.job_id in job_ids]:
            (self.late if job in self.late else self.waiting).remove(job)
            super().submit(job)

    def poll(self) -> list[tuple[int, bool]]:
        for job in self.late:
            super().submit(job)
        self.late, self.waiting = self.waiting, []
        return super().poll()


class LateCopiesConnector(KVOffloadConnector):
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self.offload.executor = LateExecutor()


class FailingTransfersConnector(KVOffloadConnector):
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self.offload.executor = FlakyExecutor()


class RecordingEventsConnector(KVOffloadConnector):
    recorded: list = []

    def take_events(self):
        for event in super().take_events():
            self.recorded.append(event)
            yield event


class _Refused(Exception):
    pass


class _BreakOnRefusedStore(OffloadConnector):
    """The seed bug in the production connector: the batch loop stops at the first refused store, so the later
    requests of the batch never get this step's block ids."""

    def _store(self, state, full, computed):
        refusals = self.tier.refusals
        store = super()._store(state, full, computed)
        if self.tier.refusals != refusals:
            raise _Refused
        return store

    def _new_transfer(self, state, kind, keys, copies, host_rows):
        transfer = super()._new_transfer(state, kind, keys, copies, host_rows)
        if kind == "store":
            self._built.append(transfer)
        return transfer

    def build_connector_meta(self, scheduler_output):
        loads, flush, self._built = list(self._pending_loads), frozenset(self._flush_next), []
        try:
            return super().build_connector_meta(scheduler_output)
        except _Refused:  # `break`: what was built so far goes out, the rest of the batch is skipped
            return TransferPlan(loads, list(self._built), flush=flush)


class SeedBugConnector(KVOffloadConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offload = _BreakOnRefusedStore(self.config)
        if self.shadow:
            self.shadow.production = self.offload


class ChangedReader:
    """A connector's metadata reader (``Transfers``) with one thing changed by a subclass; the rest is its own."""

    def __init__(self, reader):
        self.reader = reader

    def __getattr__(self, name):
        return getattr(self.reader, name)


class _ReportsFailures(ChangedReader):
    """vLLM's worker metadata has no success flag (its worker asserts success): a failed transfer can only be
    reported as done. Declaring failures lets the kit inject them and show what the scheduler side then does."""

    failures = True


def vllm_offloading(config):
    """vLLM's OffloadingConnector in black-box mode, short of its known divergences."""
    return vllm_offloading_past_known(config)


def vllm_offloading_loading_synchronously(config):
    """vLLM's OffloadingConnector in black-box mode with its synchronous loads on (vLLM 0.33's
    ``sync_load_budget_bytes``: two offload blocks a step), whatever the engine's load failure policy and scheduling:
    vLLM looks at neither."""
    return vllm_offloading_past_known(config, sync_loads=True)


def vllm_offloading_with_failures(config):
    """vLLM's OffloadingConnector in black-box mode, with transfer failures injected (known divergence)."""
    return vllm_offloading_past_known(config, _ReportsFailures)


class SwapsGroupsConnector(KVOffloadConnector):
    """A hybrid model's block tables taken in the wrong group order at admission: loads write the other group's
    blocks."""

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        class Swapped:
            def get_block_ids(self):
                return tuple(reversed(blocks.get_block_ids()))
        super().update_state_after_alloc(request, Swapped(), num_external_tokens)


class KilledMidWriteConnector(KVOffloadConnector):
    """The real connector, but its engine process is killed with SIGKILL halfway through writing its twelfth record
    into the shared tier: its first half written and fsynced under the temporary name, as a crash would leave it;
    records other I/O threads were writing are cut short wherever they were. (The I/O threads publish a batch's
    records in no set order: with eleven published, some prompt's first block is among them, and the next engine
    has a hit to serve.)"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.shared is not None:
            self.shared = KillingSharedTier(**dataclasses.asdict(self.shared))


class KillingFileTier(FileTier):
    written = 0

    @staticmethod
    def _publish(final, pieces) -> bool:
        KillingFileTier.written += final.suffix == ".kvr"  # (not the manifest)
        if KillingFileTier.written < 12:
            return FileTier._publish(final, pieces)
        whole = b"".join(bytes(piece) for piece in pieces)
        fd = os.open(final.with_name(f".{final.name}.killed.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, whole[:len(whole) // 2])
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: the process is dead")


@dataclasses.dataclass(frozen=True)
class KillingSharedTier(SharedTierConfig):
    def open(self, namespace, payload) -> FileTier:
        return KillingFileTier(self.options["path"], namespace, payload)
