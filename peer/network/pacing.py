"""A byte-rate limit shared by every state download one server streams: a token bucket.

A donor serving its state to joiners must not give its whole uplink to them (its own gossip
pushes share it), however many joiners come at once. :class:`BytePacer` holds ``rate`` bytes
per second with a capacity of ``burst`` bytes; each chunk takes its size from the bucket
before it is sent, and waits while the bucket is short. The bucket is shared by all downloads
of one server, so the limit is per donor, not per download: two joiners at once get about
half the rate each. Waiting is by reservation (tokens may go negative), so chunks leave in
the order they asked and a download of ``S`` bytes takes at least ``(S - burst) / rate``
seconds.

Example::

    pacer = BytePacer(rate=10e6, burst=1 << 20)   # 10 MB/s, one 1 MiB chunk of burst
    for chunk in chunks:
        time.sleep(pacer.reserve(len(chunk)))
        send(chunk)
"""

from __future__ import annotations

import threading
import time


class BytePacer:
    """Token bucket of bytes: :meth:`reserve` says how long to wait before sending.

    Args:
        rate: sustained bytes per second (0: unlimited, :meth:`reserve` always returns 0).
        burst: bucket capacity in bytes (what a quiet donor may send at once).
    """

    def __init__(self, rate: float, burst: int) -> None:
        if rate < 0 or burst < 1:
            raise ValueError(f"need rate >= 0 and burst >= 1, got {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    @property
    def limited(self) -> bool:
        """Whether a rate is set at all."""
        return self.rate > 0

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket; the seconds to wait before sending them (0 if the
        bucket held enough). The reservation stands even if the caller gives up."""
        if not self.limited:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self.rate)
