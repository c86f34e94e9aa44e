"""The gossip core must never break silently: the cases a review found that once lost
consensus without any error, each with real peers on 127.0.0.1.

The detector in every test is the same pair of laws: every edge's mirror equals the other
end's public copy bit for bit with both ends having mixed the same exchanges, and the swarm's
average is preserved (one-sided mixing moves it).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from gossipgrad.peer.network import TransportError
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.proto import gossip_pb2 as pb
from peer_harness import close_all, quiesce, run_rounds, start_peer, start_peers, wait_until_met
from test_choco import assert_mirrors_exact, distance

pytestmark = pytest.mark.timeout(120)

GOSSIP = {"gossip.codec": "topk:0.2+int8", "gossip.gamma": 0.3, "gossip.round_timeout": 5.0}


def mean(peers: list[Peer]) -> torch.Tensor:
    return torch.stack([p.flat.data for p in peers]).double().mean(0)


def assert_symmetric(peers: list[Peer]) -> None:
    """Both ends of every edge mixed the same exchanges, and every update that landed left
    the receiver's mirror equal to the sender's public copy (one may still be in flight)."""
    by_id = {p.id: p for p in peers}
    for p in peers:
        for q, edge in p.algorithm.edges.items():
            other = by_id[q].algorithm.edges[p.id]
            assert edge.epoch == other.epoch and edge.mixed == other.mixed, (p.id, q)
            if other.received == edge.sent:
                assert torch.equal(other.mirror, edge.public), (p.id, q)


def assert_average_kept(peers: list[Peer], before: torch.Tensor, d0: float) -> None:
    """Symmetric mixing keeps the average up to float rounding; one-sided mixing moves it by
    a fraction of the spread."""
    drift = float((mean(peers) - before).norm())
    edges = {
        (p.id, q): (e.epoch % 1000, e.sent, e.acked, e.received, e.mixed, e.weight())
        for p in peers
        for q, e in p.algorithm.edges.items()
    }
    assert drift < 1e-4 * d0**0.5, f"drift {drift} (spread {d0}): {sorted(edges.items())}"


@pytest.mark.parametrize("staleness", [0, 1])
def test_both_ends_mix_the_same_copies_under_either_staleness(staleness: int) -> None:
    peers = start_peers(4, {**GOSSIP, "gossip.max_staleness": staleness})
    try:
        m0, d0 = mean(peers), distance(peers)
        run_rounds(peers, 20)
        quiesce(peers)
        assert assert_mirrors_exact(peers) == 8
        assert distance(peers) < d0 / 5
        assert_average_kept(peers, m0, d0)
    finally:
        close_all(peers)


def test_edge_reset_at_one_end_only_opens_a_new_session_at_both() -> None:
    """A partition of about dead_after: p0 declared p1 dead and pruned the edge, p1 only
    suspected p0 and kept it. p0's fresh edge must not be taken for the old stream."""
    peers = start_peers(2, GOSSIP)
    p0, p1 = peers
    try:
        run_rounds(peers, 8)
        quiesce(peers)
        old = p1.algorithm.edges["p0"].epoch
        p0.algorithm.prune({"p0"})  # as p0's membership does for a dead peer
        assert "p1" not in p0.algorithm.edges
        m0, d0 = mean(peers), distance(peers)
        run_rounds(peers, 8)
        quiesce(peers)
        assert p1.algorithm.edges["p0"].epoch != old  # a new session at both ends
        assert assert_mirrors_exact(peers) == 2
        assert p1.algorithm.edges["p0"].mixed > 3  # and the edge mixes again
        assert_average_kept(peers, m0, d0)
    finally:
        close_all(peers)


