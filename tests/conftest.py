"""Fixtures every test folder shares.

Helpers live in ``support/`` (imported as ``from support.X import ...``: the tests folder is on
the path); what needs a test's lifetime (set up before, torn down after, on failure too) is a
fixture here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from support import ROOT, TESTS
from support.peers import close_started, started_count


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a ``slow`` test (the long multi-process runs) first, each file's tests in
    their order: ``make test`` hands whole files to its workers (pytest-xdist,
    ``--dist loadfile``), so the long files start at once and the many short ones fill in
    around them instead of one long file running alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def _close_started_peers() -> Iterator[None]:
    """In-process peers a test started through ``support.peers`` are closed after it, passed
    or failed, so no gRPC server or thread outlives the test that made it. Fixtures of a wider
    scope are set up before this one, so their peers come before the mark and stay open."""
    mark = started_count()
    yield
    close_started(mark)


@pytest.fixture
def support_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``support.*`` task factories importable here and in peer processes this test starts
    (``train.task = "support.tiny_lm_task:make_task"``), freshly imported."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    for name in [m for m in sys.modules if m.startswith("support.tiny_")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The repository's ``scripts/`` importable (the benchmark and dashboard scripts)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
