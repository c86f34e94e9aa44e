"""One gossip round at a time on a thread of its own, so the training thread computes while
the round encodes, waits for its neighbours and mixes (``gossip.background_rounds``).

The training thread hands a round over (:meth:`BackgroundRound.start`) and goes on; before it
hands over the next one it waits for the last (:meth:`wait`), so at most one round runs and
the rounds stay in order. A round's error is raised in the training thread at that wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundRound(Generic[T]):
    """Runs one call at a time on a daemon thread; :meth:`wait` returns its result."""

    def __init__(self, name: str = "gossip-round") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._result: T | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, call: Callable[[], T]) -> None:
        """Run ``call`` in the background (after the last one finished: ``wait`` first)."""
        if self._thread is not None:
            raise RuntimeError("a round is still handed over: wait() for it first")

        def run() -> None:
            try:
                self._result = call()
            except BaseException as err:  # raised at wait(), in the training thread
                self._error = err

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()

    def wait(self) -> T | None:
        """The last round's result once it finished (None if none was handed over); raises
        its error."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        result, error, self._result, self._error = self._result, self._error, None, None
        if error is not None:
            raise error
        return result
