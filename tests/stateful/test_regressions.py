"""Failures Hypothesis found, kept as explicit programs. Each docstring says what broke and what fixed it."""

import subprocess
import sys
import textwrap

import pytest

from attrs import evolve

from kvoffload.spec import Config, Executor, ListKV, SpecConnector, Violation, World
from kvoffload.spec.kit import Scenario
from kvoffload.spec.types import offload_keys

from .scenarios import HYBRID_SCENARIOS


def as_found(name: str) -> Scenario:
    """A hybrid scenario as its program was found in: before spec 0.15 the world's prefix cache kept every window
    and state block (vLLM's ``prefix_cache_retention_interval=None``)."""
    scenario = HYBRID_SCENARIOS[name]
    return evolve(scenario, config=evolve(scenario.config, retention_interval=None))

DELAYED_FREES_PROGRAM = textwrap.dedent("""
    from kvoffload.reference import ReferenceConnector, TensorKV
    from kvoffload.spec.kit import make_machine
    from tests.stateful.scenarios import SCENARIOS

    machine = make_machine(ReferenceConnector, SCENARIOS["k2-immediate-failures"], "exact", TensorKV)
    state = machine()
    state.add_requests(batch=[([0], 1), ([0], 1), ([0, 1, 0, 1, 2, 2, 0], 1)])
    for _ in range(6):
        state.reset_prefix_cache()
    state.step(n=2)
    for _ in range(4):
        state.reset_prefix_cache()
    state.add_requests(batch=[([0], 1)])
    state.abort(i=0)
    state.add_requests(batch=[([0], 1), ([0, 1, 0, 1, 2, 2, 0], 2), ([0, 0, 0], 3),
                              ([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0], 2)])
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0], 1), ([0, 1, 0, 1, 2, 2, 0], 1)])
    state.step(n=4)
    state.invariants_hold()
    state.teardown()
    print("equal")
""")


def test_delayed_frees_do_not_depend_on_set_order_shrunk_program():
    """Found in the k2-immediate-failures scenario: the world freed the blocks of the requests in
    ``finished_sending`` in set iteration order, which differs between two sets built differently, so the
    reference's and the spec's worlds reused blocks in different orders and diverged ('requests differ' at step 6).
    Fixed: the world sorts."""
    done = subprocess.run([sys.executable, "-c", DELAYED_FREES_PROGRAM], capture_output=True, text=True,
                          env={"PYTHONHASHSEED": "3", "PATH": ""}, cwd=__file__.rsplit("/tests/", 1)[0])
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]


class BackwardsSet(frozenset):
    """A set that iterates in the opposite of sorted order: an adversarial but legal connector answer."""

    def __iter__(self):
        return iter(sorted(frozenset.__iter__(self), reverse=True))


class BackwardsReports(SpecConnector):
    def get_finished(self, finished_req_ids):
        out = super().get_finished(finished_req_ids)
        return type(out)(BackwardsSet(out.finished_sending), BackwardsSet(out.finished_recving), out.job_results)


def test_delayed_frees_do_not_depend_on_set_order():
    config = Config(num_gpu_blocks=6, tier_blocks=8)  # every block in use: the free order decides reuse
    worlds = [World(config, cls(config), ListKV(6), Executor(delay=2)) for cls in (SpecConnector, BackwardsReports)]
    for world in worlds:
        for prompt in ([0, 1, 2, 0], [1, 1, 1, 2], [2, 0, 2, 0, 1]):
            world.add_request(prompt, max_tokens=1)  # all finish at step 1 with stores in flight: delayed frees
        for _ in range(4):
            world.step()
        world.add_request([2, 2, 2, 2, 2, 2], max_tokens=2)  # reuses the freed blocks
        world.step()
    assert worlds[0].stats["finished"] == 3
    assert worlds[0].snapshot() == worlds[1].snapshot()


def test_impl_load_that_starts_inside_an_offload_block():
    """Found in k2-immediate-failures: a load whose first offload block is partly on the GPU already (GPU prefix hit
    of 1 block, offload blocks of 2) has fewer GPU blocks than 2 x keys; the production connector mapped copies to
    keys by division and raised IndexError. Fixed: each copy carries the index of its key."""
    from functools import partial

    import torch

    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.spec.kit import make_machine

    from .scenarios import SCENARIOS

    kv = partial(LayeredKV, shape="mla", dtype=torch.float32)
    state = make_machine(OffloadConnector, SCENARIOS["k2-immediate-failures"], "exact", kv)()
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0], 9), ([0, 0, 0], 8),
                              ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 1)])
    state.invariants_hold()
    state.step(n=4)
    state.invariants_hold()
    state.step(n=6)
    state.invariants_hold()
    state.teardown()


