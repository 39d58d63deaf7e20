"""Known offloading bugs, each re-created as a small, named deviation from the reference connector, or from the
production connector for the bugs of the engine modes vLLM runs on GPUs.

The conformance kit must catch every one (``test_faulty_variants.py``). Add a bug here when you learn of one.
"""

from __future__ import annotations

from functools import partial

from attrs import evolve

from kvoffload.impl import OffloadConnector, OffloadTier
from kvoffload.reference import LRUTier, ReferenceConnector
from kvoffload.spec import SpecConnector
from kvoffload.spec.groups import Group, longest_hit
from kvoffload.spec.types import WorkerOutput, group_key, offload_keys


class BreakOnRefusedStore(ReferenceConnector):
    """The seed bug (vLLM v0.11.0): a refused store allocation ``break``s out of the batch loop, so every later
    request in the batch misses this step's new block ids."""

    def _collect_stores(self, scheduler_output, plan) -> set[int]:
        for sched in scheduler_output.scheduled:
            self._update_block_table(sched)
            offered = self._storable(sched)
            slots = self.tier.prepare_store([key for _j, _g, key in offered], refuse=sched.req_id in self.refusing)
            if slots is None:
                self.refusing.discard(sched.req_id)
                break  # the bug: should be `continue`
            if slots:
                plan.stores.append(self._store_transfer(sched.req_id, offered, slots))
        return set()


class NoFlushOnPreemption(ReferenceConnector):
    """A preempted request's in-flight stores are not flushed, so they read its blocks after they were reused."""

    def handle_preemptions(self, metadata) -> None:
        pass


class FreeWhileStoring(ReferenceConnector):
    """``request_finished`` lets the engine free blocks that a store still reads, and never flushes that store:
    the blocks are reused under it."""

    def request_finished(self, request, block_ids) -> bool:
        flush = set(self._flush_next)
        super().request_finished(request, block_ids)
        self._flush_next = flush  # the bug: its stores are not fenced
        return False


class CursorNotRewound(ReferenceConnector):
    """Preemption keeps the store cursor, so blocks recomputed after the resume are never offered again."""

    def _rewind(self, req_id: str) -> None:
        self._cursors.setdefault(req_id, 0)


class _EvictThenRefuseTier(LRUTier):
    def prepare_store(self, keys, refuse=False, fetched=False):
        new = [key for key in keys if key not in self.slots]
        self.evict(self.evictable(set(keys))[:max(len(new) - len(self.free), 0)])  # the bug: evicts first
        return super().prepare_store(keys, refuse, fetched)


class EvictBeforeRefusing(ReferenceConnector):
    """A failed ``prepare_store`` evicts entries before it gives up: a refusal is no longer side-effect free."""

    tier_class = _EvictThenRefuseTier


class _IgnorePinsTier(LRUTier):
    def evictable(self, protected):
        return [key for key, slot in self.slots.items() if slot.ready and key not in protected]  # the bug: refs


class EvictPinned(ReferenceConnector):
    """The tier evicts an entry that an in-flight load has pinned; its slot is reused under the load."""

    tier_class = _IgnorePinsTier


class HitWhileStoring(ReferenceConnector):
    """The lookup offers a tier hit while the request's own stores are still in flight: a load and stores of one
    request overlap (they may begin and end inside one engine step)."""

    def _has_transfers(self, req_id: str) -> bool:
        return False


class _CountsAfterRefusingTier(LRUTier):
    def prepare_store(self, keys, refuse=False, fetched=False):
        saved = self.offers.copy()
        slots = super().prepare_store(keys, refuse, fetched)
        if slots is None:
            self.offers = saved  # the bug: a refusal for lack of room also forgets that the blocks were offered
        return slots


class ForgetsOffersWhenRefused(ReferenceConnector):
    """Admission that undoes a refused store's offers (ATOMIC read too widely): a block offered when the tier was
    full is counted as never offered, and stored later, or never, unlike the spec."""

    tier_class = _CountsAfterRefusingTier


