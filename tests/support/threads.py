"""Work that peers do at the same time, each on its own thread, as their training threads do
(a gossip round needs its neighbours in theirs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


def on_threads(work: Callable[..., Any], args: Iterable[tuple], timeout: float = 60.0) -> None:
    """Run ``work(*a)`` for every ``a`` at once, one thread each, and wait for all of them.

    Raises:
        AssertionError: a thread raised (every error listed), or one was still running after
            ``timeout`` seconds in all.
    """
    errors: list[BaseException] = []

    def run(*a: Any) -> None:
        try:
            work(*a)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=a, daemon=True) for a in args]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"still running after {timeout} s"


def at_once(*fns: Callable[[], Any], timeout: float = 60.0) -> None:
    """Run each of ``fns`` on its own thread at the same time (``on_threads``)."""
    on_threads(lambda fn: fn(), [(fn,) for fn in fns], timeout)
