"""kvoffload.impl.testing — test tooling for the production connector, opt-in (as ``zarr.testing`` is).

Nothing in production imports this package; tests, benchmarks and the demo do. Importing the package itself needs
only torch; the modules that need vLLM are imported by name (``demo`` and ``blackbox`` default
``VLLM_ENABLE_V1_MULTIPROCESSING`` to 0 when they are: the engine runs in this process):

  * ``kv``: ``LayeredKV``, vLLM-shaped KV caches (every ``SHAPES`` layout) that the kit can fill and check;
  * ``harness`` (vLLM): a real vLLM ``Scheduler`` without a model, for tests and benchmarks;
  * ``demo`` (vLLM): the demo (``python -m kvoffload.impl.testing.demo``) and the tiny random Llama it builds;
  * ``blackbox`` (vLLM): any vLLM connector driven by the kit in black-box mode, and the hunt
    (``python -m kvoffload.impl.testing.blackbox``).
"""

from .kv import SHAPES, LayeredKV

__all__ = ["SHAPES", "LayeredKV"]
