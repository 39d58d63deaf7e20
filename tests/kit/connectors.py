"""Small third-party-style adapters for the kit's own tests (importable, so their traces replay by name)."""

from attrs import evolve

from kvoffload.spec import CONNECTOR_METHODS, FENCED_FREES, PINS, Config, SpecConnector
from kvoffload.spec.kit import Scenario

# Stores in flight at finishes (delay), a tier small enough to refuse, failures on.
SCENARIO = Scenario(Config(num_gpu_blocks=12, tier_blocks=3, prefix_caching=False), delay=2, failures=True)


class ForgetsTheFence(SpecConnector):
    """Frees at once, as the spec connector does, but never flushes the stores still reading the blocks."""

    def request_finished(self, request, block_ids):
        flush = set(self.flush_next)
        super().request_finished(request, block_ids)
        self.flush_next = flush  # the engine reuses blocks a store still reads
        return False


class DelaysFrees(SpecConnector):
    """The other free protocol vLLM offers (its 0.11 connector's): ``request_finished`` delays the free while a
    store reads the request's blocks, the next plan names the request, and the worker reports it in
    ``finished_sending`` once its transfers drained."""

    capabilities = SpecConnector.capabilities - {FENCED_FREES}

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.delayed: set[str] = set()  # since the last plan
        self.draining: set[str] = set()  # worker side: delayed, transfers not all completed

    def request_finished(self, request, block_ids):
        stores = [t for t in self.unfinished.values() if t.req_id == request.req_id and t.kind == "store"]
        flush = set(self.flush_next)
        super().request_finished(request, block_ids)
        held = {b for table in self._tables(block_ids) for b in table}  # a window's were freed before the call
        self.flush_next = flush | {t.job_id for t in stores if any(b not in held for b, _k, _s in t.copies)}
        if stores:
            self.delayed.add(request.req_id)
        return bool(stores)

    def build_connector_meta(self, scheduler_output):
        plan = super().build_connector_meta(scheduler_output)
        plan.delayed, self.delayed = frozenset(self.delayed), set()
        return plan

    def start_load_kv(self, metadata):
        self.draining |= metadata.delayed
        super().start_load_kv(metadata)

    def get_finished(self, finished_req_ids):
        output = super().get_finished(finished_req_ids)
        busy = {t.req_id for t in self.submitted.values()}
        sending, self.draining = self.draining - busy, self.draining & busy
        return evolve(output, finished_sending=frozenset(sending))


class ForgetsDelayedFrees(DelaysFrees):
    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return False  # the engine reuses blocks a store still reads


class Undeclared:
    """The spec connector (delaying frees, the protocol a connector that declares nothing follows) behind nothing
    but the connector method set: it declares no capabilities."""

    def __init__(self, config: Config) -> None:
        inner = DelaysFrees(config)
        for name in CONNECTOR_METHODS:
            setattr(self, name, getattr(inner, name))


class RaisesAtFinish(SpecConnector):
    """A connector with a bug of its own: an exception, not a wrong answer."""

    def request_finished(self, request, block_ids):
        raise IndexError("slot out of range")


class AssertsAtFinish(SpecConnector):
    """A connector whose own assert fails as a request finishes."""

    def request_finished(self, request, block_ids):
        assert request.num_prompt_tokens < 1, "a request with a prompt finished"
        return super().request_finished(request, block_ids)


class AssertsAtLookup(SpecConnector):
    """A connector whose own assert fails at its first lookup of a request with a whole block."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        assert request.num_prompt_tokens < 2, "a prompt of two tokens"
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class AssertsPastLength(SpecConnector):
    """A connector whose assert fails at the lookup of a prompt longer than ``longest`` tokens."""

    def __init__(self, config: Config, longest: int) -> None:
        super().__init__(config)
        self.longest = longest

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        assert request.num_prompt_tokens <= self.longest, f"a prompt longer than {self.longest}"
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def asserts_past(config: Config, longest: int = 1 << 20) -> AssertsPastLength:
    """A factory with an argument of its own, bound by ``functools.partial``: a trace records it."""
    return AssertsPastLength(config, longest)


class FailsInSetOrder(SpecConnector):
    """A bug that shows in some processes only: whether a request's finish raises depends on the order of a set of
    request ids, which is the process's string hash seed's (under PYTHONHASHSEED=0 r1's raises, under 1 none does)."""

    def request_finished(self, request, block_ids):
        if next(iter({request.req_id, "r0"})) != "r0":
            raise IndexError(f"{request.req_id} before r0")
        return super().request_finished(request, block_ids)


class DelaysEveryFree(DelaysFrees):
    """Cautious, and safe: every free is delayed, whether or not a store is in flight, and each delayed request is
    reported in finished_sending only ``HOLD`` polls after its stores drained."""

    HOLD = 2

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.held: dict[str, int] = {}  # drained, polls still to wait

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        self.delayed.add(request.req_id)
        return True

    def get_finished(self, finished_req_ids):
        output = super().get_finished(finished_req_ids)
        for req_id in output.finished_sending:
            self.held[req_id] = self.HOLD
        sending = {r for r, n in self.held.items() if n == 0}
        self.held = {r: n - 1 for r, n in self.held.items() if n}
        return evolve(output, finished_sending=frozenset(sending))


class NeverReleases(DelaysFrees):
    """Unsafe in no step, but a delayed free that is never reported: the blocks never return to the engine."""

    def get_finished(self, finished_req_ids):
        return evolve(super().get_finished(finished_req_ids), finished_sending=frozenset())


class HoldsStoredBlocks(SpecConnector):
    """The third free protocol (PINS), vLLM's SimpleCPUOffloadConnector's: the spec connector, holding the GPU blocks
    of every store it plans in the engine's pool until the store is reported. It frees at once, and needs no fence."""

    capabilities = SpecConnector.capabilities - {FENCED_FREES} | {PINS}

    def bind_gpu_block_pool(self, pool) -> None:
        self.pool, self.holding = pool, {}

    def build_connector_meta(self, scheduler_output):
        plan = super().build_connector_meta(scheduler_output)
        for t in plan.stores:
            self.holding[t.job_id] = [block for block, _key, _sub in t.copies]
            self.pool.take(self.holding[t.job_id])
        return plan

    def update_connector_output(self, output) -> None:
        super().update_connector_output(output)
        for job_id, _success in output.job_results:
            self.pool.release(self.holding.pop(job_id, []))


class KeepsStoredBlocks(HoldsStoredBlocks):
    """Never frees the blocks it held: the engine loses them."""

    def update_connector_output(self, output) -> None:
        SpecConnector.update_connector_output(self, output)


class FreesStoredBlocksTwice(HoldsStoredBlocks):
    """Frees each store's blocks twice: a block a request still holds goes back to the free queue."""

    def update_connector_output(self, output) -> None:
        for job_id, _success in output.job_results:
            self.pool.release(list(self.holding.get(job_id, [])))
        super().update_connector_output(output)
