"""Helpers shared by the tests, imported one way: ``from support.X import ...`` (the tests
folder is on the path: ``pythonpath`` in pyproject.toml). Scripts here also run as processes.
Fixtures the tests share are in ``tests/conftest.py``."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""The tests folder (on ``PYTHONPATH`` for peers that import ``support.*`` task factories)."""
ROOT = TESTS.parent
"""The repository root."""
