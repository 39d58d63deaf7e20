"""The black box's adapter for vLLM 0.33: every class and field the black box touches is where 0.32 has it (the
additions have defaults), so 0.32's adapter serves. What changed inside vLLM's ``OffloadingConnector`` (per-request
LRU order, a lock held across a step's lookups, a fenced reset) is the connector's own behaviour, judged by the kit.

0.33 ships only as the CUDA wheel; its scheduler side runs on CPU without the compiled kernels."""

from __future__ import annotations

from . import vllm_0_32


class Release(vllm_0_32.Release):
    version = "0.33"
    lru_starves = True  # a request's chunks keep the rank of its first lookup
