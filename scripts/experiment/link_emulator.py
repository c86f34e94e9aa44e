"""Many relays (``link_relay``) served by one asyncio loop in one background thread.

Why asyncio: a swarm of n sites needs n(n-1) relays, each connection two directions and a
timer per chunk. One event loop in one thread serves them all, with timers accurate to about
a millisecond (epoll); threads per direction would mean hundreds of OS threads contending
for the GIL with no better timing. One loop is also one place to cancel everything on close,
and its thread's CPU time (``LinkEmulator.cpu_seconds``) is the emulator's whole cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from gossipgrad.experiment.link_path import LinkPath, Stage
from gossipgrad.experiment.link_relay import CLOSE_TIMEOUT_S, Relay, Upstream

log = logging.getLogger(__name__)


class LinkEmulator:
    """Relays served by one asyncio loop in a background thread; ``with LinkEmulator() as e``.

    ``close()`` (also on an exception or Ctrl-C in the ``with`` body) stops every relay,
    aborts its connections, stops the loop and joins the thread: no thread or socket is left.
    """

    def __init__(self) -> None:
        self.relays: list[Relay] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cpu_seconds = 0.0

    def add(
        self, name: str, upstream: Upstream, forward: list[Stage] | LinkPath,
        reverse: list[Stage] | LinkPath, seed: int = 0,
    ) -> Relay:  # fmt: skip
        """A relay to ``upstream``; bound now if the emulator runs, else by ``start()``."""
        fwd = forward if isinstance(forward, LinkPath) else LinkPath(forward, seed)
        rev = reverse if isinstance(reverse, LinkPath) else LinkPath(reverse, seed + 1)
        relay = Relay(name, upstream, fwd, rev)
        self.relays.append(relay)
        if self._loop is not None:
            self._call(relay.start())
        return relay

    def _call(self, coro: Any, timeout: float = CLOSE_TIMEOUT_S) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> LinkEmulator:
        """Start the loop thread and bind every relay added so far."""
        if self._loop is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="link-emulator")
        self._thread.start()
        try:
            for relay in self.relays:
                self._call(relay.start())
        except BaseException:
            self.close()
            raise
        log.info("link emulator: %d relays", len(self.relays))
        return self

    def _serve(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._cpu_seconds = time.thread_time()

    def cpu_seconds(self) -> float:
        """CPU seconds the emulator's thread has used (its whole cost)."""
        if self._loop is None:
            return self._cpu_seconds

        async def read() -> float:
            return time.thread_time()

        return self._call(read())

    def stats(self) -> dict[str, Any]:
        return {r.name: r.stats() for r in self.relays}

    def close(self) -> None:
        """Stop every relay and the loop thread (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if thread.is_alive():
                with contextlib.suppress(Exception):
                    self._call(self._shutdown())
                loop.call_soon_threadsafe(loop.stop)
                thread.join(CLOSE_TIMEOUT_S)
        finally:
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    async def _shutdown(self) -> None:
        await asyncio.gather(*(r.close() for r in self.relays), return_exceptions=True)
        await asyncio.get_running_loop().shutdown_default_executor()

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