class FailingSender:
    """Fails the 3rd and 4th DELTA pushes to p1 before they reach it, with a gRPC status."""

    def __init__(self, real, code: grpc.StatusCode) -> None:
        self.real, self.code, self.n = real, code, 0

    def push(self, target: str, header: pb.UpdateHeader, payload: bytes):
        if target == "p1" and header.kind == pb.DELTA:
            self.n += 1
            if self.n in (3, 4):
                raise TransportError(self.code, "injected", "injected failure")
        return self.real.push(target, header, payload)


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ],
)
def test_a_failed_push_is_retried_and_never_mixed(code: grpc.StatusCode) -> None:
    peers = start_peers(3, GOSSIP)
    try:
        peers[0].neighbourhood.sender = FailingSender(peers[0].neighbourhood.sender, code)
        m0, d0 = mean(peers), distance(peers)
        run_rounds(peers, 12)
        quiesce(peers)
        assert peers[0].neighbourhood.sender.n > 4
        assert assert_mirrors_exact(peers) == 6
        assert_average_kept(peers, m0, d0)
        edge = peers[0].algorithm.edges["p1"]
        assert edge.restarts <= 1  # the opening only: a retry needs no resync
    finally:
        close_all(peers)


def test_peers_that_disagree_on_the_topology_never_mix_one_sidedly() -> None:
    """p0 computes a full graph, the others a ring of 4: p0 believes p2 is its neighbour, p2
    does not. Both ends must agree on weight 0 for that edge."""
    peers = [start_peer("p0", [], 100, {**GOSSIP, "gossip.topology": "full"})]
    for i in range(1, 4):
        peers.append(start_peer(f"p{i}", [peers[0].address], 100 + i, GOSSIP))
    try:
        wait_until_met(peers)
        m0, d0 = mean(peers), distance(peers)
        run_rounds(peers, 15)
        quiesce(peers)
        assert distance(peers) < d0
        assert_average_kept(peers, m0, d0)
        edge = peers[0].algorithm.edges.get("p2")
        assert edge is not None and edge.sent > 0  # p0 did send to p2
        assert edge.weight() == 0.0  # ... and p2 refused to mix it, so p0 did not either
    finally:
        close_all(peers)


def test_a_peer_that_ran_ahead_is_caught_up_with_not_mixed_one_sidedly() -> None:
    """p1 starts its rounds late: round counters differ by many rounds, which once made p0
    hold p1's updates or mix stale copies."""
    peers = start_peers(2, {**GOSSIP, "gossip.round_timeout": 0.5})
    p0, p1 = peers
    try:
        m0, d0 = mean(peers), distance(peers)
        ahead = threading.Thread(target=lambda: [p0.algorithm.step_round() for _ in range(10)])
        ahead.start()
        ahead.join(30)
        assert p0.algorithm.round == 10 and p1.algorithm.round == 0
        # p0 may run through its rounds before p1's first update lifts the "lagging" mark (a
        # known limit, it trains alone meanwhile); what must hold is that nothing is mixed
        # one-sidedly and the edge mixes again.
        run_rounds(peers, 30)
        quiesce(peers)
        assert_symmetric(peers)
        assert_average_kept(peers, m0, d0)
        assert p0.algorithm.edges["p1"].mixed >= 1
    finally:
        close_all(peers)


def test_model_larger_than_the_payload_cap_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_payload_bytes"):
        start_peer("p0", [], 1, {"transport.max_payload_bytes": 1 << 16}, widths=(200, 100, 5))


def test_a_failing_heartbeat_round_does_not_stop_heartbeats() -> None:
    p0 = start_peer("p0", [], 1, GOSSIP)
    p1 = start_peer("p1", [p0.address], 2, GOSSIP)
    try:
        wait_until_met([p0, p1])
        calls = {"n": 0}
        real = p1.membership._near

        def broken_once(ids):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return real(ids)

        p1.membership._near = broken_once
        time.sleep(1.0)
        assert calls["n"] > 2  # the loop went on after the exception
        assert p0.membership.is_alive("p1") and p1.membership.is_alive("p0")
    finally:
        close_all([p0, p1])
