"""An engine in a process of its own (one engine per process, as vLLM runs), asked for one piece of work at a time:
so that two engines can take turns on a quiet machine, and a machine that slows down slows both alike.

The child side (``answer_each``) prints ``READY`` once its engine is up, then answers each JSON line written to its
stdin with one ``RESULT <json>`` line; vLLM's own log lines may come in between.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Callable

from . import preloaded


class EngineProcess:
    """The parent's handle on one engine process: ``python -m module *args``."""

    def __init__(self, name: str, module: str, *args: str) -> None:
        print(f"{name}: a new engine process...", file=sys.stderr, flush=True)
        self.name = name
        self.process = preloaded.popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        self._reply("READY")

    def _reply(self, prefix: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # vLLM's own log lines come first
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"the {self.name!r} engine exited (status {self.process.wait()}); its log is above")

    def ask(self, work: dict[str, Any]) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(work) + "\n")
        self.process.stdin.flush()
        return json.loads(self._reply("RESULT "))

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=120)


def answer_each(handle: Callable[[dict[str, Any]], Any]) -> None:
    """The child's loop: ``READY``, then one result per piece of work, until stdin closes."""
    print("READY", flush=True)
    for line in sys.stdin:
        print("RESULT " + json.dumps(handle(json.loads(line))), flush=True)
