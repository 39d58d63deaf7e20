"""Stores that pay for themselves, on vLLM's CPU engine: a stream of requests over documents, half of them over a
few documents asked again and again (hot), half over documents asked once (one-off), more than the CPU tier holds.
Storing every block, the one-off documents evict the hot ones (least recently used first) and the next ask of a hot
document recomputes it; with ``store_threshold`` 2 a block is stored only once it was offered twice, so one-off
documents never enter the tier and the hot ones stay.

Each policy runs in an engine process of its own (``serve``), one request at a time, the same prompts in the same
order: time to first token of each, the tokens the tier served, the blocks it stored and those admission left out,
and every first token (for the driver, ``bench/admission.py``, to compare with recompute's).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from .demo import BLOCK_SIZE, connector_config, make_llm, scheduler_connector
from .ttft import PREFILL_LLAMA, first_token

KV_BYTES_PER_TOKEN = 8 << 10  # the prefill Llama's: 8 layers, 2 KV heads of 64, fp32
QUESTION = 17  # tokens after the document: never a whole block
POLICIES: dict[str, dict[str, Any] | None] = {  # name -> kv_connector_extra_config admission keys (None: no connector)
    "none": None,
    "every block": {},
    "threshold 2": {"store_threshold": 2},
    "threshold 3": {"store_threshold": 3},
}


def workload(requests: int, hot: int, document: int, seed: int = 0) -> list[list[int]]:
    """``requests`` prompts, each a document and a question of its own: every other one over one of ``hot``
    documents, the rest over a document asked only then."""
    rnd, vocab = random.Random(seed), PREFILL_LLAMA["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(vocab) for _ in range(n)]
    hot_docs = [tokens(document) for _ in range(hot)]
    return [(rnd.choice(hot_docs) if i % 2 else tokens(document)) + tokens(QUESTION) for i in range(requests)]


def serve(policy: str, model: Path, requests: int, hot: int, document: int, tier_documents: int) -> dict[str, Any]:
    """One policy's engine: a CPU tier of ``tier_documents`` documents, a GPU cache of two."""
    extra = POLICIES[policy]
    connector = None if extra is None else connector_config(
        tier_bytes=tier_documents * document * KV_BYTES_PER_TOKEN, offload_block_size=BLOCK_SIZE, **extra)
    per_document = -(-(document + QUESTION) // BLOCK_SIZE)
    llm = make_llm(model, connector, num_gpu_blocks=2 * per_document + 4, max_model_len=document + QUESTION + 32,
                   memory_share=0.4)
    prompts = workload(requests, hot, document)
    first_token(llm, workload(1, 1, document, seed=1)[0])  # warm-up (the first pass is slower), on other tokens
    asked = [first_token(llm, prompt) for prompt in prompts]
    result: dict[str, Any] = {"seconds": [s for s, _t in asked], "tokens": [t for _s, t in asked],
                              "prompt_tokens": sum(map(len, prompts))}
    if connector is not None:
        stats = scheduler_connector(llm).stats()
        result |= {k: stats[k] for k in ("hit_tokens", "stored_blocks", "unadmitted_blocks", "evictions")}
    return result


if __name__ == "__main__":  # python -m kvoffload.impl.testing.admission POLICY MODEL REQUESTS HOT DOCUMENT TIER_DOCS
    policy, model, *numbers = sys.argv[1:]
    requests, hot, document, tier_documents = map(int, numbers)
    print("RESULT " + json.dumps(serve(policy, Path(model), requests, hot, document, tier_documents)), flush=True)