class WholePromptHits(SpecConnector):
    """Reports every stored prompt token as a hit, the last one included, as vLLM 0.32's OffloadingConnector may."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.requests[request.req_id] = request
        per = self.config.offload_block_size
        start = num_computed_tokens // per
        hits = self.tier.lookup(offload_keys(request.block_hashes, self.config.k, start, request.num_tokens // per))
        return ((start + hits) * per - num_computed_tokens, True) if hits else (0, False)


def test_a_whole_prompt_hit_recomputes_the_last_token():
    """Found by running vLLM's OffloadingConnector through the kit: it may report a hit of the whole prompt, and
    spec 0.1's LOOKUP (leave one token) failed at once. vLLM's scheduler recomputes the last token instead; the
    world now does the same (spec 0.2), so the load lands, the last block is rewritten with the same bytes, and the
    request samples its next token."""
    config = Config(num_gpu_blocks=8, tier_blocks=8, prefix_caching=False)
    world = World(config, WholePromptHits(config), ListKV(8), Executor(), observable=True)
    world.add_request([0, 1, 2, 0], max_tokens=1)
    for _ in range(3):
        world.step()
    again = world.add_request([0, 1, 2, 0], max_tokens=2)
    scheduled = []
    for _ in range(4):
        scheduled += [s for s in world.step().scheduled if s.req_id == again.req_id]
        world.check()
    assert world.stats["tier_hit_tokens"] == 4 and world.stats["blocks_loaded"] == 2  # the whole prompt came back
    assert (scheduled[0].num_computed_tokens, scheduled[0].num_scheduled_tokens) == (3, 1)  # the last one recomputed
    assert again.num_output_tokens == 2 and not world.requests
    world.drain()


# ---- found while the world learned the GPU engine modes (spec 0.3) -------------------------------------------------
def test_a_request_preempted_then_aborted_still_has_its_stores_flushed():
    """Found in a 2-worker async scenario: a weight update preempted a request with a store in flight and the
    request was aborted before the next step. The world had dropped it from the next step's preempted ids, so no
    worker flushed the store and it read blocks the pool had already handed out (SRC). vLLM reports such a request
    as preempted *and* finished; connectors must accept a preempted id they already forgot."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.spec.kit import make_machine

    from .scenarios import GPU_MODE_SCENARIOS

    scenario = GPU_MODE_SCENARIOS["k1-tp2-delayed-failures-no-prefix-cache"]
    state = make_machine(OffloadConnector, scenario, "exact", LayeredKV)()
    state.add_requests(batch=[([0, 0], 3)])
    state.step(n=1)
    assert any(state.subject.in_flight())  # a store is in flight...
    state.reset_prefix_cache(reset_connector=True)  # ...when the request is preempted
    state.abort(i=0)
    assert "r0" in state.subject.preempted_since_step and "r0" in state.subject.finished_since_step
    state.step(n=1)  # both reported: the workers flush the store before the pool's blocks are written again
    assert all(job.executed for job in state.subject.in_flight())
    state.invariants_hold()
    state.teardown()


def test_async_delivery_hands_over_only_the_tokens_of_the_delivered_step():
    """Found in an async + draft scenario: delivering step N's output made *every* sampled token visible, step
    N+1's too, so placeholders went negative and the request was never scheduled again (PROGRESS)."""
    config = Config(async_scheduling=True, num_spec_tokens=3)
    world = World(config, SpecConnector(config), ListKV(16), Executor(delay=1), observable=True)
    req = world.add_request([0], max_tokens=7)
    for _ in range(12):
        world.step()
        world.check()
        assert req.num_placeholders >= 0 and req.num_tokens <= len(req.tokens)
    assert req.num_output_tokens == 7 and not world.requests
    assert world.stats["rejected_drafts"] > 0


