"""Demo: a prefix-heavy workload through a real vLLM engine (CPU) with the offloading connector.

Builds a tiny random-weight Llama (no downloads), runs the workload once without the connector and once with it —
resetting the engine's own prefix cache between rounds, so shared prefixes must come back from our CPU tier — and
prints what moved and whether the outputs are identical. Run: ``python -m kvoffload.impl.testing.demo``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: we read its connector
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the demo's own progress and table, not the engine's log

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32


def build_tiny_llama(path: Path) -> Path:
    """A 2-layer random Llama saved with ``save_pretrained`` (vocabulary 512): loads with ``skip_tokenizer_init``."""
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        scratch = path.with_name(f"{path.name}.{os.getpid()}")  # parallel test workers may build it at once
        LlamaForCausalLM(config).save_pretrained(scratch)
        try:
            scratch.rename(path)
        except OSError:  # another process finished first: its model is the same
            shutil.rmtree(scratch)
    return path


def connector_config(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                            kv_connector_module_path="kvoffload.impl.vllm_connector",
                            kv_connector_extra_config=extra,
                            kv_load_failure_policy="recompute")  # a failed load is recomputed, not an error


def make_llm(model: Path, kv_transfer_config=None, num_gpu_blocks: int = 48):
    from vllm import LLM

    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=1024,
               num_gpu_blocks_override=num_gpu_blocks, enable_prefix_caching=True, dtype="float32",
               gpu_memory_utilization=0.1, kv_transfer_config=kv_transfer_config, seed=0)


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def workload(requests: int, seed: int) -> list[list[int]]:
    """Requests over a few long shared system prompts (several blocks each) plus a short private tail."""
    rnd = random.Random(seed)
    systems = [[rnd.randrange(512) for _ in range(rnd.randrange(4, 8) * BLOCK_SIZE)] for _ in range(4)]
    return [rnd.choice(systems) + [rnd.randrange(512) for _ in range(rnd.randrange(1, 24))] for _ in range(requests)]


def run_rounds(llm, prompts: list[list[int]], rounds: int, max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs = []
    for r in range(rounds):
        print(f"  round {r + 1}/{rounds}: {len(prompts)} requests", file=sys.stderr, flush=True)
        done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in done]
        llm.reset_prefix_cache()  # the next round's shared prefixes must come from the tier
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--tier-mib", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, default=Path(".cache/tiny-llama"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print("building the tiny model and the engine without the connector...", file=sys.stderr, flush=True)
    model = build_tiny_llama(args.model_dir)
    prompts = workload(args.requests, seed=0)
    llm = make_llm(model)
    expected = run_rounds(llm, prompts, args.rounds, args.max_tokens)
    del llm
    gc.collect()
    print("the same workload with the offloading connector...", file=sys.stderr, flush=True)
    llm = make_llm(model, connector_config(tier_bytes=args.tier_mib << 20, offload_block_size=BLOCK_SIZE,
                                           verify=True))  # the spec checks every step beside the connector
    timed = time.perf_counter()
    got = run_rounds(llm, prompts, args.rounds, args.max_tokens)
    seconds = time.perf_counter() - timed
    stats = scheduler_connector(llm).stats()
    block_bytes = stats["bytes_stored"] / max(stats["stored_blocks"], 1)

    def rate(moved: float, spent: float) -> str:
        return f"{moved / 2**20:.1f} MiB at {moved / spent / 1e9:.2f} GB/s" if spent else "0 MiB"

    rows = [
        ("requests", f"{args.requests} x {args.rounds} rounds"),
        ("tier lookups", stats["lookups"]),
        ("engine prefix-cache hits (tokens)", stats["engine_hit_tokens"]),
        ("tier hits (tokens)", stats["hit_tokens"]),
        ("blocks stored / loaded", f"{stats['stored_blocks']} / {stats['loaded_blocks']}"),
        ("bytes stored", rate(stats["bytes_stored"], stats["store_seconds"])),
        ("bytes loaded", rate(stats["bytes_loaded"], stats["load_seconds"])),
        ("block size", f"{block_bytes / 1024:.0f} KiB" if stats["stored_blocks"] else "-"),
        ("store allocation failures", stats["alloc_failures"]),
        ("shadow spec monitor", stats["shadow"]),
        ("engine seconds with connector", f"{seconds:.1f}"),
        ("outputs identical", "yes" if got == expected else "NO"),
        ("total seconds", f"{time.perf_counter() - start:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nkvoffload demo — vLLM (CPU) with the offloading connector")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0 if got == expected and stats["hit_tokens"] > 0 and stats["shadow"].startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
