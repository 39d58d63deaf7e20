"""kvoffload.reference — a plain, obviously-correct offloading connector (torch CPU tensors)."""

from .connector import ReferenceConnector, TensorKV, Transfer
from .tier import LRUTier

__all__ = ["LRUTier", "ReferenceConnector", "TensorKV", "Transfer"]
