"""Configuration of one engine + connector, and the errors raised for bad input."""

from __future__ import annotations

from math import gcd, lcm
from typing import TypeVar, cast

from attrs import frozen

from .groups import FULL_ATTENTION, Group

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that no engine or tier could run with."""


class UnknownRequestError(KeyError):
    """A connector was told about a request id it never saw."""

    def __str__(self) -> str:  # KeyError would print only the repr of the id
        message: str = self.args[0]
        return message


class BlockIdError(IndexError):
    """A block id outside the GPU pool (or a tier slot outside the tier)."""


def registered(value: T | None, name: str) -> T:
    """A worker-side attribute that ``register_kv_caches`` sets: a clear error when it has not been called."""
    if value is None:
        raise RuntimeError(f"{name} is not set: register_kv_caches has not been called")
    return value


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _require_non_negative(name: str, value: object) -> None:
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


def _require_time(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a non-negative, finite time, got {value!r}")


@frozen
class Config:
    """Sizes are in tokens or in blocks, as named; everything is small on purpose."""

    num_gpu_blocks: int = 16
    block_size: int = 2  # tokens per GPU block and per block hash (a group may have larger blocks: Group.block_size)
    offload_block_size: int = 2  # tokens per tier entry: k GPU blocks, k >= 1 (of each group's own size)
    tier_blocks: int = 8  # tier capacity, in offload blocks
    token_budget: int = 8  # tokens the scheduler may compute per step
    policy: str = "lru"
    prefix_caching: bool = True  # the engine's own GPU prefix cache; off, every shared prefix comes from the tier
    num_workers: int = 1  # workers that each hold a shard of every block and report every transfer (vLLM: TP x PP)
    # How the engine runs (vLLM on GPUs): the connector must be correct in every mode, so the world models them.
    async_scheduling: bool = False  # step N+1 is scheduled before step N's output (tokens, transfers) is applied
    num_spec_tokens: int = 0  # draft tokens scheduled per decode step; rejected ones roll computed tokens back
    # The model's KV cache groups (a hybrid model has several, e.g. sliding-window and full-attention layers).
    # Only a connector that declares GROUPS (vLLM's SupportsHMA) sees more than one; for any other, the engine
    # turns its hybrid manager off and every layer gets full-attention blocks, as vLLM does.
    groups: tuple[Group, ...] = FULL_ATTENTION
    # State layers that save a prefill checkpoint (vLLM's Mamba2 and KDA layers: ``num_prefill_checkpoint_blocks``):
    # the prompt's last chunk runs past its last state position and the forward pass saves the state there, a
    # multiple of this many tokens from the chunk's start (``prefill_checkpoint_alignment``). None: no checkpoints.
    checkpoint_alignment: int | None = None
    # Which window and state blocks the engine's prefix cache keeps (vLLM's ``prefix_cache_retention_interval``):
    # 0 (vLLM's default) only where a later request resumes (the prompt's last block boundary, a shared-prefix
    # junction); n > 0 also one per n tokens; None every one. Full attention keeps every block.
    retention_interval: int | None = 0
    # A shared store's existence check may take a while; a lookup that finds it unanswered after this long (on the
    # store's clock: ticks in the world, seconds in vLLM) gives up on it (a miss), so that a slow or dead store
    # never holds a request back for long. Time, not a count of lookups: those come as fast as the engine spins.
    lookup_deadline: float = 3
    # Admission: which offered blocks the tier takes, so that stores pay for themselves. A block the tier lacks is
    # stored once it has been offered ``store_threshold`` times, by any requests (1: at once; vLLM's
    # store_threshold, Dynamo KVBM's frequency filter): a prefix computed once never evicts one that recurs. Offers
    # are counted for the ``offers_remembered`` keys offered last. ``store_prompts_only``: only blocks all of whose
    # tokens are the prompt's are offered (LMCache's default: decode KV is rarely asked for again).
    store_threshold: int = 1
    offers_remembered: int = 65536
    store_prompts_only: bool = False
    # What the engine does with a request whose load failed (vLLM's ``kv_load_failure_policy``): "recompute" rewinds
    # it to the first block it could not load and computes the rest; "fail", vLLM's default, ends it with an error
    # (FINISHED_ERROR: the client hears of it). A connector must be correct under both.
    load_failure_policy: str = "recompute"
    # Hits load synchronously: in the step that computes the rest of the prompt, before its forward pass, which
    # saves the step an asynchronous load waits (vLLM's ``has_sync_kv_loads``). Only under the "fail" policy, without
    # async scheduling, with one KV cache group of attention (spec/invariants.py, LOOKUP, says why).
    sync_loads: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "offload_block_size", "tier_blocks", "token_budget",
                     "num_workers", "store_threshold", "offers_remembered"):
            _require_positive(name, getattr(self, name))
        _require_non_negative("num_spec_tokens", self.num_spec_tokens)
        _require_time("lookup_deadline", self.lookup_deadline)
        if self.offload_block_size % self.block_size:
            raise ConfigError(
                f"offload_block_size ({self.offload_block_size} tokens) must be a multiple of "
                f"block_size ({self.block_size} tokens)"
            )
        if not self.groups or not all(isinstance(g, Group) for g in cast(tuple[object, ...], self.groups)):
            raise ConfigError(f"groups must be one or more Group, got {self.groups!r}")
        if gcd(*self.block_sizes) != self.block_size:
            raise ConfigError(f"block_size ({self.block_size} tokens per block hash) must be the greatest common "
                              f"divisor of the KV cache groups' block sizes {list(self.block_sizes)}, as in vLLM")
        if any(g.state for g in self.groups):
            self._check_state_groups()
        if self.retention_interval is not None:
            _require_non_negative("retention_interval", self.retention_interval)
            if self.retention_interval % lcm(*self.block_sizes):
                raise ConfigError(f"retention_interval ({self.retention_interval} tokens) must be a multiple of the "
                                  f"scheduler's block size ({lcm(*self.block_sizes)} tokens), as in vLLM")
        if self.checkpoint_alignment is not None:
            _require_positive("checkpoint_alignment", self.checkpoint_alignment)
            if not any(g.state for g in self.groups):
                raise ConfigError("checkpoint_alignment is for a model with recurrent state: add a state group")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"unknown load_failure_policy {self.load_failure_policy!r}; known: 'recompute', 'fail'")
        if self.sync_loads and (self.load_failure_policy != "fail" or self.async_scheduling or len(self.groups) > 1
                                or self.groups[0].state):
            raise ConfigError("sync_loads needs load_failure_policy 'fail', no async scheduling and one KV cache group "
                              "of attention: vLLM leaves a failed synchronous load's blocks in its prefix cache under "
                              "'recompute' or when its request ends before the step's output arrives, and cannot be "
                              "told which blocks failed in a model of several groups")
        if self.policy not in ("lru", "arc"):
            raise ConfigError(f"unknown eviction policy {self.policy!r}; known: 'lru', 'arc'")

    def _check_state_groups(self) -> None:
        """What the world models of recurrent state (vLLM's align mode), refused clearly beyond it."""
        if not self.prefix_caching:
            raise ConfigError("a state group is Mamba state in vLLM's align mode, which is its prefix cache for "
                              "Mamba: prefix_caching must be on")
        if len(set(self.block_sizes)) > 1:
            raise ConfigError(f"with a state group every group has blocks of one size (vLLM aligns them), got "
                              f"{list(self.block_sizes)}")
        if self.k > 1:
            raise ConfigError("a state group's offload block is one GPU block, the state at its end: "
                              f"offload_block_size must equal block_size, got {self.offload_block_size} and "
                              f"{self.block_size}")
        if self.num_spec_tokens >= self.block_size:
            raise ConfigError(f"with a state group, num_spec_tokens must be below block_size, got "
                              f"{self.num_spec_tokens} and {self.block_size}: vLLM's align mode gives a state block "
                              "hundreds of tokens; with more drafts than a block holds, vLLM copies a boundary's state "
                              "to a position its table holds the null block at, which the spec does not model")

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups: block ids come one table per group, and a failed load is reported by request
        (a block id alone does not say which group's block failed)."""
        return len(self.groups) > 1

    def block_size_of(self, group: Group) -> int:
        """Tokens per GPU block of a group. Its offload block is ``k`` of its blocks."""
        return group.block_size or self.block_size

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(map(self.block_size_of, self.groups))

    @property
    def offload_block_sizes(self) -> tuple[int, ...]:
        """Tokens per offload block of each group: ``k`` of its GPU blocks. Each is a multiple of
        ``offload_block_size``, so every offload block of every group ends on an ``offload_block_size`` boundary."""
        return tuple(self.k * size for size in self.block_sizes)

    @property
    def hashes_per_offload_block(self) -> tuple[int, ...]:
        """Block hashes per offload block of each group: its keys are ``offload_keys(block_hashes, this)``."""
        return tuple(size // self.block_size for size in self.offload_block_sizes)

    @property
    def k(self) -> int:
        """GPU blocks per offload block."""
        return self.offload_block_size // self.block_size
