"""Heap trims after rounds: each round for a large model, now and then for a small one."""

from __future__ import annotations

import pytest
from gossipgrad.peer.network import malloc

pytestmark = pytest.mark.timeout(30)


class CountingLibc:
    """Counts malloc_trim calls (the real one returns memory; what is tested is when)."""

    def __init__(self) -> None:
        self.trims = 0

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


def test_a_trim_within_every_seconds_of_the_last_is_skipped(monkeypatch) -> None:
    libc = CountingLibc()
    monkeypatch.setattr(malloc, "_libc", lambda: libc)
    monkeypatch.setattr(malloc, "_trimmed_at", -float("inf"))
    clock = [100.0]
    monkeypatch.setattr(malloc.time, "monotonic", lambda: clock[0])
    malloc.trim_malloc(1.0)
    malloc.trim_malloc(1.0)  # the same instant: skipped
    clock[0] += 0.5
    malloc.trim_malloc(1.0)  # half a second on: skipped
    assert libc.trims == 1
    malloc.trim_malloc()  # every = 0: always
    assert libc.trims == 2
    clock[0] += 1.0
    malloc.trim_malloc(1.0)
    assert libc.trims == 3
