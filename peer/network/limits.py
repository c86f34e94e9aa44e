"""Per-peer admission control of the gossip server: concurrent calls and call rate.

One misbehaving or hostile client must not starve honest neighbours of server threads. Each
caller (its certificate identity under TLS, else its claimed id or address) gets at most
``max_streams`` calls in flight and a token bucket of ``rate`` calls per second with ``burst``
capacity. A refused call costs the server a dictionary lookup, no buffer and no decode.
"""

from __future__ import annotations

import dataclasses
import threading
import time

#: Callers remembered at most; idle ones are forgotten first (bounds memory under a flood of
#: distinct identities or addresses).
MAX_TRACKED = 4096


@dataclasses.dataclass
class _Caller:
    in_flight: int = 0
    tokens: float = 0.0
    stamp: float = 0.0


class PeerLimiter:
    """Counts calls per caller key; :meth:`enter` admits or refuses, :meth:`leave` releases.

    Args:
        max_streams: calls one caller may have in flight (0: unlimited).
        rate: sustained calls per second per caller (0: unlimited).
        burst: token-bucket capacity (calls a quiet caller may make at once).
    """

    def __init__(self, max_streams: int, rate: float, burst: int) -> None:
        if max_streams < 0 or rate < 0 or burst < 1:
            raise ValueError("need max_streams >= 0, rate >= 0 and burst >= 1")
        self.max_streams = max_streams
        self.rate = rate
        self.burst = burst
        self._callers: dict[str, _Caller] = {}
        self._lock = threading.Lock()

    def enter(self, key: str) -> str | None:
        """Admit one call of ``key``: None if admitted (call :meth:`leave` later), else why not."""
        now = time.monotonic()
        with self._lock:
            c = self._callers.get(key)
            if c is None:
                if len(self._callers) >= MAX_TRACKED:
                    self._forget_idle()
                c = self._callers[key] = _Caller(tokens=float(self.burst), stamp=now)
            if self.rate > 0:
                c.tokens = min(float(self.burst), c.tokens + (now - c.stamp) * self.rate)
            c.stamp = now
            if self.max_streams and c.in_flight >= self.max_streams:
                return f"{c.in_flight} calls in flight, limit {self.max_streams} per peer"
            if self.rate > 0:
                if c.tokens < 1.0:
                    return f"more than {self.rate:g} calls/s (burst {self.burst}) from one peer"
                c.tokens -= 1.0
            c.in_flight += 1
            return None

    def leave(self, key: str) -> None:
        """Release a call admitted by :meth:`enter`."""
        with self._lock:
            c = self._callers.get(key)
            if c is not None and c.in_flight > 0:
                c.in_flight -= 1

    def in_flight(self, key: str) -> int:
        """Calls of ``key`` now admitted (for tests and debugging)."""
        with self._lock:
            c = self._callers.get(key)
            return c.in_flight if c is not None else 0

    def _forget_idle(self) -> None:
        idle = sorted((c.stamp, k) for k, c in self._callers.items() if c.in_flight == 0)
        for _, k in idle[: max(1, len(idle) // 2)]:
            del self._callers[k]