def test_the_cursor_of_a_request_preempted_by_a_weight_update_is_judged_next_step():
    """Found at once when weight updates arrived: they preempt between steps, and the connector hears of the
    preemption in the next step's output, so until then its cursor may pass the request's computed blocks."""
    from kvoffload.spec.kit import make_machine

    state = make_machine(SpecConnector, level="invariants")()
    state.add_requests(batch=[([0, 0], 2)])
    state.step(n=1)
    state.reset_prefix_cache(reset_connector=True)
    state.invariants_hold()
    state.step(n=1)
    state.invariants_hold()
    state.teardown()


def test_liveness_is_only_judged_where_the_engine_cannot_stall_by_itself():
    """Found when PROGRESS (then named LIVENESS) arrived: two waiting requests that each hold loaded blocks, with the
    pool empty, wait for each other forever, in vLLM as in the world (waiting requests are never preempted). That is
    the engine's deadlock, not the connector's: PROGRESS is checked only when the live requests fit the pool."""
    config = Config()
    world = World(config, SpecConnector(config), ListKV(16), Executor(), observable=True)
    long_prompt = [1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    for prompt, max_tokens in [([0], 1), (long_prompt, 4), ([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0], 3), (long_prompt, 4)]:
        world.add_request(prompt, max_tokens)
    assert not world.fits()
    for _ in range(30):
        world.step()
    stuck = [r for r in world.requests.values() if r.blocks and r.state.value == "waiting"]
    assert len(stuck) == 2 and sum(len(r.blocks) for r in stuck) == config.num_gpu_blocks  # the engine's deadlock


def test_a_request_whose_last_token_is_in_flight_at_a_weight_update_samples_it_again():
    """Found by PROGRESS in black-box mode (seed 0 of pr, 'async' scenario) once pr ran several seeds, with every
    connector: under async scheduling a weight update preempted a request whose last sampled token was still in
    flight. The world delivered that token at the preemption, so the request had all its tokens, yet it was queued
    again and, with nothing left to schedule, stayed running forever. Fixed as vLLM does it: a weight update drops
    the in-flight output (``drop_stale_output``) and the request samples that position again; an ordinary
    preemption delivers it, and a request that thereby reaches max_tokens finishes."""
    config = Config(num_gpu_blocks=18, tier_blocks=3, async_scheduling=True)
    world = World(config, SpecConnector(config), ListKV(18), Executor(1), observable=True)
    req = world.add_request([0, 1, 0, 1, 2, 2, 0], max_tokens=2)
    world.step()
    world.step()  # samples the last token: in flight (delivered with the next step)
    assert world.update_weights()
    assert req.num_output_tokens == 1 and len(req.tokens) == 8  # the in-flight token is dropped
    world.run_to_completion()  # PROGRESS
    assert req.state.value == "finished" and req.num_output_tokens == 2
    world.drain()


def test_a_failed_load_behind_a_window_starts_the_request_over():
    """Found by the nightly soak in hybrid-w4-only-delayed-failures (a model whose layers all slide): r6 was admitted
    with a GPU hit of one block and a tier hit up to token 12, so its window's positions 1-3 were the null block;
    its load failed, and the world resumed it from the valid prefix (2 tokens), where the forward pass wrote into
    the null block (BlockIdError). Fixed: a valid prefix that would have the request compute into null blocks
    the hit left in a window's table starts the request over, as a load with no valid prefix does."""
    from kvoffload.spec.kit import make_machine

    state = make_machine(SpecConnector, as_found("hybrid-w4-only-delayed-failures"))()
    state.add_requests(batch=[([0], 1)])
    state.add_requests(batch=[([0, 0, 0, 0, 0, 0, 0, 0], 5), ([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0, 0], 3),
                              ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], 1),
                              ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 1)])
    state.step(n=1)
    state.add_requests(batch=[([0, 0, 0, 0], 1)])
    state.step(n=6)
    state.abort(i=0)
    state.advance_transfers(picks=[(0, False)])
    state.add_requests(batch=[([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 1)])
    state.fail_next_transfer(worker=0)
    state.teardown()  # drains: the failed load lands
    assert state.subject.stats["failed_transfers"]


def test_the_production_connector_stores_every_group_of_a_model_without_windows():
    """Found while adding groups of several block sizes: with several full-attention groups and no window, the
    production scheduler took its one-group fast paths, storing and looking up group 0 only ('events differ' at
    step 1 against the spec). Fixed: the fast paths serve a model of one plain group only."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.spec.groups import Group
    from kvoffload.spec.kit import Scenario, make_machine

    scenario = Scenario(Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(), Group()), prefix_caching=False))
    state = make_machine(OffloadConnector, scenario, "exact", LayeredKV)()
    prompt = [1, 1, 0, 0, 1, 1, 2, 2, 0]
    state.add_requests(batch=[(prompt, 1)])
    state.step(n=3)
    state.add_requests(batch=[(prompt, 1)])
    state.step(n=3)
    state.invariants_hold()
    stats = state.subject.stats
    state.teardown()
    assert stats["blocks_stored"] == 8 and stats["blocks_loaded"] == 4  # 4 blocks of each group; 4 positions


def _hybrid_connectors():
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.reference import ReferenceConnector, TensorKV

    return [(SpecConnector, ListKV), (ReferenceConnector, TensorKV), (OffloadConnector, LayeredKV)]


def _window_flushed_too_late(state):
    """r2's prefill chunks move its window past a block a deferred store still reads; the engine frees the block
    and hands it to r1 in the same step, whose forward pass writes it."""
    state.add_requests(batch=[([0, 1], 6)])
    state.abort(i=0)
    state.add_requests(batch=[([0, 0, 0, 0, 0], 3), ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 1, 1, 2, 1, 1], 1)])
    state.step(n=3)
    state.invariants_hold()


def _freed_at_finish(state):
    """r2 finishes with a store in flight on its blocks: the engine frees them at once (a window's old ones even
    before request_finished), and a later step reuses one for another request."""
    state.add_requests(batch=[([0], 1)])
    state.abort(i=0)
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0, 0], 8), ([0, 0, 0], 6), ([0], 7)])
    state.step(n=2)
    state.step(n=6)
    state.invariants_hold()


@pytest.mark.parametrize("program", [_window_flushed_too_late, _freed_at_finish])
@pytest.mark.parametrize("connector, kv", _hybrid_connectors(), ids=["spec", "reference", "production"])
def test_stores_reading_blocks_a_window_freed_finish_before_the_forward_pass(connector, kv, program):
    """Found when the world began calling the worker hooks in vLLM's order (``tests/vllm/test_call_order.py``):
    vLLM calls ``start_load_kv`` after the forward pass, and all three connectors flushed the stores reading a
    block a sliding window freed there, too late: the pass had already written the block for another request
    (SRC; on a GPU, the store stream reads the new bytes and files them under the old key). Fixed: the flushes
    happen in ``handle_preemptions``, the one hook before the pass. The second program is the same hole at a finish:
    vLLM frees a window's old blocks before ``request_finished`` (and, since spec 0.9, the rest at once too);
    fixed by naming their stores in the next plan's flush (it was found with the free of the rest delayed; this is
    the program the kit shrinks to since). Each program passes on every connector, and fails on each with its
    flushes moved after the forward."""
    from kvoffload.spec.kit import make_machine

    from .faulty import flushes_after_the_forward
    scenario = as_found("hybrid-k2-w5-full-delayed-failures")
    state = make_machine(connector, scenario, "exact", kv)()
    program(state)
    state.teardown()
    old = make_machine(flushes_after_the_forward(connector), scenario, "invariants", kv)()
    with pytest.raises(Violation) as caught:
        program(old)
    assert caught.value.invariant == "SRC" and "written by the forward pass" in str(caught.value)


def test_a_store_of_a_block_freed_at_finish_is_flushed_by_the_next_plan():
    """The finish program against the spec connector without the flush of what it frees at the finish
    (``ForgetsTheWindowAtFinish``): a freed block is reused under the store."""
    from kvoffload.spec.kit import make_machine

    from .faulty import ForgetsTheWindowAtFinish
    state = make_machine(ForgetsTheWindowAtFinish, as_found("hybrid-k2-w5-full-delayed-failures"))()
    with pytest.raises(Violation) as caught:
        _freed_at_finish(state)
    assert caught.value.invariant == "SRC"


@pytest.mark.parametrize("connector", ["spec", "reference", "production"])
def test_requests_sharing_a_prefix_all_wait_for_the_one_get_that_brings_it(connector):
    """Found by the fleet demo: a second engine received many requests over one system prompt at once. The first
    request's get reserved the prompt's records in the tier; every other request's lookup found them not ready,
    settled for a miss and computed the prefix itself, so the get helped nobody. Fixed: a lookup whose hit needs a
    record that a get is bringing asks again until that get ends. Here the world's own prefix cache is off, so each
    request's hit must come through the tier."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.reference import ReferenceConnector, TensorKV
    from kvoffload.spec.store import Store

    make, kv = {"spec": (SpecConnector, ListKV), "reference": (ReferenceConnector, TensorKV),
                "production": (OffloadConnector, LayeredKV)}[connector]
    config, store, prompt = Config(num_gpu_blocks=24, tier_blocks=8, prefix_caching=False), Store(32, delay=1), \
        [0, 1, 2, 0, 1, 1, 2, 0, 2]
    first = World(config, make(config), kv(config.num_gpu_blocks), store=store)
    first.add_request(prompt, 2)
    first.run_to_completion()
    first.drain()
    second = World(config, make(config), kv(config.num_gpu_blocks), store=store)
    for _ in range(3):
        second.add_request(prompt, 2)
    second.run_to_completion()
    assert store.counters["hits"] > 0
    assert second.stats["tier_hit_tokens"] == 3 * 8  # every request: its 4 full prompt blocks
    shared = {key for event in first.events if event.medium == "SHARED" for key in event.keys}
    assert shared == {key for _digest, key in store.records}  # the first engine announced each record it put


