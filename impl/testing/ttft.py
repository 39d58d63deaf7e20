"""Time to first token on vLLM's CPU engine, one request at a time, on documents long enough that prefill costs time
(a random Llama of 8 layers, hidden 512): what a user of the connector gains.

Each way runs in an engine process of its own (``serve``), the same documents and questions each time; ``none``
and ``tier`` take turns, document by document (``run_ways``), so that a hit and its baseline are timed side by side
(this machine's speed drifts by tens of percent between runs a minute apart):

  * ``none``: no connector. A document with its first question, cold (**recompute**), then with a second question
    (the engine's own **GPU prefix-cache hit**: the limit a tier can approach).
  * ``tier``: our connector with a CPU tier only. The document with a third question, cold (recompute with the
    connector, which stores it); the engine's prefix cache reset (checked); then the first question (a **CPU-tier
    hit**).
  * ``sync``: the same, with synchronous loads (``sync_loads``, under vLLM's "fail" policy): the hit loads in the
    step that computes the question, not in a step of its own (a **synchronous CPU-tier hit**).
  * ``writer``: our connector with a CPU tier and a shared tier in a directory: the document with a third question,
    cold (recompute while storing it into both, the records fsynced into the directory); then the engine steps
    until its puts end, untimed, as a serving engine's loop steps for them between requests
    (``has_pending_push_work``): ``LLM.generate`` returns first, and the next ask would pay for them.
  * ``shared``: a new engine on the writer's directory, its CPU tier empty: the first question (a **shared-tier
    hit**: records got from the directory into the CPU tier, then loaded).
  * ``redis_writer`` and ``redis``, ``mooncake_writer`` and ``mooncake``: the same two, the shared tier on a Redis
    server or a Mooncake Store pool instead of a directory (a **Redis hit**, a **Mooncake hit**).

Every hit's first token is compared with recompute's for the same prompt. Time to first token is the wall time of
a ``generate`` call with ``max_tokens=1``: what the caller waits for, the engine's extra steps included.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .demo import BLOCK_SIZE, connector_config, drain, make_llm, reset_prefix_cache, save_once, scheduler_connector
from .engine_process import EngineProcess, answer_each

PREFILL_LLAMA: dict[str, Any] = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
TIER_BYTES = 1 << 30  # resident from the start (``HostPool``): four engines' tiers share this machine with their KV
QUESTION = 17  # tokens after the document: never a whole block, so the document is the part a cache can serve
STORES = ("redis", "mooncake")  # the shared tier's backends besides a directory: ways "<store>_writer" and "<store>"
# a way that reads a shared tier: what its hit is
SHARED_KIND = {"shared": "shared_tier", **{store: f"{store}_tier" for store in STORES}}


def build_prefill_llama(path: Path) -> Path:
    """The random Llama whose prefill costs time on a CPU (head_dim 64, 2 KV heads, fp32: 8 KiB of KV per token)."""
    def llama() -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(**PREFILL_LLAMA))
    return save_once(path, llama)


def build_prefill_qwen3_next(path: Path) -> Path:
    """A random Qwen3-Next-style model as large as the prefill Llama (hidden 512, 8 layers: 6 gated-delta-net layers
    with recurrent state, 2 full-attention layers; a small mixture of experts): a hybrid linear-attention model,
    which vLLM's CPU engine runs in bf16 and align mode with 256-token blocks."""
    def qwen3_next() -> Any:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        return Qwen3NextForCausalLM(Qwen3NextConfig(
            vocab_size=PREFILL_LLAMA["vocab_size"], hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
            max_position_embeddings=8192))
    return save_once(path, qwen3_next)


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


