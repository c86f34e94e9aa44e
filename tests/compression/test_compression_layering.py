"""compression/ is a library: it imports nothing of the service, and its modules form a DAG.

Static checks parse every module with ``ast``; the dynamic one imports each module alone in a
fresh interpreter, with the package's ``__init__`` bypassed, so a module that only works
because ``__init__`` happened to import something first fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gossipgrad.compression import REGISTRY

pytestmark = pytest.mark.timeout(120)

PACKAGE = "gossipgrad.compression"
PACKAGE_DIR = Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0])
MODULES = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__")
FORBIDDEN = ("gossipgrad.proto", "gossipgrad.peer", "gossipgrad.experiment")


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """Absolute names of the modules an import statement loads (submodules resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = f"{PACKAGE}.{module}".split(".")[: -node.level]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    if base == PACKAGE:
        return [f"{PACKAGE}.{a.name}" if a.name in MODULES else PACKAGE for a in node.names]
    return [base]


def _imports(module: str) -> tuple[list[str], list[str], list[tuple[int, str]]]:
    """(runtime module-level imports, typing-only imports, (line, name) of nested imports)."""
    name = "__init__" if module == PACKAGE else module
    tree = ast.parse((PACKAGE_DIR / f"{name}.py").read_text(), filename=f"{name}.py")
    runtime: list[str] = []
    typing_only: list[str] = []
    top: set[int] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            runtime += _targets(stmt, name)
            top.add(id(stmt))
        elif _is_type_checking(stmt):
            for sub in stmt.body:
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    typing_only += _targets(sub, name)
                    top.add(id(sub))
    nested = [
        (n.lineno, t)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top
        for t in _targets(n, name)
    ]
    return runtime, typing_only, nested


ALL = [PACKAGE, *MODULES]


@pytest.mark.parametrize("module", ALL)
def test_no_service_imports(module: str) -> None:
    runtime, typing_only, nested = _imports(module)
    bad = [t for t in runtime + typing_only + [n for _, n in nested] if t.startswith(FORBIDDEN)]
    assert not bad, f"{module} imports {bad}: compression must not depend on the service"


@pytest.mark.parametrize("module", ALL)
def test_no_function_level_imports(module: str) -> None:
    _, _, nested = _imports(module)
    assert not nested, f"{module} imports inside a function or class: {nested}"


def test_module_imports_form_a_dag() -> None:
    graph = {
        m: {t.removeprefix(f"{PACKAGE}.") for t in _imports(m)[0] if t.startswith(f"{PACKAGE}.")}
        for m in MODULES
    }
    for m in MODULES:  # no submodule may import the package itself (its __init__)
        assert PACKAGE not in _imports(m)[0], f"{m} imports {PACKAGE} (__init__)"
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        for dep in sorted(graph[m]):
            visit(dep, [*path, m])
        done.add(m)

    for m in MODULES:
        visit(m, [])
    assert graph["base"].isdisjoint({"spec", "registry", "quantizers", "sparsifiers"})


_ISOLATED = """
import importlib, json, sys, types
pkg = types.ModuleType("gossipgrad.compression")
pkg.__path__ = [sys.argv[1]]
sys.modules["gossipgrad.compression"] = pkg  # bypass __init__: only the module's own imports
mod = importlib.import_module("gossipgrad.compression." + sys.argv[2])
registry = getattr(mod, "REGISTRY", None)
print(json.dumps({
    "loaded": sorted(m for m in sys.modules if m.startswith("gossipgrad.")),
    "registry": sorted(registry) if registry is not None else None,
}))
"""


def _import_alone(module: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _ISOLATED, str(PACKAGE_DIR), module],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_each_module_imports_alone() -> None:
    """One fresh interpreter per module (a few at a time: each one imports torch)."""
    reports, errors = {}, {}
    for lo in range(0, len(MODULES), 4):
        procs = {m: _import_alone(m) for m in MODULES[lo : lo + 4]}
        for m, proc in procs.items():
            out, err = proc.communicate(timeout=90)
            if proc.returncode:
                errors[m] = err.strip().splitlines()[-1:]
            else:
                reports[m] = json.loads(out.strip().splitlines()[-1])
    assert not errors, errors
    for m, report in reports.items():
        assert f"{PACKAGE}.{m}" in report["loaded"]
        assert not [x for x in report["loaded"] if x.startswith(FORBIDDEN)], m
    # parsing alone sees every codec: spec imports the modules that fill the registry
    assert reports["spec"]["registry"] == sorted(REGISTRY)
