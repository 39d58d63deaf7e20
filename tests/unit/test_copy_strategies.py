"""Every copy strategy, forced on CPU tensors, moves exactly the bytes a plain row-by-row copy moves: in every KV
layout, for 2- 4- and 1-byte dtypes, in both directions, for runs, scattered ids, reversed ids and single blocks;
and a Mamba layer's state, which fills part of each padded page, as vLLM lays it out on GPUs and on its CPU build."""

import resource

import numpy as np
import pytest
import torch

from kvoffload.impl.testing import SHAPES, LayeredKV
from kvoffload.impl.transfer import STRATEGIES, Copier, HostPool, block_views
from kvoffload.spec.config import ConfigError

NUM_BLOCKS, ROWS = 12, 8
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
PATTERNS = {  # (GPU block ids, host rows), read as store: blocks -> rows and load: rows -> blocks
    "one_run": ([3, 4, 5, 6], [2, 3, 4, 5]),
    "scattered": ([9, 0, 5, 2], [6, 1, 3, 0]),
    "scattered_blocks_to_run": ([10, 1, 6, 3], [2, 3, 4, 5]),
    "run_to_scattered_rows": ([4, 5, 6, 7], [7, 0, 5, 2]),
    "runs_and_gaps": ([1, 2, 3, 9, 10], [4, 5, 6, 0, 1]),
    "single_block": ([5], [3]),
    "reversed": ([7, 6, 5, 4], [0, 1, 2, 3]),
}
CLOSURES = {"runs": {"copy_runs"}, "indexed": {"gather", "scatter"}, "staged": {"staged"}}


def filled_kv(shape: str, dtype: torch.dtype) -> LayeredKV:
    kv = LayeredKV(NUM_BLOCKS, shape=shape, dtype=dtype)
    for block in range(NUM_BLOCKS):
        kv.write(block, 1000 + block)
    return kv


def filled_pool(views: list[torch.Tensor]) -> HostPool:
    """A host pool whose every byte is known (and differs from any block's content) instead of uninitialised."""
    pool = HostPool(views, ROWS)
    pool.buffer.copy_(torch.arange(pool.buffer.numel()) * 7 % 251)
    return pool


def plain_store(views, regions, blocks, rows) -> None:
    for view, region in zip(views, regions):
        for block, row in zip(blocks, rows):
            region[row] = view[block]


def plain_load(views, regions, blocks, rows) -> None:
    for view, region in zip(views, regions):
        for block, row in zip(blocks, rows):
            view[block] = region[row]


def cache_bytes(kv: LayeredKV) -> list[torch.Tensor]:
    return [cache.view(torch.uint8).clone() for cache in kv.caches.values()]


def planned(copier: Copier, kind: str, blocks: list[int], rows: list[int]):
    run = copier.plan(kind, np.asarray(blocks, dtype=np.int64), np.asarray(rows, dtype=np.int64))
    assert run.__name__ in CLOSURES[copier.strategy]  # the forced strategy is the one that runs
    return run


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_store_matches_a_plain_copy(shape, dtype, pattern, strategy):
    blocks, rows = PATTERNS[pattern]
    kv = filled_kv(shape, DTYPES[dtype])
    pool, expected = filled_pool(kv.views), filled_pool(kv.views)
    plain_store(kv.views, expected.regions, blocks, rows)
    assert not torch.equal(expected.buffer, pool.buffer)  # the check below can fail
    before = cache_bytes(kv)
    planned(Copier(kv.views, pool, strategy), "store", blocks, rows)()
    assert torch.equal(pool.buffer, expected.buffer)
    assert all(torch.equal(a, b) for a, b in zip(cache_bytes(kv), before))  # a store never writes the caches


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_load_matches_a_plain_copy(shape, dtype, pattern, strategy):
    blocks, rows = PATTERNS[pattern]
    kv, expected = filled_kv(shape, DTYPES[dtype]), filled_kv(shape, DTYPES[dtype])
    pool = filled_pool(kv.views)
    plain_load(expected.views, pool.regions, blocks, rows)
    untouched, host = cache_bytes(kv), pool.buffer.clone()
    assert not all(torch.equal(a, b) for a, b in zip(cache_bytes(expected), untouched))  # the check below can fail
    planned(Copier(kv.views, pool, strategy), "load", blocks, rows)()
    assert all(torch.equal(a, b) for a, b in zip(cache_bytes(kv), cache_bytes(expected)))
    assert torch.equal(pool.buffer, host)  # a load never writes the host pool


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("head_dim", "dtype", "word"), [(3, "fp8", torch.uint8), (3, "bf16", torch.int16),
                                                         (1, "fp32", torch.int32), (4, "bf16", torch.int64)])
