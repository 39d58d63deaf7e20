"""Requests as the engine tracks them, and the model that writes their tokens: a deterministic greedy "model", so that
equal prefixes continue equally, and block hashes chained over the tokens, so that equal hashes mean equal
prefixes. What a computed block holds (its KV) is a function of its hash and of the weights that computed it.
"""

from __future__ import annotations

from enum import Enum

from attrs import define, field

from .types import HASH_BITS, NULL_BLOCK


def extend_block_hashes(tokens: list[int], block_size: int, hashes: list[int]) -> None:
    """Append the chained hash of every block of ``tokens`` that became full: equal hashes mean equal prefixes."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else 0
        hashes.append(hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]))) & HASH_BITS)


def kv_content(block_hash: int, weights: int, identity: int = 0) -> int:
    """The KV a block holds for the prefix ending in ``block_hash``, computed with ``weights`` (0: the checkpoint's)
    by an engine of KV identity ``identity`` (its model, dtype, ...: ``records.Namespace``). The same tokens give
    other KV with other weights, or in another model: a record of either must never reach this engine's blocks.
    Weights are never negative: CPython hashes -1 as -2, and two weights would give the same KV."""
    if identity:
        return hash((block_hash, weights, identity)) & HASH_BITS
    return block_hash if weights == 0 else hash((block_hash, weights)) & HASH_BITS


def next_token(tokens: list[int]) -> int:
    """The 'model': a deterministic greedy next token, so equal prefixes continue equally."""
    return hash(tuple(tokens[-3:])) % 3


def continuation(tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(next_token(out))
    return out[len(tokens):]


class State(Enum):
    WAITING = "waiting"
    WAITING_FOR_LOAD = "waiting-for-load"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # its load failed under the "fail" policy (vLLM's FINISHED_ERROR)


@define(eq=False)
class Request:
    """A request as the engine tracks it. A connector reads it as a ``RequestView`` (``req_id``, ``block_hashes``,
    ``num_tokens``, ``num_computed_tokens``, ``num_prompt_tokens``; the timing rule is written there)."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    block_size: int
    tokens: list[int] = field()  # every token sampled so far, as the GPU holds them
    num_tokens: int = 0  # of which the scheduler has seen (async scheduling: one step behind)
    block_hashes: list[int] = field(factory=list)  # of the full blocks of the first num_tokens tokens
    content_hashes: list[int] = field(factory=list)  # of the full blocks of all tokens: what computed KV holds
    state: State = State.WAITING
    num_computed_tokens: int = 0  # the scheduler's count: it includes placeholders and unverified drafts
    num_placeholders: int = 0  # tokens sampled (or about to be) that the scheduler has not seen (vLLM's name)
    rollback: int = 0  # rejected drafts the scheduler has not rolled back yet (async scheduling)
    num_final_tokens: int = 0  # leading positions whose KV the true tokens wrote, for good
    num_in_flight_tokens: int = 0  # scheduled, their step's output not delivered yet (async scheduling)
    tables: list[list[int]] = field(factory=lambda: [[]])  # a block table per KV cache group (NULL_BLOCK: freed)
    # blocks a sliding window freed from these tables -> (group, position): a store fenced before their reuse may
    # still read them (vLLM's connector does), until they are written again
    left_behind: dict[int, tuple[int, int]] = field(factory=dict)
    num_cached_tokens: int = 0  # leading tokens whose blocks are registered in the prefix cache, in every group
    # leading tokens vLLM's block pool commits as it schedules them (the world's prefix cache takes them once
    # computed): how far a model with recurrent state has handed its state blocks to the connector
    num_committed_tokens: int = 0
    load_target: int = 0  # tokens computed once the pending load lands
    shared_prefix_boundary: int = 0  # where its prefix stops being cached in a group that had more than the hit
    looked_up: bool = False  # the connector has seen this request
    resumed: bool = False  # preempted since it last ran
    sampled_last: bool = False  # its last step sampled a token: it may verify drafts now (speculative decoding)
    # a forward pass read a block a synchronous load failed to fill: what it computed is garbage, and the engine
    # fails it as that load's output arrives
    read_invalid: bool = False

    @tokens.default
    def _prompt(self) -> list[int]:
        return list(self.prompt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def __attrs_post_init__(self) -> None:
        self.num_tokens = len(self.tokens)
        extend_block_hashes(self.tokens, self.block_size, self.content_hashes)
        self.block_hashes = list(self.content_hashes)

    @property
    def blocks(self) -> list[int]:
        """Every block the request holds, in all groups."""
        return [b for table in self.tables for b in table if b != NULL_BLOCK]

    @property
    def failed(self) -> bool:
        return self.state is State.FAILED

    def loading(self) -> bool:
        """Admitted with a tier hit, its load not landed yet. A method: calls change ``state`` behind a type
        checker's back, and it would narrow a property (or ``state`` itself) across them."""
        return self.state is State.WAITING_FOR_LOAD

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt)

    def sample(self, n: int) -> None:
        """The GPU samples ``n`` tokens; the scheduler sees them when they are delivered."""
        self.tokens += continuation(self.tokens, n)
        extend_block_hashes(self.tokens, self.block_size, self.content_hashes)

    def drop_undelivered(self) -> None:
        """Sampled tokens the scheduler never saw are forgotten (they will be sampled again)."""
        del self.tokens[self.num_tokens:]
        del self.content_hashes[len(self.tokens) // self.block_size:]

    def deliver(self, n: int) -> None:
        """``n`` more sampled tokens reach the scheduler: their block hashes exist from now on."""
        self.num_tokens += n
        self.block_hashes += self.content_hashes[len(self.block_hashes):self.num_tokens // self.block_size]
