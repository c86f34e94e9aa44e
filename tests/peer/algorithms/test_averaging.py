"""CompressedAverage's pairing of exchanges: each neighbour's vector of exchange r is averaged
into this peer's exchange r, whatever order or how many times the pushes arrive.

Two averages in one process, the sender of one delivering straight into the other's
``handle_update`` (the sender is the seam: these tests are about timing, not the wire).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from gossipgrad.peer.algorithms.averaging import CompressedAverage
from gossipgrad.peer.algorithms.neighbours import Identity, Neighbourhood
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(60)


class PairView:
    def present_ids(self) -> list[str]:
        return ["a", "b"]

    def is_alive(self, peer: str) -> bool:
        return True


class DirectSender:
    """Delivers into the receiver's average; ``delay(seq)`` seconds first, ``copies`` times
    (a retried push whose first attempt did arrive)."""

    def __init__(self, delay=lambda seq: 0.0, copies: int = 1) -> None:
        self.to: CompressedAverage | None = None
        self.delay = delay
        self.copies = copies

    def push(self, peer: str, header: pb.UpdateHeader, payload: bytes, patience: float = 1.0):
        time.sleep(self.delay(header.seq))
        for _ in range(self.copies):
            reply = self.to.handle_update(header, payload)
        return reply, len(payload)


def wait_until(done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def average_of(me: str, sender: DirectSender) -> CompressedAverage:
    like = torch.zeros(16)
    nb = Neighbourhood(
        Identity(me, "s", "fp", like.numel() * 4), PairView(), topology_from_name("ring"), sender
    )
    return CompressedAverage(like, "none", True, nb, round_timeout=5.0)


def pair(sender_a: DirectSender) -> tuple[CompressedAverage, CompressedAverage]:
    a = average_of("a", sender_a)
    b = average_of("b", DirectSender())
    sender_a.to, b.nb.sender.to = b, a
    return a, b


def test_a_late_push_does_not_swap_two_exchanges() -> None:
    # a's push of exchange 0 is slow (a loaded push thread), exchange 1's is quick: b must
    # still average exchange 0 with a's exchange-0 vector.
    a, b = pair(DirectSender(delay=lambda seq: 0.3 if seq == 0 else 0.0))
    try:
        mine0, mine1 = torch.full((16,), 1.0), torch.full((16,), 5.0)
        a.start(mine0, 0)
        a.start(mine1, 1)
        avg, stats = b.average(torch.zeros(16), 0)
        assert stats.averaged == ["a"]
        # Two peers on a ring: weights 1/2 each, so b's average of exchange 0 is 0.5.
        assert torch.equal(avg, torch.full((16,), 0.5)), avg
        avg, _ = b.average(torch.zeros(16), 1)
        assert torch.equal(avg, torch.full((16,), 2.5)), avg
    finally:
        a.nb.close()
        b.nb.close()


def test_a_push_delivered_twice_is_averaged_once() -> None:
    a, b = pair(DirectSender(copies=2))
    try:
        for r in range(3):
            a.start(torch.full((16,), float(r + 1)), r)
        wait_until(lambda: b.queued("a") == 3)
        for r in range(3):
            avg, _ = b.average(torch.zeros(16), r)
            assert torch.equal(avg, torch.full((16,), (r + 1) / 2)), (r, avg)
        assert b.queued("a") == 0
    finally:
        a.nb.close()
        b.nb.close()


def test_pushes_to_one_neighbour_keep_their_order_on_the_pool() -> None:
    # Many exchanges started back to back, the earliest pushes slowest: b still receives
    # them in order, while pushes to different peers may run side by side.
    order: list[int] = []
    lock = threading.Lock()

    class Recording(DirectSender):
        def push(self, peer, header, payload, patience=1.0):
            time.sleep(0.05 * (5 - header.seq))
            with lock:
                order.append(header.seq)
            return super().push(peer, header, payload, patience)

    a, b = pair(Recording())
    try:
        for r in range(5):
            a.start(torch.full((16,), float(r)), r)
        # A push is recorded before it is delivered: wait for the last delivery too (a CI run
        # read b's queue between the two and found 4).
        wait_until(lambda: len(order) == 5 and b.queued("a") == 5)
        assert order == [0, 1, 2, 3, 4]
    finally:
        a.nb.close()
        b.nb.close()
