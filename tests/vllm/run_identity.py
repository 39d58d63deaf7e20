"""One real vLLM engine in a fresh process, put through a list of actions an operator's code makes: generate the
workload, update the weights in place (vLLM's ``reload_weights``, as RL loops call it), reset the prefix cache
and the connector. Prints a JSON line: each generate's outputs, and what the connector's counters moved during it.
Used by test_identity.py.

    python run_identity.py --model DIR [--extra JSON] --actions '[["reload", DIR2], ["reset"], ["generate"]]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

MOVED = ("hit_tokens", "shared_got_blocks", "shared_hits", "shared_stored", "shared_put_blocks")


def ask(llm, prompt: list[int], lora: list | None = None, salt: str | None = None) -> list[list[int]]:
    """One request for ``prompt`` under a LoRA adapter ``[name, id, dir]`` or a ``cache_salt``; the engine's own
    prefix cache is reset after it (the next ask's hit can only come from the connector)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from kvoffload.impl.testing.demo import reset_prefix_cache

    request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
    done = llm.generate([request], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
                        lora_request=LoRARequest(*lora) if lora else None)
    reset_prefix_cache(llm)
    return [list(done[0].outputs[0].token_ids)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--extra", default="", help="kv_connector_extra_config as JSON; empty: no connector")
    parser.add_argument("--actions", required=True, help="JSON list: [generate], [generate, n], [reload, dir], [reset],"
                        " [ask, {lora: [name, id, dir]} or {salt: s}] (the first prompt, under that adapter or salt)")
    parser.add_argument("--lora", action="store_true", help="the engine serves LoRA adapters")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers, each a process of its own")
    args = parser.parse_args()

    from vllm.config import KVTransferConfig

    from kvoffload.impl.testing.demo import drain, make_llm, run_rounds, scheduler_connector, workload

    config = None
    if args.extra:
        config = KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                                  kv_connector_module_path="kvoffload.impl.vllm",
                                  kv_connector_extra_config=json.loads(args.extra), kv_load_failure_policy="recompute")
    llm = make_llm(args.model, config, lora=args.lora, tensor_parallel=args.tp)
    prompts = workload(8, seed=1)
    results = []
    for action, *arg in json.loads(args.actions):
        if action in ("generate", "ask"):
            before = dict(scheduler_connector(llm).stats()) if config else {}
            if action == "generate":
                outputs = run_rounds(llm, prompts[:arg[0]] if arg else prompts, rounds=1, max_tokens=6)
            else:
                outputs = ask(llm, prompts[0], **arg[0])
            if config:
                drain(llm)  # every put made: the next engine finds what this one stored
                after = scheduler_connector(llm).stats()
                moved = {name: after[name] - before[name] for name in MOVED}
            results.append({"outputs": outputs, **(moved if config else {})})
        elif action == "reload":  # the weights change in place; the model's files stay as the engine started on
            llm.collective_rpc("reload_weights", kwargs={"weights_path": arg[0]})
        elif action == "reset":
            results.append({"reset": llm.reset_prefix_cache(reset_connector=True)})
        else:
            raise SystemExit(f"unknown action {action!r}")
    print("RESULT " + json.dumps(results), flush=True)
    sys.exit(0)
