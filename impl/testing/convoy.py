"""Many requests arriving together, on vLLM's CPU engine, with and without our connector: what users who saw
offloading make things worse measured (a load convoy on a shared prefix, vllm#44294; a cost with no hit at all).

Two workloads, each round on fresh tokens:

  * ``shared``: ``requests`` requests over one long document, each with its own question, submitted at once. The
    document was served once before and the engine's prefix cache was reset since (checked), so with the
    connector every request finds it in the CPU tier; without, every request computes it.
  * ``unique``: as many requests, each a document of its own: no hit is possible, the connector only stores.

Each way (``none``, ``ours``) is an engine in a process of its own (``serve``), which runs a round when the driver
(``bench/convoy.py``) writes one to its stdin, so the two engines take turns on an otherwise quiet machine. A round
times every request's first token and the whole batch, and returns every output, for the driver to compare. After a
round the engine's prefix cache is reset, and with the connector its tier too (``reset_connector=True``), so that no
round serves another's KV.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from .demo import BLOCK_SIZE, connector_config, make_llm, reset_prefix_cache, scheduler_connector
from .engine_process import answer_each
from .ttft import PREFILL_LLAMA

WAYS = ("none", "ours")
WORKLOADS = ("shared", "unique")
QUESTION = 32  # tokens after the document


def prompts(kind: str, requests: int, document: int, round_no: int) -> list[list[int]]:
    """The round's prompts: one document and ``requests`` questions after it (``shared``), or ``requests``
    documents each with its question (``unique``); the same in both ways."""
    rnd, vocab = random.Random(f"{kind}/{requests}/{round_no}"), PREFILL_LLAMA["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(vocab) for _ in range(n)]
    shared = tokens(document)
    return [(shared if kind == "shared" else tokens(document)) + tokens(QUESTION) for _ in range(requests)]


def timed_batch(llm: Any, batch: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """Submit every prompt at once and step the engine until all are done: each request's seconds to its first
    token, the batch's seconds, and the outputs."""
    from vllm import SamplingParams

    engine, params = llm.llm_engine, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, time.perf_counter() - started)
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    order = [f"{tag}-{i}" for i in range(len(batch))]
    return {"seconds": seconds, "ttft": [first[r] for r in order], "outputs": [outputs[r] for r in order],
            "tokens": sum(len(outputs[r]) for r in order)}


def run_round(llm: Any, way: str, kind: str, requests: int, document: int, round_no: int,
              max_tokens: int) -> dict[str, Any]:
    batch, tag = prompts(kind, requests, document, round_no), f"{kind}-{requests}-{round_no}"
    if kind == "shared":  # served once (stored, with the connector), then gone from the engine's own cache
        timed_batch(llm, batch[:1], 1, f"{tag}-warm")
        reset_prefix_cache(llm)
    before = dict(scheduler_connector(llm).stats()) if way == "ours" else {}
    result = timed_batch(llm, batch, max_tokens, tag)
    if way == "ours":
        after = scheduler_connector(llm).stats()
        result["hit_tokens"] = after["hit_tokens"] - before["hit_tokens"]
        result["stored_blocks"] = after["stored_blocks"] - before["stored_blocks"]
        # the copies into the tier run in the engine's step on this CPU engine; a GPU's copy engine runs them beside it
        result["store_seconds"] = after["store_seconds"] - before["store_seconds"]
    _reset_everything(llm, way)
    return result


def _reset_everything(llm: Any, way: str, most_steps: int = 100) -> None:
    """The engine's prefix cache, and the connector's tier: the next round starts cold."""
    for _ in range(most_steps):
        if llm.reset_prefix_cache(reset_connector=way == "ours"):
            return
        llm.llm_engine.step()
    raise RuntimeError(f"reset_prefix_cache(reset_connector=True) still refused after {most_steps} engine steps")


def serve(way: str, model: Path, requests: int, document: int) -> None:
    """One way's engine, sized for ``requests`` requests of ``document`` tokens at once: runs each round written to
    stdin (JSON: kind, requests, round, max_tokens) and prints its result."""
    per_request = -(-(document + QUESTION + 64) // BLOCK_SIZE)
    connector = connector_config(tier_bytes=4 << 30, offload_block_size=BLOCK_SIZE) if way == "ours" else None
    llm = make_llm(model, connector, num_gpu_blocks=requests * per_request + 16,
                   max_model_len=document + QUESTION + 64, memory_share=0.4)
    answer_each(lambda ask: run_round(llm, way, ask["kind"], ask["requests"], document, ask["round"],
                                      ask["max_tokens"]))


if __name__ == "__main__":  # python -m kvoffload.impl.testing.convoy WAY MODEL REQUESTS DOCUMENT
    way, model, requests, document = sys.argv[1:]
    serve(way, Path(model), int(requests), int(document))
