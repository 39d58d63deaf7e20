"""The demo's figures are consistent: computed tokens come from vLLM's prompt-token sources, the saving is
without minus with, throughput is bytes over copy seconds, and the verdict fails when the outputs differ or
nothing was saved. Pure functions: no engine is started."""

from __future__ import annotations

from kvoffload.impl.testing.demo import Run, copy_rate, counters_since, render, summarize

STATS = {"lookups": 87, "hit_tokens": 2560, "stored_blocks": 26, "loaded_blocks": 80, "alloc_failures": 0,
         "bytes_stored": 2e9, "bytes_loaded": 1e9, "store_seconds": 0.5, "load_seconds": 2.0,
         "shadow": "ok: 74 steps, 1905 checks, no divergence"}


def run(computed: int, gpu: int, tier: int, outputs=((1, 2),), seconds=(0.2, 0.1)) -> Run:
    return Run([list(o) for o in outputs],
               {"local_compute": computed, "local_cache_hit": gpu, "external_kv_transfer": tier}, list(seconds))


def test_saving_is_computed_without_minus_with():
    summary = summarize(run(3150, 9984, 0), run(1614, 8960, 2560), STATS, prompt_tokens=13134)
    rows = {name.strip(): (a, b) for name, a, b in summary.engine}
    assert rows["computed by the engine"] == ("3150", "1614")
    assert rows["from the CPU tier (connector)"] == ("0", "2560")
    assert rows["engine seconds (generate calls)"] == ("0.30", "0.30") and rows["fastest round"] == ("0.10", "0.10")
    assert summary.ok and summary.verdict == ("outputs identical with and without: yes; "
                                              "prompt tokens saved: 1536 of 3150 (49%)")
    text = render(summary, "title")
    assert text.endswith(summary.verdict) and "2560" in text


def test_throughput_is_over_copy_seconds():
    assert copy_rate(2e9, 0.5).endswith("4.00 GB/s") and "500.0 ms of copying" in copy_rate(2e9, 0.5)
    assert copy_rate(0, 0) == "0.0 MiB"
    connector = dict(summarize(run(10, 0, 0), run(5, 0, 5), STATS, prompt_tokens=10).connector)
    assert connector["stored"].endswith("4.00 GB/s") and connector["loaded"].endswith("0.50 GB/s")


def test_verdict_fails_when_outputs_differ_nothing_saved_or_sources_do_not_add_up():
    assert not summarize(run(10, 0, 0), run(5, 0, 5, outputs=((9,),)), STATS, 10).ok
    nothing = summarize(run(10, 0, 0), run(10, 0, 0), STATS, 10)
    assert not nothing.ok and "saved: 0 of 10" in nothing.verdict
    off = summarize(run(10, 0, 0), run(5, 0, 4), STATS, 10)
    assert not off.ok and "do not add up" in off.verdict
    assert not summarize(run(10, 0, 0), run(5, 0, 5), {**STATS, "shadow": "DIVERGED"}, 10).ok


def test_counters_cover_the_workload_only():
    before = {"lookups": 3, "store_seconds": 0.25, "shadow": "ok: 1 step"}
    after = {"lookups": 10, "store_seconds": 1.0, "shadow": "ok: 9 steps"}
    assert counters_since(before, after) == {"lookups": 7, "store_seconds": 0.75, "shadow": "ok: 9 steps"}
