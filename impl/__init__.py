"""kvoffload.impl — the production offloading connector: fast bookkeeping, batched copies, CUDA streams.

Test tooling (fake KV caches, the vLLM scheduler harness, the demo, the black-box driver) is in the opt-in
``kvoffload.impl.testing``; nothing here imports it."""

from .connector import OffloadConnector
from .tier import OffloadTier
from .transfer import CudaStreamExecutor, InlineExecutor

__all__ = ["CudaStreamExecutor", "InlineExecutor", "OffloadConnector", "OffloadTier"]