def test_rows_of_any_width_move_as_the_widest_word_that_divides_them(head_dim, dtype, word, strategy):
    """Copies move rows as 8-, 4-, 2- or 1-byte words, whichever divides every row (a 3-byte row: bytes)."""
    kv = LayeredKV(NUM_BLOCKS, "mla", block_size=1, heads=1, head_dim=head_dim, dtype=DTYPES[dtype])
    for block in range(NUM_BLOCKS):
        kv.write(block, 1000 + block)
    pool, expected = filled_pool(kv.views), filled_pool(kv.views)
    copier = Copier(kv.views, pool, strategy)
    assert {v.dtype for v in copier.views + copier.regions} == {word}
    blocks, rows = PATTERNS["scattered"]
    plain_store(kv.views, expected.regions, blocks, rows)
    planned(copier, "store", blocks, rows)()
    assert torch.equal(pool.buffer, expected.buffer)
    for block in blocks:
        kv.write(block, 0)  # overwritten: the load below must bring each block's bytes back
    planned(copier, "load", blocks, rows)()
    assert all(kv.holds(block, 1000 + block) for block in blocks)


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_a_staged_transfer_larger_than_its_staging_buffer_goes_in_chunks(blocks_per_chunk, pattern):
    kv = filled_kv("kv_first", torch.bfloat16)
    pool, expected = filled_pool(kv.views), filled_pool(kv.views)
    copier = Copier(kv.views, pool, "staged")
    copier.staging_bytes = blocks_per_chunk * kv.views[0][0].nbytes
    blocks, rows = PATTERNS[pattern]
    plain_store(kv.views, expected.regions, blocks, rows)
    planned(copier, "store", blocks, rows)()
    assert torch.equal(pool.buffer, expected.buffer)
    targets = [(block + 1) % NUM_BLOCKS for block in blocks]  # the rows, back into other blocks
    want = [view.clone() for view in kv.views]
    plain_load(want, pool.regions, targets, rows)
    planned(copier, "load", targets, rows)()
    assert all(torch.equal(view, w) for view, w in zip(kv.views, want))


def test_automatic_choice_on_cpu_is_per_run_copies_for_large_runs_else_indexed():
    kv = filled_kv("kv_first", torch.bfloat16)
    copier = Copier(kv.views, filled_pool(kv.views))
    fragment = copier.pool.row_bytes // len(kv.views)
    copier.large_run = 4 * fragment
    assert copier.choose(num_blocks=8, num_runs=2) == "runs"
    assert copier.choose(num_blocks=8, num_runs=3) == "indexed"
    copier.large_run = 16 * 1024
    assert copier.plan("store", np.array([0, 5]), np.array([0, 1])).__name__ == "gather"


def test_unknown_strategy_is_a_config_error_naming_the_known_ones():
    kv = filled_kv("mla", torch.bfloat16)
    with pytest.raises(ConfigError, match="'dma'.*runs, indexed, staged"):
        Copier(kv.views, filled_pool(kv.views), strategy="dma")


PAGE = 256  # bytes of one block's page, as vLLM pads a state page to the attention page


