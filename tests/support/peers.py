"""In-process peers for tests: real Peer objects, real gRPC servers on 127.0.0.1:0, and the
laws their edges must keep (mirrors exact, symmetric mixing).

Shared by the gossip, security and fuzz tests so each says only what it varies.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from gossipgrad.peer.algorithms.base import RoundStats
from gossipgrad.peer.algorithms.edges import Kind
from gossipgrad.peer.algorithms.wire_kinds import KINDS
from gossipgrad.peer.config import build_config
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.runtime.node import Peer
from torch import nn

from support.threads import on_threads

_STARTED: list[Peer] = []
"""Every peer started here, in order (the ``tests/conftest.py`` fixture closes those a test
started after it, passed or failed; a module-scoped fixture's peers are its own to close)."""


def started(peer: Peer) -> Peer:
    """Start ``peer`` and have it closed after the test (``close_started``)."""
    peer.start()
    _STARTED.append(peer)
    return peer


def started_count() -> int:
    """How many peers ``started`` has started so far (a mark for ``close_started``)."""
    return len(_STARTED)


def close_started(mark: int = 0) -> None:
    """Close every peer ``started`` after ``mark`` (closing twice is harmless)."""
    while len(_STARTED) > mark:
        _STARTED.pop().close()


FAST_MEMBERSHIP = {
    "metrics.enabled": False,
    "membership.heartbeat_interval": 0.1,
    "gossip.round_timeout": 3.0,
    # run_rounds runs rounds back to back with no compute between them, where "auto" would
    # take its largest bound; these tests state their laws per round at a fixed one.
    "gossip.max_staleness": 1,
}


def start_peer(
    pid: str,
    bootstrap: list[str],
    seed: int,
    overrides: dict[str, Any] | None = None,
    widths: tuple[int, int, int] = (40, 30, 5),
) -> Peer:
    """Start one peer whose small MLP is initialised from `seed` (peers differ by seed)."""
    torch.manual_seed(seed)
    a, b, c = widths
    flat = FlatParameters(nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, c)))
    cfg = build_config(
        {},
        {"peer.id": pid, "peer.bootstrap": bootstrap, **FAST_MEMBERSHIP, **(overrides or {})},
    )
    return started(Peer(cfg, flat))


def wait_until_met(peers: list[Peer], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(len(p.membership.present_ids()) < len(peers) for p in peers):
        assert time.monotonic() < deadline, "peers did not discover each other"
        time.sleep(0.05)


def start_peers(
    n: int,
    overrides: dict[str, Any] | None = None,
    seed: int = 100,
    widths: tuple[int, int, int] = (40, 30, 5),
) -> list[Peer]:
    """Peers p0..p{n-1}, all bootstrapping from p0, once they all know each other."""
    peers: list[Peer] = []
    for i in range(n):
        bootstrap = [peers[0].address] if peers else []
        peers.append(start_peer(f"p{i}", bootstrap, seed + i, overrides, widths))
    wait_until_met(peers)
    return peers


def run_rounds(
    peers: list[Peer], rounds: int, timeout: float = 100.0, end: bool = True
) -> list[RoundStats]:
    """Every peer runs `rounds` gossip rounds on its own thread, as training threads would,
    then (``end``) finishes, after which it exchanges nothing more; returns every round's
    stats (all peers, in no particular order)."""
    stats: list[RoundStats] = []

    def work(p: Peer) -> None:
        for _ in range(rounds):
            stats.append(p.algorithm.step_round())
        if end:
            p.algorithm.finish()  # as a daemon does at the end: mix what is still open

    on_threads(work, [(p,) for p in peers], timeout)
    return stats


def quiesce(peers: list[Peer], timeout: float = 10.0) -> None:
    """Wait until no push is in flight."""
    deadline = time.monotonic() + timeout
    while any(e.busy for p in peers for e in p.algorithm.edges.values()):
        assert time.monotonic() < deadline, "pushes still in flight"
        time.sleep(0.02)
    time.sleep(0.1)


def rejected(peer: Peer, reason: str) -> float:
    """gossipgrad_rejected_updates_total{reason} of a peer."""
    value = peer.metrics.registry.get_sample_value(
        "gossipgrad_rejected_updates_total", {"reason": reason}
    )
    return value or 0.0


def distance(peers: list[Peer]) -> float:
    xs = torch.stack([p.flat.data for p in peers]).double()
    return float(((xs - xs.mean(0)) ** 2).sum(1).mean())


def assert_mirrors_exact(peers: list[Peer]) -> int:
    """Every edge i<->j: one session at both ends, j's mirror == i's public copy bit for bit,
    and both ends have mixed the same exchanges. Returns the directed edge count.

    At the end of a run (``finish``) i's last update may never reach j once j has finished
    and i has mixed every exchange j completes (a push lost on a loaded host is not retried
    then): that exchange is left open, mixed at neither end, and j's mirror with that update
    applied is i's public copy."""
    by_id = {p.id: p for p in peers}
    checked = 0
    for p in peers:
        for peer_id, edge in p.algorithm.edges.items():
            other = by_id[peer_id].algorithm.edges.get(p.id)
            assert other is not None, f"edge {p.id}->{peer_id} has no other end"
            assert edge.epoch == other.epoch != 0, f"edge {p.id}<->{peer_id}: two sessions"
            mirror = other.mirror
            if other.received == edge.sent - 1 and edge.unacked is not None:
                assert edge.mixed == other.mixed == other.received, (p.id, peer_id, "open")
                header, payload = edge.unacked
                copies = by_id[peer_id].algorithm.copies
                assert KINDS[header.kind] is Kind.DELTA, (p.id, peer_id, header.kind)
                mirror = mirror.clone()
                copies.codec.decode_add_(payload, mirror, cast=True)
            else:
                assert other.received == edge.sent > 0, (p.id, peer_id, edge.sent, other.received)
            assert torch.equal(mirror, edge.public), f"edge {p.id}->{peer_id} diverged"
            assert edge.mixed == other.mixed, f"edge {p.id}<->{peer_id} mixed one-sidedly"
            checked += 1
    return checked


def resyncs(peer: Peer, neighbor: str) -> float:
    return (
        peer.metrics.registry.get_sample_value("gossipgrad_resyncs_total", {"neighbor": neighbor})
        or 0.0
    )
