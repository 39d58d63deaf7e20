"""Time to first token on vLLM's CPU engine, one request at a time, on documents long enough that prefill costs time
(a random Llama of 8 layers, hidden 512): what a user of the connector gains.

Each way runs in a fresh engine process (``serve``), the same documents and questions each time:

  * ``none``: no connector. A document with its first question, cold (**recompute**), then with a second question
    (the engine's own **GPU prefix-cache hit**: the limit a tier can approach).
  * ``tier``: our connector with a CPU tier only. The document with a third question, cold (recompute with the
    connector, which stores it); the engine's prefix cache reset (checked); then the first question (a **CPU-tier
    hit**).
  * ``writer``: our connector with a CPU tier and a shared tier in a directory: the document with a third question,
    cold (recompute while storing it into both, the records fsynced into the directory).
  * ``shared``: a new engine on the writer's directory, its CPU tier empty: the first question (a **shared-tier
    hit**: records got from the directory into the CPU tier, then loaded).
  * ``redis_writer`` and ``redis``: the same two, the shared tier on a Redis server instead of a directory (a
    **Redis hit**).

Every hit's first token is compared with recompute's for the same prompt. Time to first token is the wall time of
a ``generate`` call with ``max_tokens=1``: what the caller waits for, the engine's extra steps included.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .demo import BLOCK_SIZE, connector_config, drain, make_llm, reset_prefix_cache, save_once, scheduler_connector

PREFILL_LLAMA: dict[str, Any] = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
QUESTION = 17  # tokens after the document: never a whole block, so the document is the part a cache can serve
WAYS = ("none", "tier", "writer", "shared")
REDIS_WAYS = ("redis_writer", "redis")
SHARED_KIND = {"shared": "shared_tier", "redis": "redis_tier"}  # a way that reads a shared tier: what its hit is


def build_prefill_llama(path: Path) -> Path:
    """The random Llama whose prefill costs time on a CPU (head_dim 64, 2 KV heads, fp32: 8 KiB of KV per token)."""
    def llama() -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**PREFILL_LLAMA))
    return save_once(path, llama)


def documents(lengths: list[int], docs: int, seed: int) -> dict[int, list[list[int]]]:
    rnd = random.Random(seed)
    return {n: [[rnd.randrange(PREFILL_LLAMA["vocab_size"]) for _ in range(n)] for _ in range(docs)] for n in lengths}


def question(doc: int, which: int) -> list[int]:
    rnd = random.Random(doc * 1000 + which)
    return [rnd.randrange(PREFILL_LLAMA["vocab_size"]) for _ in range(QUESTION)]


def first_token(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the first (and only) token of ``prompt``, and that token."""
    from vllm import SamplingParams

    started = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - started, done[0].outputs[0].token_ids[0]


def serve(way: str, model: Path, lengths: list[int], docs: int, shared_tier: dict[str, Any] | None) -> dict[str, Any]:
    """One way, in this process: for each length, a warm-up document, then ``docs`` measured ones. A writer's and a
    reader's connector has ``shared_tier`` too (the CPU tier's stores are put into it)."""
    max_len = max(lengths) + QUESTION + BLOCK_SIZE
    blocks = 2 * (max_len // BLOCK_SIZE) + 16  # two documents' blocks: the GPU prefix cache holds the last one
    connector = None
    if way != "none":
        shared = {"shared_tier": shared_tier} if way not in ("none", "tier") else {}
        connector = connector_config(tier_bytes=4 << 30, offload_block_size=BLOCK_SIZE, **shared)
    llm = make_llm(model, connector, num_gpu_blocks=blocks, max_model_len=max_len, memory_share=0.4)
    texts = documents(lengths, docs + 1, seed=0)  # the first of each length warms up
    figures: dict[str, Any] = {"seconds": {}, "tokens": {}, "reset_steps": []}
    for n in lengths:
        print(f"  {way}: {n}-token documents", file=sys.stderr, flush=True)
        for d, doc in enumerate(texts[n]):
            for kind, (seconds, token) in _ask(way, llm, n * 100 + d, doc, figures["reset_steps"]).items():
                if d:  # not the warm-up
                    figures["seconds"].setdefault(f"{kind}/{n}", []).append(seconds)
                    figures["tokens"][f"{kind}/{n}/{d}"] = token
    if way.endswith("writer"):
        drain(llm)
    if connector is not None:
        stats = scheduler_connector(llm).stats()
        figures["stats"] = {k: stats[k] for k in ("hit_tokens", "loaded_blocks", "shared_got_blocks", "shared_hits",
                                                  "shared_stored", "shared_quarantined") if k in stats}
    return figures


def _ask(way: str, llm: Any, doc_id: int, doc: list[int], resets: list[int]) -> dict[str, tuple[float, int]]:
    """One document's measured requests, by what serves its prefix."""
    if way == "none":
        recompute = first_token(llm, doc + question(doc_id, 1))
        return {"recompute": recompute, "gpu_hit": first_token(llm, doc + question(doc_id, 2))}
    if way == "tier":
        stored = first_token(llm, doc + question(doc_id, 3))
        resets.append(reset_prefix_cache(llm))
        return {"recompute_storing": stored, "cpu_tier": first_token(llm, doc + question(doc_id, 1))}
    if way.endswith("writer"):
        return {way.replace("writer", "recompute_putting"): first_token(llm, doc + question(doc_id, 3))}
    return {SHARED_KIND[way]: first_token(llm, doc + question(doc_id, 1))}


def run_way(way: str, model: Path, lengths: list[int], docs: int,
            shared_tier: dict[str, Any] | None = None) -> dict[str, Any]:
    """``serve`` in a fresh process (one engine per process, as vLLM runs)."""
    print(f"{way}: a new engine process...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "kvoffload.impl.testing.ttft", way, str(model), json.dumps(lengths), str(docs),
           json.dumps(shared_tier)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the {way!r} engine failed (exit status {done.returncode}); its log is above")
    return json.loads(lines[-1][len("RESULT "):])


def medians(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Median seconds of each kind at each length ("cpu_tier/2048")."""
    return {key: statistics.median(values) for run in runs.values() for key, values in run["seconds"].items()}


def mismatches(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Every hit whose first token differs from recompute's for the same prompt."""
    truth, wrong = runs["none"]["tokens"], []
    for way, kind in (("tier", "cpu_tier"), *SHARED_KIND.items()):
        for key, token in runs.get(way, {"tokens": {}})["tokens"].items():
            length_and_doc = key.removeprefix(f"{kind}/")
            if length_and_doc != key and token != truth[f"recompute/{length_and_doc}"]:
                wrong.append(f"{key}: token {token}, recompute's {truth[f'recompute/{length_and_doc}']}")
    return wrong


if __name__ == "__main__":  # one way here: python -m kvoffload.impl.testing.ttft WAY MODEL LENGTHS DOCS SHARED_TIER
    way, model, lengths, docs, shared_tier = sys.argv[1:]
    result = serve(way, Path(model), json.loads(lengths), int(docs), json.loads(shared_tier))
    print("RESULT " + json.dumps(result), flush=True)