class OffersDecodeBlocks(ReferenceConnector):
    """``store_prompts_only`` read nowhere: blocks of sampled tokens are stored too, evicting prompts'."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.config = evolve(config, store_prompts_only=False)  # the bug


# each reference variant, with the scenario (in scenarios.py) that triggers it
# Where the known bugs are hunted: transfers held back (so stores are in flight at preemptions and finishes), no
# GPU prefix cache (so shared prefixes come from the tier and loads pin entries), a tier small enough to refuse.
HUNT = "k1-delayed-failures-no-prefix-cache"
VARIANTS = {BreakOnRefusedStore: HUNT, NoFlushOnPreemption: HUNT, FreeWhileStoring: HUNT, CursorNotRewound: HUNT,
            EvictBeforeRefusing: HUNT, EvictPinned: HUNT, HitWhileStoring: HUNT,
            ForgetsOffersWhenRefused: "k1-threshold2-delayed-failures-no-prefix-cache",
            OffersDecodeBlocks: "k2-prompts-only-threshold3-delayed"}


# ---- the engine modes vLLM runs on GPUs, in the production connector ---------------------------------------------
class CursorPastHashes(OffloadConnector):
    """Async scheduling and draft tokens schedule positions whose tokens (and so keys) do not exist yet. Storing
    what is hashed is right; moving the cursor to the scheduled end anyway skips those blocks for good (the fix
    for the IndexError this mode raised, done wrong)."""

    def _store(self, state, full, computed):
        hashed = len(state.request.block_hashes) // self.k
        store = super()._store(state, min(full, hashed), computed)
        state.cursor = max(state.cursor, full)  # the bug: past blocks whose keys did not exist yet
        return store


class FirstReportCompletes(OffloadConnector):
    """Tensor parallelism: every worker reports every job. Taking the first report as the job's completion frees
    and serves what other workers are still copying (and the next report names a job it forgot)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.num_workers = 1  # the bug: one report per job


class _ResetForgetsInFlight(OffloadTier):
    def reset(self) -> None:  # the bug: only the idle entries go; in-flight stores become ready later
        self._remove([key for key, slot in self.slot_of.items() if self.ready[slot] and not self.refs[slot]])


