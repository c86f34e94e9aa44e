"""Receive buffers of the gossip server, reused between pushes.

Allocating (and page-faulting) a fresh buffer per large push costs more CPU than receiving
it, so the server keeps released buffers up to a byte budget and hands them out again.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)


class BufferPool:
    """Receive buffers reused across calls, up to ``max_bytes`` kept idle.

    A buffer comes back with :meth:`release`; it is kept only if nothing else references it,
    checked with the reference count: every memoryview, numpy array or slice sharing its memory
    holds a reference to it, so a handler that keeps the payload keeps its buffer out of reuse.
    Thread-safe.
    """

    #: Buffers are allocated in multiples of this, so sizes that vary a little share buffers.
    GRANULE = 1 << 20

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: list[bytearray] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._solo_refs = self._calibrate()

    def _calibrate(self) -> int:
        probe = bytearray(1)
        return self._count_like_release(probe)

    def _count_like_release(self, buf: bytearray) -> int:
        return self._refs_seen_by_release(buf)

    def _refs_seen_by_release(self, buf: bytearray) -> int:
        # Reached from release() and via _count_like_release() from _calibrate() through the
        # same number of frames, so a buffer nobody else references counts as calibrated.
        return sys.getrefcount(buf)

    def acquire(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (contents undefined)."""
        if self.max_bytes and size > 0:
            with self._lock:
                best = None
                for i, buf in enumerate(self._idle):
                    if len(buf) >= size and (best is None or len(buf) < len(self._idle[best])):
                        best = i
                if best is not None:
                    buf = self._idle.pop(best)
                    self._idle_bytes -= len(buf)
                    return buf
            size = -(-size // self.GRANULE) * self.GRANULE
        return bytearray(size)

    def release(self, buf: bytearray) -> bool:
        """Offer ``buf`` back for reuse; returns whether it was kept.

        The caller must hold no other reference (views included) besides ``buf`` itself.
        """
        if not self.max_bytes or len(buf) == 0 or len(buf) > self.max_bytes:
            return False
        if self._refs_seen_by_release(buf) > self._solo_refs:
            log.debug("receive buffer of %d bytes still referenced; not reused", len(buf))
            return False
        with self._lock:
            self._idle.append(buf)
            self._idle_bytes += len(buf)
            while self._idle_bytes > self.max_bytes:
                # Drop the smallest first: big buffers are the costly ones to refault.
                smallest = min(range(len(self._idle)), key=lambda i: len(self._idle[i]))
                self._idle_bytes -= len(self._idle.pop(smallest))
            return any(b is buf for b in self._idle)

    @property
    def idle_bytes(self) -> int:
        """Bytes held in idle buffers."""
        return self._idle_bytes
