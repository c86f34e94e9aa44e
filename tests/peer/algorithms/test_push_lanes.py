"""Push lanes (Neighbourhood.submit_in_order) over live but slow uplinks: bounded, in order,
taking turns, and never holding every worker of the push pool."""

from __future__ import annotations

import threading
import time

import pytest
from gossipgrad.peer.algorithms import Identity, Neighbourhood
from gossipgrad.peer.algorithms.neighbours import MAX_LANE
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.peer.metrics import PeerMetrics
from prometheus_client import CollectorRegistry
from support.optimizers import LoneView, NoSender

pytestmark = pytest.mark.timeout(60)


def neighbourhood() -> Neighbourhood:
    return Neighbourhood(
        Identity("me", "s", "f", 0),
        LoneView(),
        topology_from_name("ring"),
        NoSender(),
        metrics=PeerMetrics(registry=CollectorRegistry()),
        pool_size=8,
    )


def test_slow_lanes_are_bounded_keep_order_and_leave_workers_for_other_pushes() -> None:
    """Eight neighbours whose pushes hang (a live, stalled uplink) each get 20 vectors: each
    lane keeps its newest MAX_LANE waiting and drops the oldest, counted; a plain push still
    runs at once; once the links move, every lane sends what it kept, in order."""
    nb = neighbourhood()
    link = threading.Event()
    sent: dict[str, list[int]] = {}
    lock = threading.Lock()

    def push(peer: str, n: int) -> None:
        link.wait(timeout=30)
        with lock:
            sent.setdefault(peer, []).append(n)

    peers = [f"p{i}" for i in range(8)]
    try:
        for n in range(20):
            for peer in peers:
                nb.submit_in_order(peer, push, peer, n)
        other = threading.Event()
        nb.submit(other.set)
        assert other.wait(timeout=5), "a plain push waited behind the stalled lanes"
        link.set()
        # Six lanes had a push in flight when the rest queued (the pool keeps two workers
        # from lanes): those send 1 + MAX_LANE, the two in line MAX_LANE.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(map(len, sent.values())) < 8 * MAX_LANE + 6:
            time.sleep(0.05)
        for peer in peers:
            got = sent[peer]
            assert got == sorted(got), (peer, got)
            assert got[-MAX_LANE:] == list(range(20 - MAX_LANE, 20)), (peer, got)
        assert sorted(len(sent[p]) for p in peers) == [MAX_LANE] * 2 + [MAX_LANE + 1] * 6
        assert nb.lane_dropped == sum(20 - len(sent[p]) for p in peers)
        for peer in peers:
            counted = nb.metrics.lane_dropped.labels(neighbor=peer)._value.get()
            assert counted == 20 - len(sent[peer])
    finally:
        link.set()
        nb.close()


def test_lanes_take_turns_one_job_each() -> None:
    """With one worker for lanes (pool of 3), two neighbours' queued jobs alternate instead of
    one lane draining whole before the other starts."""
    nb = Neighbourhood(
        Identity("me", "s", "f", 0),
        LoneView(),
        topology_from_name("ring"),
        NoSender(),
        pool_size=3,
    )
    gate = threading.Event()
    order: list[str] = []

    def push(tag: str) -> None:
        gate.wait(timeout=30)
        order.append(tag)

    try:
        for n in range(3):
            nb.submit_in_order("a", push, f"a{n}")
        for n in range(3):
            nb.submit_in_order("b", push, f"b{n}")
        gate.set()
        deadline = time.monotonic() + 30
        while len(order) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert order == ["a0", "b0", "a1", "b1", "a2", "b2"], order
    finally:
        gate.set()
        nb.close()