class StoreLandsAfterReset(OffloadConnector):
    """A weight update resets the tier, but a store in flight at the reset lands afterwards and is served: KV
    computed with the old weights."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.tier = _ResetForgetsInFlight(config.tier_blocks, config.policy)


class _FailedLoadStaysTier(OffloadTier):
    def complete_load(self, keys, success=True) -> None:
        super().complete_load(keys, True)  # the bug: a failed load leaves its entry loadable


class FailedEntryOfferedForever(OffloadConnector):
    """A persistent fault fails every load of an entry; offering it again after each recompute makes a lone
    request load, fail and recompute forever (vLLM's kv_load_failure_policy="recompute")."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.tier = _FailedLoadStaysTier(config.tier_blocks, config.policy)


class StoresBeforeTheForwardPass(OffloadConnector):
    """Stores submitted in handle_preemptions, before the forward pass writes the step's tokens. With speculative
    decoding the block of the last sampled token still holds a rejected draft's KV then, and it is stored under the
    real key."""

    def handle_preemptions(self, metadata) -> None:
        super().handle_preemptions(metadata)
        super().wait_for_save(metadata)

    def wait_for_save(self, metadata) -> None:
        pass


def flushes_after_the_forward(connector_class):
    """The plan's flushes done in start_load_kv, as all three of our connectors did until the world called the
    hooks in vLLM's order: vLLM calls start_load_kv after the forward pass, which may already have written a block a
    sliding window freed, for another request, under a store still reading it (wrong KV filed under the old key)."""

    class FlushesAfterTheForward(connector_class):
        def handle_preemptions(self, metadata) -> None:
            pass

        def start_load_kv(self, metadata) -> None:
            connector_class.handle_preemptions(self, metadata)  # the bug: too late
            connector_class.start_load_kv(self, metadata)

    FlushesAfterTheForward.__doc__ = flushes_after_the_forward.__doc__
    return FlushesAfterTheForward


FlushesAfterTheForward = flushes_after_the_forward(OffloadConnector)


# each production variant, with the engine mode (a scenario in scenarios.GPU_MODE_SCENARIOS) that triggers it
GPU_MODE_VARIANTS = {
    CursorPastHashes: "k1-async-spec2-delayed-failures",
    FirstReportCompletes: "k1-tp2-delayed-failures-no-prefix-cache",
    StoreLandsAfterReset: "k1-tp2-delayed-failures-no-prefix-cache",
    FailedEntryOfferedForever: "k1-broken-loads-no-prefix-cache",
    StoresBeforeTheForwardPass: "k2-spec3-immediate-no-prefix-cache",
}
# each production variant of a hybrid model, with the scenario (in scenarios.HYBRID_SCENARIOS) that triggers it
HYBRID_PRODUCTION_VARIANTS = {FlushesAfterTheForward: "hybrid-k2-w5-full-delayed-failures"}


# ---- hybrid models (several KV cache groups), in the spec connector ------------------------------------------
class StoresAfterTheWindowFreed(SpecConnector):
    """A deferred store of a sliding-window block: the window moved past it, the engine freed the block (without
    telling) and reallocated it, and the store, not fenced, reads another request's bytes."""

    def _reading_left_behind(self, req_id, computed):
        return set()  # the bug: no fence


class ForgetsTheWindowAtFinish(SpecConnector):
    """A finish that does not flush the stores still reading the request's blocks, in a hybrid model: the engine
    frees them at once (vLLM's ``_connector_finished`` frees a window's old blocks even before
    ``request_finished``) and reuses them under the stores."""

    def request_finished(self, request, block_ids):
        flush = set(self.flush_next)
        delay = super().request_finished(request, block_ids)
        self.flush_next = flush  # the bug
        return delay


class LoadsNullBlocks(SpecConnector):
    """A load that counts the positions a sliding window does not need (the null block in its table) as blocks to
    fill: it names the null block."""

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:  # the bug: every position of the hit, null or not
            load = self.pending_loads[-1]
            bs, k, tables = self.config.block_size, self.config.k, self.block_tables[request.req_id]
            keys = offload_keys(request.block_hashes, k)
            first, end = request.num_computed_tokens // bs, (request.num_computed_tokens + num_external_tokens) // bs
            load.copies = tuple((table[i], group_key(keys[i // k], g), i % k) for g, table in enumerate(tables)
                                for i in range(first, end))


class AsksSomeGroups(SpecConnector):
    """A lookup that asks the tier about the groups ``asks`` keeps only (the bug of the two below)."""

    def asks(self, group):
        raise NotImplementedError

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.requests[request.req_id] = request
        if any(t.req_id == request.req_id for t in self.unfinished.values()):
            return 0, False
        per = self.config.offload_block_size
        asked = [g for g, group in enumerate(self.config.groups) if self.asks(group)]
        start = num_computed_tokens // per
        keys = offload_keys(request.block_hashes, self.config.k, 0, (request.num_tokens - 1) // per)
        end = start
        while end < len(keys) and all(self.tier.lookup([group_key(keys[end], g)]) for g in asked):
            end += 1
        return (end * per - num_computed_tokens, True) if end > start else (0, False)


class HitsWithoutTheWindow(AsksSomeGroups):
    """A lookup that asks only the full-attention groups: it offers a prefix whose sliding-window blocks the tier
    does not hold, so the request would resume without the KV its window reads."""

    def asks(self, group):
        return not group.window


class HitsWithoutTheState(AsksSomeGroups):
    """A lookup written before models had recurrent state: it asks only the attention groups, so a request would
    resume on the attention KV with whatever state its block held (vllm #50454: corrupted output from a hybrid
    model behind a connector)."""

    def asks(self, group):
        return not group.state


class StoresTheStateLikeAttention(SpecConnector):
    """A connector that takes a state group for full attention: it stores every position of the group's table,
    the null block where a chunk passed among them, under that position's key."""

    def __init__(self, config):
        super().__init__(evolve(config, groups=tuple(Group(block_size=g.block_size) if g.state else g
                                                     for g in config.groups)))


class SwapsGroups(SpecConnector):
    """A store that files each group's blocks under the other group's key (group ids swapped in one job)."""

    def _new_transfer(self, req_id, kind, copies):
        if kind == "store" and len(self.config.groups) == 2:
            swap = {group_key(h, g): group_key(h, 1 - g) for h in self.requests[req_id].block_hashes for g in (0, 1)}
            copies = [(b, swap.get(key, key), s) for b, key, s in copies]
        return super()._new_transfer(req_id, kind, copies)


class FailsLoadsByBlock(SpecConnector):
    """A hybrid model's failed load reported as invalid block ids, as with one group: vLLM raises RuntimeError
    (a block id does not say which group's block failed) and the engine stops."""

    def get_finished(self, finished_req_ids):
        submitted = dict(self.submitted)
        output = super().get_finished(finished_req_ids)
        self.load_errors |= {b for job_id, success in output.job_results if not success
                             and submitted[job_id].kind == "load" for b, _key, _sub in submitted[job_id].copies}
        return WorkerOutput(output.finished_sending, output.finished_recving, output.job_results)  # the bug


class KeysEveryGroupPerHashBlock(SpecConnector):
    """Groups with blocks of different sizes, keyed as if every block were ``Config.block_size`` tokens (the hash
    block): a larger block is filed under the hash of a prefix it does not end, and its bytes serve the wrong
    prefix."""

    def _keys(self, request):
        return [offload_keys(request.block_hashes, self.config.k)] * len(self.config.groups)  # the bug


class HitsInsideALargerBlock(SpecConnector):
    """A lookup that aligns hits to ``offload_block_size`` only, not to every group's offload blocks: a hit may end
    inside a larger block of another group, which the load then skips (it is not whole), so the request resumes
    on a block that holds no KV for the positions before the hit's end."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.requests[request.req_id] = request
        if any(t.req_id == request.req_id for t in self.unfinished.values()):
            return 0, False
        per, sizes, keys = self.config.offload_block_size, self.config.offload_block_sizes, self._keys(request)
        limit = min(request.num_tokens - 1, len(request.block_hashes) * self.config.block_size)

        def cached(g, j):  # j: an offload block of `per` tokens; the tier holds its group's offload block around it
            i = j * per // sizes[g]
            return (i + 1) * sizes[g] <= num_computed_tokens or (
                i < len(keys[g]) and self.tier.lookup([group_key(keys[g][i], g)]) == 1)
        end = longest_hit(self.config.groups, [per] * len(sizes), limit, cached)  # the bug: [per], not sizes
        return (end - num_computed_tokens, True) if end > num_computed_tokens else (0, False)


# each hybrid variant, with the scenario (in scenarios.HYBRID_SCENARIOS) that triggers it
HYBRID_VARIANTS = {
    FailsLoadsByBlock: "hybrid-k2-w5-full-delayed-failures",
    StoresAfterTheWindowFreed: "hybrid-k2-w5-full-delayed-failures",
    ForgetsTheWindowAtFinish: "hybrid-k2-w5-full-delayed-failures",
    LoadsNullBlocks: "hybrid-w4-full-immediate",
    HitsWithoutTheWindow: "hybrid-w4-only-delayed-failures",
    SwapsGroups: "hybrid-w4-full-immediate",
    KeysEveryGroupPerHashBlock: "hybrid-w8@4-full-delayed-failures",
    HitsInsideALargerBlock: "hybrid-full@6-w5-full@4-tp2-no-prefix-cache",
    HitsWithoutTheState: "hybrid-state-full-delayed-failures",
    StoresTheStateLikeAttention: "hybrid-full-state-w4-async-tp2-delayed-failures",
}


# ---- synchronous loads, in the spec connector: each is caught by the invariant named, at the invariants level
class DoesNotWaitForSyncLoads(SpecConnector):
    """A synchronous hit whose load the worker only submits: the forward pass reads blocks it is still filling."""

    def start_load_kv(self, metadata) -> None:
        for load in metadata.loads:
            self._submit(load, partial(self._copy_in, load))  # the bug: no wait


class ReportsSyncLoadsFinished(SpecConnector):
    """A synchronous load's request named in finished_recving, as an asynchronous one's is: it is running, and
    vLLM asserts that a request named there waits for its load or has finished."""

    def get_finished(self, finished_req_ids):
        done = [t for t in self.submitted.values() if t.kind == "load"]
        output = super().get_finished(finished_req_ids)
        polled = {job_id for job_id, _ok in output.job_results}
        return evolve(output, finished_recving=output.finished_recving | {t.req_id for t in done
                                                                          if t.job_id in polled})


class StoresWhatAFailedRequestComputed(SpecConnector):
    """A request that ended with an error keeps its stores: what it computed after a synchronous load failed (its
    own, or another request's it hit in the engine's prefix cache) becomes tier entries, served to the next hit."""

    def request_finished(self, request, block_ids) -> bool:
        poisoned = set(self.poisoned)
        delay = super().request_finished(request, block_ids)
        self.poisoned = poisoned  # the bug
        return delay


SYNC_VARIANTS = {
    DoesNotWaitForSyncLoads: ("k1-sync-delayed-failures", "SYNC"),
    ReportsSyncLoadsFinished: ("k1-sync-immediate-failures-no-prefix-cache", "JOBS"),
}  # StoresWhatAFailedRequestComputed takes four requests of one prompt: an explicit program catches it
   # (test_faulty_variants.py)


# ---- the fleet's shared store: bugs of vLLM's, LMCache's and SGLang's shared tiers (DESIGN §9), re-created in the
# production connector; each is caught by the invariant named, the kit at the invariants level
class _Unchecked:
    """A backend whose reads take every record as whole: the bytes it read, whatever they are."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get(self, keys, into):
        self.store.get(keys, into)
        return [True] * len(keys)


class ServesUncheckedRecords(OffloadConnector):
    """Records served without their checks (LMCache checks checksums only in tests; vLLM's fs tier only the byte
    count): a torn record's half, or a vanished one's garbage, reaches a GPU block."""

    def attach_worker_store(self, open, namespace) -> None:
        super().attach_worker_store(lambda ns, payload: _Unchecked(open(ns, payload)), namespace)


class KeepsItsIdentityAtReset(OffloadConnector):
    """A reset (a weight update) that clears the tier but keeps the namespace: the store serves KV computed with the
    old weights (vLLM's ``reset_cache`` leaves its secondary tiers alone, vllm#44541)."""

    def attach_shared_tier(self, open, namespace) -> None:
        if self.shared is None:
            super().attach_shared_tier(open, namespace)

    def reset_cache(self) -> bool:
        super().reset_cache()
        self.identified = self.shared is not None
        return True


class AttachesAtFirstLookup(OffloadConnector):
    """The store attached at the first lookup, with the identity the engine started with, and a reset that moves on
    only a store already attached: an engine whose weights were updated, then reset, before its first request
    shares the checkpoint's records (kvoffload before its identity was derived from the weights held, flow 1 of
    issue 38)."""

    def attach_shared_tier(self, open, namespace) -> None:
        if self.shared is None:
            self.started_as = getattr(self, "started_as", (open, namespace))
        elif getattr(self, "moves_on", False):
            self.moves_on = False
            super().attach_shared_tier(open, namespace)

    def reset_cache(self) -> bool:
        self.moves_on = self.shared is not None
        return super().reset_cache()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.shared is None and hasattr(self, "started_as"):
            super().attach_shared_tier(*self.started_as)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class CountsResets(OffloadConnector):
    """An identity that moves on by a count of resets (an epoch): two engines that each updated once, to other
    weights, share each other's records (flow 2 of issue 38: a replica restarted mid-run, replicas given other
    updates)."""

    def attach_shared_tier(self, open, namespace) -> None:
        started = getattr(self, "started_as", namespace)
        self.started_as, self.resets = started, getattr(self, "resets", -1) + 1
        super().attach_shared_tier(open, evolve(started, weights=f"{started.weights}+{self.resets}"))


class TrustsTheCheckpointAtStart(OffloadConnector):
    """An engine that starts names its weights by its checkpoint's path, names and sizes, not by the bytes it loaded:
    a fine-tune redeployed to the same path shares the old checkpoint's records (flow 3 of issue 38: the fingerprint
    read names, sizes and the first and last MiB of each file)."""

    def attach_shared_tier(self, open, namespace) -> None:
        started, self.started = getattr(self, "started", False), True
        super().attach_shared_tier(open, namespace if started else evolve(namespace, weights="w0"))


class LeavesTheConfigOut(OffloadConnector):
    """An identity of the weights alone: an engine on the same weights under another model config (``rope_theta``,
    an override, a quantization) computes other KV, and is served the first one's (flow 4 of issue 38)."""

    def attach_shared_tier(self, open, namespace) -> None:
        super().attach_shared_tier(open, evolve(namespace, model="model-0"))


class DeletesOnAFailedGet(OffloadConnector):
    """A get that fails deletes the records it could not read, transient error or not (vLLM's fs tier deletes the
    file on any load exception, on a directory other replicas share)."""

    def _got(self, get, success: bool) -> None:
        if not success:
            self.worker_store.at(get.weights).delete(get.keys)
        super()._got(get, success)


class NeverGivesUp(OffloadConnector):
    """A lookup that waits for the store's answer however long it takes (LMCache's ``contains()`` has no timeout):
    with the store dead, no request is ever admitted."""

    def _store_settled(self, shared, state, computed: int) -> bool:
        lookup = state.store_lookup
        if lookup is not None and not lookup.settled and not lookup.answer.done():
            return False
        return super()._store_settled(shared, state, computed)


class PutsWhatItGot(OffloadConnector):
    """Every record a get brought into the tier is put back into the store: twice the writes, for nothing."""

    def _got(self, get, success: bool) -> None:
        super()._got(get, success)
        if success:
            self._unput += get.keys


# each fleet variant, with the scenario (in scenarios.FLEET_SCENARIOS) that triggers it and the invariant that
# catches it (the kit at the invariants level, as it runs a third party's connector)
FLEET_VARIANTS = {
    ServesUncheckedRecords: ("fleet2-k1-immediate", "CONTENT"),
    KeepsItsIdentityAtReset: ("fleet2-k1-immediate", "NAMESPACE"),
    AttachesAtFirstLookup: ("fleet2-weight-versions", "NAMESPACE"),
    CountsResets: ("fleet2-weight-versions", "NAMESPACE"),
    TrustsTheCheckpointAtStart: ("fleet2-weight-versions", "NAMESPACE"),
    LeavesTheConfigOut: ("fleet3-k2-models-restarts-delayed-failures", "NAMESPACE"),
    DeletesOnAFailedGet: ("fleet2-k1-immediate", "KEEP"),
    NeverGivesUp: ("fleet2-dead-store", "PROGRESS"),
    PutsWhatItGot: ("fleet2-k1-immediate", "WRITE-ONCE"),
}