def serve(way: str, model: Path, max_length: int, shared_tier: dict[str, Any] | None) -> None:
    """One way's engine, in this process, for documents up to ``max_length`` tokens: measures each document written
    to stdin (``doc_id``, ``doc``: its requests' seconds and first tokens by what serves its prefix, and the reset
    it took); ``{"stats": true}`` gets the connector's counters. A writer's and a reader's connector has
    ``shared_tier`` too (the CPU tier's stores are put into it)."""
    max_len = max_length + QUESTION + BLOCK_SIZE
    blocks = 2 * (max_len // BLOCK_SIZE) + 16  # two documents' blocks: the GPU prefix cache holds the last one
    connector = None
    if way == "sync":
        connector = connector_config(load_failure_policy="fail", tier_bytes=TIER_BYTES, sync_loads=True)
    elif way != "none":
        shared: dict[str, Any] = {"shared_tier": shared_tier} if way != "tier" else {}
        connector = connector_config(tier_bytes=TIER_BYTES, **shared)  # an offload block is one of the engine's blocks
    llm = make_llm(model, connector, num_gpu_blocks=blocks, max_model_len=max_len, memory_share=0.4)

    def handle(work: dict[str, Any]) -> dict[str, Any]:
        if "stats" in work:
            return _stats(way, llm) if connector is not None else {}
        resets: list[int] = []
        return {"asks": _ask(way, llm, work["doc_id"], work["doc"], resets), "reset_steps": resets}
    answer_each(handle)


def _stats(way: str, llm: Any) -> dict[str, Any]:
    if way.endswith("writer"):  # its puts end, and are counted
        drain(llm)
    stats = scheduler_connector(llm).stats()
    return {k: stats[k] for k in ("hit_tokens", "loaded_blocks", "sync_loaded_blocks", "shared_got_blocks",
                                  "shared_hits", "shared_stored", "shared_quarantined") if k in stats}


def _ask(way: str, llm: Any, doc_id: int, doc: list[int], resets: list[int]) -> dict[str, tuple[float, int]]:
    """One document's measured requests, by what serves its prefix."""
    if way == "none":
        recompute = first_token(llm, doc + question(doc_id, 1))
        return {"recompute": recompute, "gpu_hit": first_token(llm, doc + question(doc_id, 2))}
    if way == "tier":
        stored = first_token(llm, doc + question(doc_id, 3))
        resets.append(reset_prefix_cache(llm))
        return {"recompute_storing": stored, "cpu_tier": first_token(llm, doc + question(doc_id, 1))}
    if way == "sync":  # and this engine's own hit: the same process, its prefix cache instead of our tier
        first_token(llm, doc + question(doc_id, 3))
        own = first_token(llm, doc + question(doc_id, 2))
        resets.append(reset_prefix_cache(llm))
        return {"gpu_hit_sync": own, "cpu_tier_sync": first_token(llm, doc + question(doc_id, 1))}
    if way.endswith("writer"):
        putting = first_token(llm, doc + question(doc_id, 3))
        drain(llm)  # its puts end before the next ask, as a serving engine steps for them between requests
        return {way.replace("writer", "recompute_putting"): putting}
    return {SHARED_KIND[way]: first_token(llm, doc + question(doc_id, 1))}


def run_ways(ways: tuple[str, ...], model: Path, lengths: list[int], docs: int,
             shared_tier: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each way's figures: seconds and first tokens of each kind (``cpu_tier/2048``, a list in document order), the
    resets' extra steps, the connector's counters. Each way is an engine process of its own; several ways take turns
    document by document (the first to go alternates), so that each document's figures are timed side by side. For
    each length, a warm-up document comes first, not counted."""
    engines = {way: EngineProcess(way, "kvoffload.impl.testing.ttft", way, str(model), str(max(lengths)),
                                  json.dumps(shared_tier)) for way in ways}
    figures: dict[str, dict[str, Any]] = {way: {"seconds": {}, "tokens": {}, "reset_steps": []} for way in ways}
    try:
        texts = documents(lengths, docs + 1, seed=0)
        for n in lengths:
            print(f"  {' and '.join(ways)}: {n}-token documents", file=sys.stderr, flush=True)
            for d, doc in enumerate(texts[n]):
                for way in (ways if d % 2 == 0 else ways[::-1]):
                    if len(ways) > 1:
                        time.sleep(0.5)  # the other engine's OpenMP threads stop spinning
                    done = engines[way].ask({"doc_id": n * 100 + d, "doc": doc})
                    figures[way]["reset_steps"] += done["reset_steps"]
                    for kind, (seconds, token) in done["asks"].items():
                        if d:  # not the warm-up
                            figures[way]["seconds"].setdefault(f"{kind}/{n}", []).append(seconds)
                            figures[way]["tokens"][f"{kind}/{n}/{d}"] = token
        for way in ways:
            figures[way]["stats"] = engines[way].ask({"stats": True})
    finally:
        for engine in engines.values():
            engine.close()
    return figures


def medians(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Median seconds of each kind at each length ("cpu_tier/2048")."""
    return {key: statistics.median(values) for run in runs.values() for key, values in run["seconds"].items()}


def paired(runs: dict[str, dict[str, Any]], kind: str, baseline: str, n: int) -> float:
    """The median over documents of ``kind``'s seconds / ``baseline``'s on the same document, at ``n`` tokens: for
    ways that took turns, each ratio timed side by side."""
    def seconds(of: str) -> list[float]:
        return next(run["seconds"][f"{of}/{n}"] for run in runs.values() if f"{of}/{n}" in run["seconds"])
    return statistics.median(a / b for a, b in zip(seconds(kind), seconds(baseline), strict=True))


def mismatches(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Every hit whose first token differs from recompute's for the same prompt."""
    truth, wrong = runs["none"]["tokens"], []
    for way, kind in (("tier", "cpu_tier"), ("sync", "cpu_tier_sync"), *SHARED_KIND.items()):
        for key, token in runs.get(way, {"tokens": {}})["tokens"].items():
            length_and_doc = key.removeprefix(f"{kind}/")
            if length_and_doc != key and token != truth[f"recompute/{length_and_doc}"]:
                wrong.append(f"{key}: token {token}, recompute's {truth[f'recompute/{length_and_doc}']}")
    return wrong


if __name__ == "__main__":  # one way here: python -m kvoffload.impl.testing.ttft WAY MODEL MAX_LENGTH SHARED_TIER
    way, model, max_length, shared_tier = sys.argv[1:]
    serve(way, Path(model), int(max_length), json.loads(shared_tier))
