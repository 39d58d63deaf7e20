"""Connector variants the engine tests load by module path: one whose transfers really fail, one that records
the KV events it hands vLLM."""

from __future__ import annotations

from kvoffload.impl.transfer import InlineExecutor
from kvoffload.impl.vllm_connector import KVOffloadConnector


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
