"""Who may import what, read statically from the sources (``ast``; nothing is imported).

- ``spec/`` imports neither torch nor vLLM; only the kit (``spec/kit.py`` or the ``spec/kit/`` package),
  ``spec/trace.py`` and ``spec/pytest_plugin.py`` import Hypothesis.
- Production ``impl/`` (everything under ``impl/`` but ``impl/testing/``) imports neither the spec's world model
  (``kvoffload.spec.world``) nor the kit (``kvoffload.spec.kit``), nor the test tooling (``kvoffload.impl.testing``),
  and sets no environment variable.
- Only the adapter (``impl/vllm/``) and the test tooling (``impl/testing/``) import vLLM; ``reference/``
  does not.

Every import counts, at module level or inside a function: a lazy import still crosses the boundary when it runs.
Only direct imports are read: ``impl/shadow.py`` imports ``kvoffload.spec`` (whose ``__init__`` imports the world)
to run the spec connector, by design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"spec": "kvoffload.spec", "reference": "kvoffload.reference", "impl": "kvoffload.impl"}
KIT_FILES = ("spec/trace.py", "spec/pytest_plugin.py")  # beside spec/kit.py or spec/kit/: may import Hypothesis
ADAPTER = "impl/vllm/"
TESTING = "impl/testing/"


def sources() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for folder in PACKAGES for p in (ROOT / folder).rglob("*.py"))


def module_name(path: str) -> str:
    folder, *rest = Path(path).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: str) -> list[tuple[str, int]]:
    """Every module ``path`` imports, absolute, with its line: ``from a import b`` yields ``a`` and ``a.b`` (b may
    be a submodule)."""
    module = module_name(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_kit(path: str) -> bool:
    return path.startswith("spec/kit") or path in KIT_FILES


def is_production(path: str) -> bool:
    return path.startswith("impl/") and not path.startswith(TESTING)


def forbidden(path: str) -> dict[str, str]:
    """Package -> why ``path`` may not import it."""
    rules = {}
    if path.startswith("spec/"):
        rules["torch"] = "spec/ is plain Python: it imports neither torch nor vLLM"
        if not is_kit(path):
            rules["hypothesis"] = "only the kit (spec/kit*, trace.py, pytest_plugin.py) imports Hypothesis"
    if is_production(path):
        for model in ("world", "requests", "memory", "executor"):
            rules[f"kvoffload.spec.{model}"] = "production impl/ does not import the spec's world model"
        rules["kvoffload.spec.kit"] = "production impl/ does not import the kit"
        rules["kvoffload.impl.testing"] = "production impl/ does not import the test tooling"
    if not path.startswith((ADAPTER, TESTING)):
        rules["vllm"] = f"only the adapter ({ADAPTER}) and the test tooling ({TESTING}) import vLLM"
    return rules


@pytest.mark.parametrize("path", sources())
def test_imports_stay_inside_the_boundaries(path):
    rules = forbidden(path)
    crossings: dict[tuple[int, str], str] = {}  # one per line and rule: `from a import b` yields a and a.b
    for name, line in imports(path):
        for package, why in rules.items():
            if within(name, package):
                crossings.setdefault((line, package), f"{module_name(path)} ({path}:{line}) imports {name}: {why}")
    if crossings:
        pytest.fail("\n".join(crossings.values()), pytrace=False)


ENVIRON_WRITES = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


@pytest.mark.parametrize("path", [p for p in sources() if is_production(p)])
def test_production_modules_set_no_environment_variable(path):
    """Importing an operator's module must not change ``os.environ`` (the test tooling may, for the engine it
    starts)."""
    writes = []
    for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
        environ = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("putenv", "unsetenv"):
                environ = node.func.attr
            elif node.func.attr in ENVIRON_WRITES and _is_environ(node.func.value):
                environ = f"os.environ.{node.func.attr}"
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
                environ = "os.environ[...]"
        if environ:
            writes.append(f"{module_name(path)} ({path}:{node.lineno}) writes the environment ({environ})")
    if writes:
        pytest.fail("\n".join(writes), pytrace=False)


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def test_the_boundaries_see_what_they_check():
    """The rules are not vacuous: the layout is the one they name, and the parser sees known imports."""
    paths = sources()
    assert any(p.startswith(ADAPTER) for p in paths) and any(p.startswith(TESTING) for p in paths)
    assert any(is_kit(p) and p.startswith("spec/kit") for p in paths), "the kit moved: update is_kit"
    assert any(within(name, "vllm") for name, _ in imports(ADAPTER + "connector.py"))
    assert any(name == "kvoffload.impl.transfer" for name, _ in imports("impl/testing/kv.py"))  # relative: from ..
    assert any(within(name, "hypothesis") for p in paths if p.startswith("spec/kit") for name, _ in imports(p))
