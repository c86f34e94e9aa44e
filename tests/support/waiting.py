"""Polling for a condition with a deadline, as tests of running processes need."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    """Return once ``predicate()`` is true; AssertionError naming ``what`` after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
