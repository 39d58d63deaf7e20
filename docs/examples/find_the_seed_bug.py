"""vLLM 0.11's own OffloadingConnector through the kit, in black-box mode: the kit finds the seed bug (a refused
store allocation ``break``s out of the batch loop) and writes its shrunk program, which replays.

    make releases   # installs vLLM 0.11 (scheduler side) in .venv-vllm/0.11
    .venv-vllm/0.11/bin/python docs/examples/find_the_seed_bug.py
    .venv-vllm/0.11/bin/python -m kvoffload.spec.kit.trace seed-bug.jsonl   # the same failure again
"""

import logging
import sys

from kvoffload.impl.testing.blackbox import release, vllm_offloading_connector
from kvoffload.spec import Config, Violation
from kvoffload.spec.kit import Scenario, run_conformance

logging.getLogger("vllm").setLevel(logging.ERROR)  # 0.11 warns "Cannot store N blocks" at every refusal
print(f"vLLM {release().version}: OffloadingConnector in black-box mode")
# A 3-block tier fills up and refuses stores; the kit refuses some on purpose too. Transfers complete at once:
# 0.11 has no preemption flush either, and delayed transfers would find that first.
scenario = Scenario(Config(num_gpu_blocks=12, tier_blocks=3))
try:
    coverage = run_conformance(vllm_offloading_connector, scenario, profile="pr", trace="seed-bug.jsonl")
except Violation as found:
    print(found, *found.__notes__, sep="\n")  # the finding, then the shrunk program and where its trace went
    sys.exit(1)
print(coverage)
