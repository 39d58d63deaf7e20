"""The weights digest (kvoffload.impl.vllm.identity): the host strategy (xxh3-128 of the bytes) and the accelerator's
(the fold), both run here on CPU tensors, tell apart exactly the same weights, and see every change a fine-tune or
an update in place makes, wherever in a tensor it lands."""

from __future__ import annotations

import pytest
import torch

from kvoffload.impl.vllm.identity import ROW, weights_digest


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.Linear(160, 96, dtype=torch.bfloat16))
    layers.register_buffer("rotary", torch.linspace(0, 1, 3 * ROW + 5))  # a table the configuration computes
    return layers


def middle(m):
    m[0].weight.data[80, 48] += 1e-3


def sign_bits_of_two_words_in_one_row(m):  # two top bits that cancel in a plain weighted sum modulo 2**64
    raw = m.rotary.data.view(torch.uint8)  # little-endian: byte 8i + 7 holds the top bit of word i
    raw[10 * 8 + 7] ^= 0x80
    raw[11 * 8 + 7] ^= 0x80


def swap(m):
    w = m[1].weight.data
    w[3, 4], w[4, 3] = w[4, 3].clone(), w[3, 4].clone()


def last_byte_of_an_odd_sized_tensor(m):
    m[1].bias.data[-1] = -m[1].bias.data[-1]


def buffer(m):
    m.rotary.data[2 * ROW + 1] += 1.0


def reshaped(m):
    m[0].weight.data = m[0].weight.data.reshape(48, 320)


def renamed(m):
    m.register_buffer("rotary2", m._buffers.pop("rotary"))


CHANGES = [middle, sign_bits_of_two_words_in_one_row, swap, last_byte_of_an_odd_sized_tensor, buffer, reshaped,
           renamed]


@pytest.mark.parametrize("strategy", ["hash", "fold"])
def test_the_same_weights_give_the_same_digest(strategy):
    assert weights_digest(model(), strategy) == weights_digest(model(), strategy)


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_both_strategies_see_every_change(change):
    before = {s: weights_digest(model(), s) for s in ("hash", "fold")}
    changed = model()
    change(changed)
    after = {s: weights_digest(changed, s) for s in ("hash", "fold")}
    assert after["hash"] != before["hash"] and after["fold"] != before["fold"]


def test_a_weight_update_in_place_and_back_returns_the_digest():
    m = model()
    start = weights_digest(m)
    saved = m[0].weight.data.clone()
    m[0].weight.data.normal_()
    assert weights_digest(m) != start
    m[0].weight.data.copy_(saved)
    assert weights_digest(m) == start


def test_an_adapter_rewritten_in_place_gets_another_salt_whatever_its_times(tmp_path):
    """A LoRA adapter retrained to the same directory, one byte changed and its size and mtime kept: its salt
    changes (the cache is kept by ctime too, which nothing sets back). The same bytes elsewhere salt alike."""
    import os
    import shutil

    from kvoffload.impl.vllm.identity import adapter_salt

    adapter = tmp_path / "a"
    adapter.mkdir()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(bytes(range(256)) * 64)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    first = adapter_salt(str(adapter))
    assert len(first) == 16 and adapter_salt(str(shutil.copytree(adapter, tmp_path / "copy"))) == first
    times = weights.stat()
    data = bytearray(weights.read_bytes())
    data[9000] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert adapter_salt(str(adapter)) not in (first, b"")
    assert adapter_salt(str(tmp_path / "missing")) == b""
