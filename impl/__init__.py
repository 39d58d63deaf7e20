"""kvoffload.impl — the production offloading connector: fast bookkeeping, batched copies, CUDA streams."""

from .connector import OffloadConnector
from .kv import LayeredKV
from .tier import OffloadTier
from .transfer import CudaStreamExecutor, InlineExecutor

__all__ = ["CudaStreamExecutor", "InlineExecutor", "OffloadConnector", "LayeredKV", "OffloadTier"]
