"""One clear middle layer: the experiment side launches processes and reads the peers'
records; it imports nothing of what runs a peer (``gossipgrad.peer.runtime``: the daemon's
loop, ``Peer``, ``GossipOptimizer``), and the peer never imports it. The layers inside the peer
are tests/peer/test_peer_layers.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import ROOT

pytestmark = pytest.mark.timeout(60)

# Module -> what it may not import (a module or anything inside it).
FORBIDDEN = {
    # gossipgrad.peer re-exports the runtime's classes lazily: those names count as the runtime.
    ROOT / "scripts" / "experiment": (
        "gossipgrad.peer.runtime",
        *(
            f"gossipgrad.peer.{name}"
            for name in ("Daemon", "GossipOptimizer", "Peer", "SiteOptimizer")
        ),
    ),
    ROOT / "peer": ("gossipgrad.experiment",),
}


RUNTIME = "gossipgrad.peer.runtime"
DAEMON = "gossipgrad.peer.runtime.daemon"
TRAIN_CLOCK = "gossipgrad.peer.runtime.daemon.TrainClock"


def imported_modules(source: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, also ``from pkg import mod``
    as ``pkg.mod`` (a module imported that way is an import of it)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def violations(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        m for m in imported_modules(source) for f in forbidden if m == f or m.startswith(f + ".")
    )


def test_the_checker_sees_every_import_form() -> None:
    forbidden = (RUNTIME,)
    late = "def late():\n    from gossipgrad.peer.runtime.daemon import TrainClock\n"
    assert violations(late, forbidden) == [DAEMON, TRAIN_CLOCK]
    assert violations("import gossipgrad.peer.runtime.daemon as d", forbidden) == [DAEMON]
    assert violations("from gossipgrad.peer.runtime import daemon", forbidden) == [RUNTIME, DAEMON]
    assert violations("from gossipgrad.peer import runtime, config", forbidden) == [RUNTIME]
    assert violations("from gossipgrad.peer.tasks.training import TrainClock", forbidden) == []
    assert violations("import gossipgrad.peer.runtimes", forbidden) == []
    experiment = FORBIDDEN[ROOT / "scripts" / "experiment"]
    assert violations("from gossipgrad.peer import GossipOptimizer", experiment) == [
        "gossipgrad.peer.GossipOptimizer"
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN), ids=lambda p: p.name)
def test_no_module_imports_across_the_layer(package: Path) -> None:
    files = sorted(package.rglob("*.py"))
    assert files, f"no modules under {package}"
    bad = {
        str(f.relative_to(ROOT)): found
        for f in files
        if (found := violations(f.read_text(), FORBIDDEN[package]))
    }
    assert bad == {}
