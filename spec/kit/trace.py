"""A failing kit run as a JSON Lines trace, and the replay that turns it back into the same failure.

Line 1 says what ran: spec version, adapter and KV factories (``module:qualname``, and the keyword arguments of a
``functools.partial`` of one), level, scenario, and the failure. Every further line is one rule with its arguments,
in order: the shrunk program. Replay builds the same machine and runs the program as Hypothesis did (invariants after
the start and after every rule, then teardown):

    python -m kvoffload.spec.kit.trace kvoffload-traces/test_my_connector.jsonl
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from attrs import asdict

from ..config import Config
from ..groups import FULL_ATTENTION, Group
from ..invariants import SPEC_VERSION, Violation
from .machine import ConformanceMachine, make_machine
from .scenario import Scenario


class UnreplayableTrace(ValueError):
    """A trace cannot name one of its factories so that replay finds it again: nothing is written."""


def qualified_name(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}" if hasattr(obj, "__qualname__") else repr(obj)


def factory_entry(obj: Any, role: str = "factory") -> tuple[str, dict[str, Any]]:
    """How a trace names a factory: ``importable_name`` of it, or of the function a ``functools.partial`` binds with
    the keyword arguments it binds (JSON values; no positional ones), which replay binds again."""
    if not isinstance(obj, functools.partial):
        return importable_name(obj, role), {}
    try:
        arguments = json.loads(json.dumps(obj.keywords))
    except TypeError:
        arguments = None
    if obj.args or arguments != obj.keywords:
        raise UnreplayableTrace(f"cannot write a replayable trace: {role} {obj!r} binds positional arguments or "
                                f"values that are not JSON (a path, an object); bind numbers, strings and lists by "
                                f"keyword, or pass it to replay(path, adapter=...)")
    return importable_name(obj.func, role), arguments


def factory_from(header: dict[str, Any], role: str) -> Any:
    """The factory a trace header names for ``role`` ("adapter", "kv"), with the arguments it recorded bound."""
    factory, arguments = resolve(header[role]), header.get(f"{role}_args") or {}
    return functools.partial(factory, **arguments) if arguments else factory


def importable_name(obj: Any, role: str = "factory") -> str:
    """``module:qualname`` for ``obj``, checked to import back to it; else ``UnreplayableTrace`` saying how to fix it.

    A script's function is ``__main__:f``, which a replay in another process imports as the replay's own
    ``__main__`` (an AttributeError). A script run as ``python -m pkg.mod`` is named by its module (``pkg.mod:f``)."""
    fix = "move it into an importable module, or pass it to replay(path, adapter=...)"
    label = getattr(obj, "__qualname__", None) or repr(obj)
    if not isinstance(getattr(obj, "__qualname__", None), str) or not isinstance(getattr(obj, "__module__", None), str):
        raise UnreplayableTrace(f"cannot write a replayable trace: {role} {label} is not a function or class "
                                f"(a functools.partial or an instance has no import name); {fix}")
    module, qualname = obj.__module__, obj.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise UnreplayableTrace(f"cannot write a replayable trace: {role} '{qualname}' is a lambda or is defined "
                                f"inside a function; {fix}")
    main = module == "__main__"
    if main:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is None or not spec.name or spec.name == "__main__":
            raise UnreplayableTrace(f"cannot write a replayable trace: {role} '{qualname}' is defined in __main__ "
                                    f"(a script); {fix}")
        module = spec.name
    try:
        found: Any = sys.modules["__main__"] if main else importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        found = None
    if found is not obj:  # e.g. rebound, or created under another name
        raise UnreplayableTrace(f"cannot write a replayable trace: {role} {module}:{qualname} does not import back "
                                f"to the {role} that ran; {fix}")
    return f"{module}:{qualname}"


MOVED = {"kvoffload.spec.world:ListKV": "kvoffload.spec.memory:ListKV"}  # names traces of spec 0.6 and before use


def resolve(name: str) -> Any:
    """The object a ``module:qualname`` names; a clear error for one defined inside a function."""
    module, _, qualname = MOVED.get(name, name).partition(":")
    if not qualname or "<locals>" in qualname:
        raise ValueError(f"{name} cannot be imported by name (defined in a function, or not a function or class): "
                         f"pass it to replay()")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def hash_seed() -> str | None:
    """The ``PYTHONHASHSEED`` this process was started with, None when its hashes of strings and bytes are random:
    the order of a set of them (request ids, vLLM's block hashes), and so what a connector that iterates one does,
    is then the process's own."""
    seed = os.environ.get("PYTHONHASHSEED")
    return None if seed in (None, "random") or (seed == "0") == bool(sys.flags.hash_randomization) else seed


def write_trace(path: Path, machine: type[ConformanceMachine], failure: Violation) -> None:
    """Write the failure's program, for the adapter it was found on; ``UnreplayableTrace`` (nothing written) if a
    factory has no import name."""
    factory, kv_factory = ((machine.factory, machine.kv_factory), *machine.alongside)[failure.adapter]
    (adapter, adapter_args), (kv, kv_args) = factory_entry(factory), factory_entry(kv_factory, "kv factory")
    header = {"kvoffload_trace": 1, "spec_version": SPEC_VERSION, "adapter": adapter,
              **({"adapter_args": adapter_args} if adapter_args else {}), "kv": kv,
              **({"kv_args": kv_args} if kv_args else {}), "level": machine.level,
              "scenario": asdict(machine.scenario), "hash_seed": hash_seed(),
              "failure": f"{type(failure).__name__}: {failure}".splitlines()[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for line in [header, *({"rule": name, "args": args} for name, args in failure.trace or ())]:
            out.write(json.dumps(line) + "\n")


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    header, *rules = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    if header.get("kvoffload_trace") != 1:
        raise ValueError(f"{path} is not a kvoffload trace")
    return header, [(r["rule"], r["args"]) for r in rules]


def scenario_from(header: dict[str, Any]) -> Scenario:
    fields, config = header["scenario"], header["scenario"]["config"]
    groups = tuple(Group(**group) for group in config.get("groups", ())) or FULL_ATTENTION  # older traces: none
    # a trace from before spec 0.15 ran a world whose prefix cache kept every window and state block
    retention = config.get("retention_interval")
    return Scenario(**{**fields, "config": Config(**{**config, "groups": groups, "retention_interval": retention})})


def replay(path: str | Path, adapter: Callable[[Config], Any] | None = None,
           kv: Callable[[int], Any] | None = None) -> None:
    """Run the trace's program again. Raises its failure; returns quietly if the program passes now (fixed)."""
    header, program = read_trace(path)
    if header["spec_version"] != SPEC_VERSION:
        print(f"note: trace written by spec {header['spec_version']}, replayed by {SPEC_VERSION}", file=sys.stderr)
    machine = make_machine(adapter or factory_from(header, "adapter"), scenario_from(header), header["level"],
                           kv or factory_from(header, "kv"))()
    machine.invariants_hold()
    try:
        for name, args in program:
            getattr(machine, name)(**args)
            machine.invariants_hold()
    finally:
        machine.teardown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="replay a kvoffload kit trace")
    parser.add_argument("trace", type=Path)
    args = parser.parse_args(argv)
    header, program = read_trace(args.trace)
    recorded = header.get("hash_seed")
    if recorded is not None and recorded != hash_seed():  # the recording's set orders: this process again, pinned
        print(f"note: replaying under PYTHONHASHSEED={recorded}, as recorded", file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, str(args.trace)],
                  {**os.environ, "PYTHONHASHSEED": recorded})
    if recorded is None:
        print("note: recorded with random string hashes: a connector that iterates a set of strings or bytes may take "
              "another path (record under PYTHONHASHSEED=0)", file=sys.stderr)
    print(f"replaying {len(program)} rules against {header['adapter']}; recorded: {header['failure']}")
    replay(args.trace)
    print("the program passes now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
