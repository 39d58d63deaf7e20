"""kvoffload.impl — the production offloading connector: fast bookkeeping, batched copies, CUDA streams."""

from .connector import KVOffloadConnector
from .kv import LayeredKV
from .tier import OffloadTier
from .transfer import CudaStreamExecutor, InlineExecutor

__all__ = ["CudaStreamExecutor", "InlineExecutor", "KVOffloadConnector", "LayeredKV", "OffloadTier"]