@pytest.mark.parametrize("connector", ["spec", "reference", "production"])
def test_the_store_is_asked_only_about_blocks_a_hit_could_load(connector, monkeypatch):
    """A lookup asked the store about every block of the prompt the tier lacked: the blocks the engine's own prefix
    cache held too, and the last one, which no hit loads (one token is always computed). Each key asked costs the
    scheduler thread and renews a record's lease for nothing. Now it asks only about the blocks past the GPU's hit,
    up to the last whole block before the last token. The tier here holds 2 blocks, so the first request's early
    blocks are on the GPU only."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.reference import ReferenceConnector, TensorKV
    from kvoffload.spec.store import Store, StoreView

    asked: list[list[int]] = []
    ask = StoreView.ask
    monkeypatch.setattr(StoreView, "ask", lambda view, keys: asked.append(list(keys)) or ask(view, keys))
    make, kv = {"spec": (SpecConnector, ListKV), "reference": (ReferenceConnector, TensorKV),
                "production": (OffloadConnector, LayeredKV)}[connector]
    config, prompt = Config(num_gpu_blocks=24, tier_blocks=2), [0, 1, 2, 0, 1, 1, 2, 0]
    world = World(config, make(config), kv(config.num_gpu_blocks), store=Store(32))
    first = world.add_request(prompt, 1)
    world.run_to_completion()
    world.drain()
    second = world.add_request(prompt + [2, 2, 1, 1, 0], 1)  # 6 whole blocks, and a token
    world.run_to_completion()
    assert asked == [first.block_hashes[:3], second.block_hashes[4:6]]  # the GPU holds 4 blocks of the second


def test_an_engine_updated_twice_computes_other_kv_than_one_updated_once():
    """The world numbered an update that names no weights -1, -2, ...; CPython hashes -1 as -2, so an engine
    updated once and one updated twice computed the same KV under other namespaces: a connector serving one's
    records to the other passed CONTENT. Default weights now count up from 1."""
    config = Config(num_gpu_blocks=8)
    once, twice = (World(config, SpecConnector(config), ListKV(8), Executor()) for _ in range(2))
    for world, updates in ((once, 1), (twice, 2)):
        for _ in range(updates):
            assert world.update_weights()
    assert once.namespace(0) != twice.namespace(0)
    assert {once.kv_of(h) for h in range(64)}.isdisjoint(twice.kv_of(h) for h in range(64))


@pytest.mark.parametrize("connector", ["spec", "reference", "production"])
def test_a_damaged_record_costs_only_the_blocks_from_it_on(connector):
    """Found by a user (issue 38): with 8 of 96 records damaged, no block was served. A get lands all of its
    records or none, so one damaged record failed the whole hit. Fixed: a failed get asks the store once more; the
    store quarantined the damaged record, so the hit ends before it and the blocks checked before it load."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.reference import ReferenceConnector, TensorKV
    from kvoffload.spec.store import Store

    make, kv = {"spec": (SpecConnector, ListKV), "reference": (ReferenceConnector, TensorKV),
                "production": (OffloadConnector, LayeredKV)}[connector]
    config, store, prompt = Config(num_gpu_blocks=24, tier_blocks=8, prefix_caching=False), Store(32), \
        [0, 1, 2, 0, 1, 1, 2, 0, 2, 2, 1, 0, 1]  # 6 whole blocks, and a token
    first = World(config, make(config), kv(config.num_gpu_blocks), store=store)
    first.add_request(prompt, 1)
    first.run_to_completion()
    first.drain()
    assert len(store.records) == 6
    store.damage(0, torn=False, keys=frozenset({first.history["r0"].block_hashes[3]}))  # the fourth block's
    second = World(config, make(config), kv(config.num_gpu_blocks), store=store)
    second.add_request(prompt, 1)
    second.run_to_completion()
    assert store.counters["quarantined_checksum"] == 1
    assert second.stats["tier_hit_tokens"] == 3 * 2  # the three blocks before the damaged one