def state_caches(layout: str, device: str = "cpu") -> tuple[dict, torch.Tensor]:
    """A Mamba layer's KV cache as vLLM hands it to a connector, over one raw allocation of padded pages, and that
    allocation: on GPUs its conv and SSM state tensors (``gpu``), on the CPU build one int8 tensor (``cpu``), and in
    a hybrid model beside an attention layer whose pages are the same bytes (``hybrid``). ``tests/gpu`` builds the
    same on CUDA."""
    raw = torch.randint(0, 256, (NUM_BLOCKS * PAGE,), dtype=torch.uint8, device=device)
    words = raw.view(torch.float32)
    conv = torch.as_strided(words, (NUM_BLOCKS, 3, 4), (PAGE // 4, 4, 1))  # 48 bytes at the page's start
    ssm = torch.as_strided(words, (NUM_BLOCKS, 2, 8), (PAGE // 4, 8, 1), 12)  # 64 bytes after it
    cpu = torch.as_strided(raw.view(torch.int8), (NUM_BLOCKS, 1, 1, 112), (PAGE, 112, 112, 1))
    attention = raw.view(torch.bfloat16).view(NUM_BLOCKS, 2, 32, 2)
    return {"gpu": {"layers.0.mixer": [conv, ssm]}, "cpu": {"layers.0.linear_attn": cpu},
            "hybrid": {"layers.0.linear_attn": [conv, ssm], "layers.1.self_attn": attention}}[layout], raw


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout, widths", [("gpu", [48, 64]), ("cpu", [112]), ("hybrid", [PAGE])])
def test_state_pages_move_their_state_bytes_and_leave_the_padding(layout, widths, strategy):
    """A state tensor that fills part of each padded page is a strided region of its own bytes (dropped when an
    attention layer's region holds the whole page); stores and loads move exactly what a plain copy moves, and a
    load never writes the padding."""
    caches, raw = state_caches(layout)
    views = block_views(caches, "blocks_first")
    assert [v.shape[1] for v in views] == widths
    blocks, rows = PATTERNS["runs_and_gaps"]
    pool, expected = filled_pool(views), filled_pool(views)
    plain_store(views, expected.regions, blocks, rows)
    planned(Copier(views, pool, strategy), "store", blocks, rows)()
    assert torch.equal(pool.buffer, expected.buffer)
    pages = raw.view(NUM_BLOCKS, PAGE)
    padding = pages[:, sum(widths):].clone()
    blocks, rows = PATTERNS["scattered"]  # the rows, back into other blocks
    want = [view.clone() for view in views]
    plain_load(want, pool.regions, blocks, rows)
    assert not all(torch.equal(view, w) for view, w in zip(views, want))  # the check below can fail
    planned(Copier(views, pool, strategy), "load", blocks, rows)()
    assert all(torch.equal(view, w) for view, w in zip(views, want))
    assert torch.equal(pages[:, sum(widths):], padding)  # the padding of every page is as it was


def test_a_host_pool_on_the_cpu_is_resident_before_its_first_store():
    """Else its pages fault in one by one inside the step that first stores into them, or the I/O thread that gets a
    shared hit into them (pinned memory, on a GPU host, is resident at once)."""
    views = [torch.empty(1, width, dtype=torch.uint8) for width in (4096, 12288)]
    pool = HostPool(views, 4096)  # 64 MiB: 16,384 pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    pool.buffer.fill_(7)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1_000


@pytest.mark.parametrize("kind", ["store", "load"])
def test_blocks_and_rows_that_descend_together_move_as_one_run(kind, monkeypatch):
    """A request's blocks descend through its tokens, and so do the rows the tier gave them: one span of host rows,
    so one DMA per view on CUDA (the staging path, forced here on CPU tensors), not one per block."""
    blocks, rows = [9, 8, 7, 6, 5], [4, 3, 2, 1, 0]
    kv, expected_kv = filled_kv("kv_first", torch.bfloat16), filled_kv("kv_first", torch.bfloat16)
    pool, expected_pool = filled_pool(kv.views), filled_pool(kv.views)
    if kind == "store":
        plain_store(expected_kv.views, expected_pool.regions, blocks, rows)
    else:
        plain_load(expected_kv.views, expected_pool.regions, blocks, rows)
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, **kw: copies.append(len(src)) or copy(self, src, **kw))
    planned(Copier(kv.views, pool, "staged"), kind, blocks, rows)()
    monkeypatch.undo()
    assert copies == [len(blocks)] * len(kv.views)
    assert torch.equal(pool.buffer, expected_pool.buffer)
    assert all(torch.equal(a, b) for a, b in zip(cache_bytes(kv), cache_bytes(expected_kv)))
