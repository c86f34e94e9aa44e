"""What the runner samples from a running swarm: each peer's training history from its
status.json, and (local mode) the bytes per neighbour from its Prometheus endpoint."""

from __future__ import annotations

import contextlib
import time
import urllib.request

from gossipgrad.experiment.records import Sample
from gossipgrad.peer.records import PeerStatus
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_EVERY_S = 2.0
# Daemon states in which a peer is working (training, or gossip-only final rounds).
ACTIVE_STATES = ("training", "final-rounds")
_EDGE_COUNTERS = {
    "gossipgrad_sent_bytes_total": "sent",
    "gossipgrad_received_bytes_total": "received",
}

EdgeBytes = dict[str, dict[str, int]]


def edge_bytes(exposition: str) -> EdgeBytes:
    """Bytes per neighbour in a peer's Prometheus text exposition:
    ``{neighbour: {"sent": n, "received": n}}`` summed over message kinds."""
    out: EdgeBytes = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            direction = _EDGE_COUNTERS.get(sample.name)
            if direction is None:
                continue
            entry = out.setdefault(sample.labels.get("neighbor", "?"), {"sent": 0, "received": 0})
            entry[direction] += int(sample.value)
    return out


def scrape_edge_bytes(port: int, timeout: float = 1.0) -> EdgeBytes:
    """:func:`edge_bytes` of the peer whose Prometheus endpoint is on 127.0.0.1:``port``."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return edge_bytes(resp.read().decode())


class SwarmSampler:
    """Collects a swarm's history as the runner polls its statuses (``sample`` per poll).

    Args:
        n: number of peers.
        scrape: also read bytes per neighbour from each working peer's metrics endpoint
            (local mode: the endpoints are on 127.0.0.1), at most every ``SCRAPE_EVERY_S``.
    """

    def __init__(self, n: int, scrape: bool) -> None:
        self.scrape = scrape
        self.history: list[list[Sample]] = [[] for _ in range(n)]
        self.edges: dict[int, EdgeBytes] = {}
        self._last_scrape = 0.0

    def sample(self, statuses: list[PeerStatus]) -> None:
        """Record one poll: a new history point per working peer, and maybe a scrape."""
        for i, s in enumerate(statuses):
            if s.state in ACTIVE_STATES and s.loss is not None and s.time is not None:
                self._record(self.history[i], s)
        now = time.monotonic()
        if self.scrape and now - self._last_scrape > SCRAPE_EVERY_S:
            self._last_scrape = now
            self._scrape(statuses)

    @staticmethod
    def _record(history: list[Sample], s: PeerStatus) -> None:
        if history and history[-1].time == s.time:
            return  # the peer has not written a new status since the last poll
        history.append(
            Sample(
                step=s.step,
                loss=s.loss,
                sent_bytes=s.sent_bytes,
                received_bytes=s.received_bytes,
                time=s.time,
                consensus_distance=s.consensus_distance,
            )
        )

    def _scrape(self, statuses: list[PeerStatus]) -> None:
        for i, s in enumerate(statuses):
            if s.metrics_port and s.state in ACTIVE_STATES:
                with contextlib.suppress(OSError, ValueError):  # not up, or cut short
                    self.edges[i] = scrape_edge_bytes(s.metrics_port)
