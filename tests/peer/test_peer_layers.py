"""The peer's sub-packages import only downwards, and its modules form a DAG.

Layers, top to bottom: ``runtime`` (what runs a peer) → ``algorithms`` → ``membership`` and
``network`` → ``config``; ``tasks`` sits beside them (it needs only the config). Static
checks parse every module with ``ast``; an import inside a function counts (it runs too), an
import under ``if TYPE_CHECKING:`` does not (it never runs). Importing ``a.b.c`` also runs the
``__init__`` of ``a.b``, so the graph has an edge to every package above the target that is
not above the importer as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.timeout(60)

PEER = ROOT / "peer"
PACKAGE = "gossipgrad.peer"

# Sub-package -> the sub-packages (and modules) of the peer it may not import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "algorithms": ("runtime", "cli"),
    "membership": ("runtime", "algorithms", "network", "tasks", "cli", "config"),
    "network": ("runtime", "algorithms", "membership", "tasks", "cli"),
    "tasks": ("runtime", "algorithms", "network", "membership", "cli"),
    "config": ("runtime", "algorithms", "network", "tasks", "cli"),
}


def module_name(path: Path) -> str:
    """Dotted name of a file under peer/ (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(PEER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def run_time_imports(source: str, modules: set[str]) -> set[str]:
    """The peer modules an import statement of ``source`` loads when it runs (``from pkg
    import name`` loads ``pkg.name`` when that is a module, else ``pkg``); imports under
    ``if TYPE_CHECKING:`` left out."""
    skipped: set[int] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if _is_type_checking(node):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return {m for m in out if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(2, len(parts))]


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules importing it runs: its imports' targets and their packages."""
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        mine = {*_ancestors(name), name}
        edges: set[str] = set()
        for target in run_time_imports(source, modules):
            edges.update(t for t in [*_ancestors(target), target] if t in modules)
        graph[name] = edges - mine
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None for a DAG."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for dep in sorted(graph.get(node, ())):
            if cycle := visit(dep, [*path, node]):
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        if cycle := visit(node, []):
            return cycle
    return None


def peer_sources() -> dict[str, str]:
    files = sorted(p for p in PEER.rglob("*.py") if "_pb2" not in p.name)
    assert files, f"no modules under {PEER}"
    return {module_name(p): p.read_text() for p in files}


def test_the_checker_resolves_imports_and_finds_cycles() -> None:
    modules = {f"{PACKAGE}.a", f"{PACKAGE}.a.x", f"{PACKAGE}.b"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "from gossipgrad.peer.a import x\n"
        "from gossipgrad.peer import b\n"
        "if TYPE_CHECKING:\n    from gossipgrad.peer.c import C\n"
        "def late():\n    import gossipgrad.peer.d\n"
    )
    found = run_time_imports(source, modules)
    assert found == {f"{PACKAGE}.a.x", f"{PACKAGE}.b", f"{PACKAGE}.d"}
    # a.x's package __init__ runs too; the cycle goes through it
    graph = import_graph(
        {
            f"{PACKAGE}.a": "import gossipgrad.peer.a.x\n",
            f"{PACKAGE}.a.x": "import gossipgrad.peer.b\n",
            f"{PACKAGE}.b": "def late():\n    from gossipgrad.peer.a.x import f\n",
        }
    )
    assert graph[f"{PACKAGE}.a.x"] == {f"{PACKAGE}.b"}  # its own package is no edge
    a, ax, b = f"{PACKAGE}.a", f"{PACKAGE}.a.x", f"{PACKAGE}.b"
    assert graph[b] == {a, ax}
    assert find_cycle(graph) == [a, ax, b, a]
    graph[b] = set()
    assert find_cycle(graph) is None


def test_peer_modules_form_a_dag() -> None:
    graph = import_graph(peer_sources())
    assert len(graph) > 40
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize("sub", sorted(FORBIDDEN))
def test_sub_package_imports_only_downwards(sub: str) -> None:
    sources = peer_sources()
    modules = set(sources)
    banned = tuple(f"{PACKAGE}.{b}" for b in FORBIDDEN[sub])
    inside = [m for m in sources if m == f"{PACKAGE}.{sub}" or m.startswith(f"{PACKAGE}.{sub}.")]
    assert inside, f"no modules in {sub}"
    bad = {
        m: found
        for m in inside
        if (
            found := sorted(
                t
                for t in run_time_imports(sources[m], modules)
                if any(t == b or t.startswith(b + ".") for b in banned)
            )
        )
    }
    assert bad == {}