def test_a_get_that_fails_after_its_request_finished_asks_nothing_shrunk_program():
    """Found by Hypothesis in fleet2-hybrid-w4-full-delayed (exact level) when failed gets started asking again: a
    request finished while its get was in flight, the get then failed on a torn record, and production asked the
    store again for the finished request (its state still held the lookup), so the store's records were touched in
    another order than the spec's ('store records differ'). Fixed: a finish drops the request's lookup."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.spec.kit import make_machine

    from .scenarios import FLEET_SCENARIOS
    from .test_equivalence import LAYOUTS

    state = make_machine(OffloadConnector, FLEET_SCENARIOS["fleet2-hybrid-w4-full-delayed"], "exact", LAYOUTS[3])()
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0, 0, 0], 8)])
    state.step(n=4)
    state.step(n=6)
    state.damage_record(how="torn", i=1)
    state.add_requests(batch=[([0], 1), ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 4), ([0, 1, 0, 1, 2, 2, 0], 1)])
    state.step(n=2)
    state.step(n=1)
    state.invariants_hold()
    state.teardown()


@pytest.mark.parametrize("connector", ["reference", "impl"])
def test_a_speculative_block_moved_to_the_end_of_a_state_table_is_not_stored_where_it_was_shrunk_program(connector):
    """Found by Hypothesis in hybrid-state-full-spec2-delayed-failures (both connectors, SRC: 'reads GPU block 5 for
    position 1, but the block holds other bytes'): with speculative decoding a state group holds two speculative
    blocks after the running one; the next prefill chunk passed them, and vLLM moved the first to the end of the
    table, the null block in its place. Both connectors append a step's new blocks to their copy of the table, kept
    the moved block at its old place too, and stored it there as the state at the end of a block it never held.
    Fixed: a block given again left its old place (there the engine holds the null block)."""
    from kvoffload.impl import OffloadConnector
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.reference import ReferenceConnector, TensorKV
    from kvoffload.spec.kit import make_machine

    make, kv = (ReferenceConnector, TensorKV) if connector == "reference" else (OffloadConnector, LayeredKV)
    state = make_machine(make, as_found("hybrid-state-full-spec2-delayed-failures"), "exact", kv)()
    state.add_requests(batch=[([0], 1), ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 1)])
    state.step(n=3)
    state.invariants_hold()
    state.teardown()
    assert state.subject.stats["blocks_stored"]


def test_a_synchronous_hit_after_a_local_one_computes_from_the_end_of_both():
    """Found by the first synchronous-load scenario while the world's admission was rewritten for it: a loop
    variable shadowed the hit's end, and a request that hit the GPU prefix cache and then the tier was scheduled
    from token 0 instead of from the end of both hits (CONTENT: it read blocks it then rewrote)."""
    config = Config(num_gpu_blocks=16, tier_blocks=8, token_budget=16, load_failure_policy="fail", sync_loads=True)
    world = World(config, SpecConnector(config), ListKV(16), Executor(0))
    world.add_request(list(range(9)), max_tokens=1)  # stores blocks 0-3
    world.run_to_completion()
    world.reset_prefix_cache()
    world.add_request(list(range(5)), max_tokens=1)  # recomputes blocks 0-1: the GPU prefix cache holds them again
    world.run_to_completion()
    req = world.add_request(list(range(9)), max_tokens=1)
    (scheduled,) = world.step().scheduled
    assert scheduled.num_computed_tokens == 8 and world.stats["sync_loads"] == 2
    assert world.stats["engine_hit_blocks"] >= 2 and req.num_final_tokens >= 8
