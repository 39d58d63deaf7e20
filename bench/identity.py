"""What fingerprinting the weights an engine holds costs (kvoffload.impl.vllm.identity), against loading the same
weights from a safetensors file in the page cache (what vLLM's start-up does), in one process, side by side.

    .venv/bin/python bench/identity.py [--gib 1] [--quick]

Prints GB/s of the load, of the host digest (xxh3-128 of each tensor's bytes, what a CPU engine runs) and of the
fold (the accelerator's strategy, run here on host tensors), each repeated and the median taken. Last line:
``identity_vs_load=…`` (host digest seconds / load seconds; goal: well under 1, so that start-up and every reset
stay close to vLLM's own) and ``fold_vs_load=…``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvoffload.impl.vllm.identity import weights_digest


def model_of(gib: float) -> torch.nn.Module:
    """Linear layers of 4096 x 4096 bf16 (32 MiB each) adding up to ``gib``, as a checkpoint's tensors are."""
    layers = max(1, round(gib * 1024 / 32))
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16) for _ in range(layers)))
    for p in model.parameters():
        p.data.normal_()
    return model


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the weights")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny size, once (CI: the bench still runs)")
    args = parser.parse_args()
    gib, repeats = (1 / 32, 1) if args.quick else (args.gib, args.repeats)
    model = model_of(gib)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(model.state_dict(), path)
        params = dict(model.named_parameters())

        def load() -> None:  # as vLLM's loader does: each tensor read from the file into its parameter
            with torch.no_grad():
                for name, tensor in load_file(path).items():
                    params[name].copy_(tensor)
        load()  # the file into the page cache
        load_seconds = median_seconds(load, repeats)
    digest = median_seconds(lambda: weights_digest(model), repeats)
    fold_model = torch.nn.Sequential(*list(model.children())[:1])  # the fold is slow on a CPU: one layer stands for all
    fold_bytes = sum(p.numel() * p.element_size() for p in fold_model.parameters())
    fold = median_seconds(lambda: weights_digest(fold_model, strategy="fold"), repeats) * nbytes / fold_bytes
    for name, seconds in (("load (safetensors, page cache)", load_seconds), ("digest (host, xxh3-128)", digest),
                          ("fold (accelerator strategy, on this CPU)", fold)):
        print(f"{name:42s} {nbytes / seconds / 1e9:7.2f} GB/s  {seconds / nbytes * 1e9:7.3f} s/GB")
    print(f"identity_vs_load={digest / load_seconds:.3f} fold_vs_load={fold / load_seconds:.3f}")


if __name__ == "__main__":
    main()
