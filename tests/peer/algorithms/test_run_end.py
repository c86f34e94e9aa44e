"""The end of a run is symmetric (issue 41, finding 1): after its FINAL notice a peer opens no
exchange and acknowledges none it will not mix, and a neighbour that heard FINAL (or was
refused) opens none either, so no exchange is ever mixed at one end only.

Two real peers on 127.0.0.1 with codec ``none``: the swarm's sum of parameters is kept by
symmetric mixing (to float rounding) and moved by a one-sided one.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from gossipgrad.proto import gossip_pb2 as pb
from support.optimizers import start_optimizers
from support.peers import quiesce, start_peers
from support.threads import at_once, on_threads

pytestmark = pytest.mark.timeout(120)

GOSSIP = {
    "gossip.codec": "none",
    "gossip.gamma": 0.3,
    "gossip.round_timeout": 2.0,
    "gossip.max_staleness": 1,
}


def total(peers: list[Peer]) -> torch.Tensor:
    return torch.stack([p.flat.data for p in peers]).double().sum(0)


def spread(peers: list[Peer]) -> float:
    a, b = (p.flat.data.double() for p in peers)
    return float((a - b).norm())


def mixed_per_edge(peers: list[Peer]) -> dict[tuple[str, str], int]:
    return {(p.id, q): e.mixed for p in peers for q, e in p.algorithm.edges.items()}


def together(peers: list[Peer], rounds: int) -> None:
    """Both peers run ``rounds`` rounds at once (no finish)."""

    def work(p: Peer) -> None:
        for _ in range(rounds):
            p.algorithm.step_round()

    on_threads(work, [(p,) for p in peers])


def assert_symmetric_end(peers: list[Peer], before: torch.Tensor, d0: float) -> None:
    """Both ends of the edge mixed the same exchanges, and the sum of the parameters is
    what it was (a one-sided mix moves it by γ w times the spread)."""
    mixes = mixed_per_edge(peers)
    assert mixes[("p0", "p1")] == mixes[("p1", "p0")], f"one-sided mixing: {mixes}"
    drift = float((total(peers) - before).norm())
    assert drift < 1e-5 * d0, f"the sum moved by {drift} (spread {d0}); mixes {mixes}"


def test_a_round_after_finish_opens_no_exchange_that_a_slower_neighbour_mixes() -> None:
    """p1 ends with ``finish(); step_round()`` (the old daemon's order, and diloco's consensus
    rounds); p0, slower, keeps running rounds for a while and finishes later. The round after
    FINAL once opened an exchange that p0 answered and mixed, and p1, whose server still
    acknowledged p0's update, never did."""
    peers = start_peers(2, GOSSIP)
    p0, p1 = peers
    before, d0 = total(peers), spread(peers)
    together(peers, 4)
    assert min(e.mixed for p in peers for e in p.algorithm.edges.values()) >= 2

    def slower() -> None:
        for _ in range(6):
            time.sleep(0.3)
            p0.algorithm.step_round()
        p0.algorithm.finish()

    def ends_early() -> None:
        p1.algorithm.finish()
        p1.algorithm.step_round()

    at_once(slower, ends_early)
    quiesce(peers)
    assert_symmetric_end(peers, before, d0)


def phase_all(opts: list[GossipOptimizer], gen: torch.Generator) -> None:
    """Each diloco peer takes one SGD(lr=1) step to a random point near it, at once (with
    ``local_steps`` 1 a phase ends there: an outer step and a round over the anchors)."""
    targets = [o.flat.data + 0.05 * torch.randn(o.flat.numel, generator=gen) for o in opts]

    def work(o: GossipOptimizer, target: torch.Tensor) -> None:
        o.flat.set_grad(o.flat.data - target)
        o.step()

    on_threads(work, zip(opts, targets, strict=True))


@pytest.mark.parametrize(
    "finish_first", [True, False], ids=["finish-then-rounds", "rounds-then-finish"]
)
def test_diloco_consensus_rounds_and_finish_keep_the_anchors_sum(finish_first: bool) -> None:
    """diloco's gossip-only rounds (``gossip.final_rounds``) once ended the anchors' gossip
    first (``finish``) and then opened a new exchange on them, every round, and the daemon
    called ``finish()`` before those rounds: the last round's exchange was mixed by a slower
    neighbour and never by this peer. p1 ends in either order, p0 runs 5 rounds, slower, then
    finishes; the anchors' sum stays where the rounds found it."""
    opts = start_optimizers(
        2,
        algorithm="diloco",
        lr=1.0,
        codec="none",
        anchor_codec="none",
        anchor_gamma=0.3,
        local_steps=1,
        max_staleness=1,
        round_timeout=2.0,
    )
    p0, p1 = opts
    try:
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            phase_all(opts, gen)
        anchors = [o.algorithm.anchor for o in opts]
        with torch.no_grad():  # two peers average exactly: set the anchors apart
            for o, a in zip(opts, anchors, strict=True):
                with o.state_lock:
                    a.add_(torch.randn(a.numel(), generator=gen), alpha=0.1)
                    o.flat.data.copy_(a)
        before = torch.stack(anchors).double().sum(0)
        d0 = float((anchors[0] - anchors[1]).double().norm())

        def slower() -> None:
            for _ in range(5):
                time.sleep(0.3)
                p0.gossip_round()
            p0.finish()

        def ends_early() -> None:  # the daemon's order, before the fix or after it
            if finish_first:
                p1.finish()
            for _ in range(2):
                p1.gossip_round()
            if not finish_first:
                p1.finish()

        at_once(slower, ends_early, timeout=90)
        deadline = time.monotonic() + 10
        while any(e.busy for o in opts for e in o.algorithm.anchors.edges.values()):
            assert time.monotonic() < deadline, "pushes still in flight"
            time.sleep(0.02)
        e01, e10 = p0.algorithm.anchors.edges["p1"], p1.algorithm.anchors.edges["p0"]
        assert e01.mixed == e10.mixed, f"one-sided mixing: p0 {e01.mixed}, p1 {e10.mixed}"
        drift = float((torch.stack(anchors).double().sum(0) - before).norm())
        assert drift < 1e-5 * d0, f"the anchors' sum moved by {drift} (spread {d0})"
    finally:
        for o in opts:
            o.close()


def test_a_neighbour_that_missed_the_final_notice_is_told_by_the_refusal() -> None:
    """p1 finishes and its FINAL notice is lost on the way to p0. p0's next update is then
    answered FINISHED instead of acknowledged: p0 learns that p1 is done, opens nothing more
    and does not wait a round_timeout for an answer that never comes; nothing is mixed at one
    end only."""
    timeout = 5.0
    peers = start_peers(2, {**GOSSIP, "gossip.round_timeout": timeout})
    p0, p1 = peers
    before, d0 = total(peers), spread(peers)
    together(peers, 4)
    handle = p0.algorithm.handle_update
    lost = threading.Event()

    def drop_final(header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        if header.kind == pb.FINAL:
            lost.set()  # acknowledged on the wire, never taken
            return pb.PushReply(status=pb.PushReply.ACCEPTED)
        return handle(header, payload)

    p0.algorithm.handle_update = drop_final
    ending = threading.Thread(target=p1.algorithm.finish)
    ending.start()
    p0.algorithm.step_round()  # answers the exchange p1 waits for in its finish
    ending.join(30)
    assert lost.is_set() and not ending.is_alive()
    t0 = time.monotonic()
    for _ in range(3):
        p0.algorithm.step_round()
    took = time.monotonic() - t0
    p0.algorithm.finish()
    quiesce(peers)
    edge = p0.algorithm.edges["p1"].describe()
    assert took < timeout / 2, f"p0 waited {took:.1f}s for a finished peer ({edge})"
    assert_symmetric_end(peers, before, d0)
    assert p0.algorithm.edges["p1"].ended


def test_a_keyboard_interrupt_in_the_training_loop_still_ends_symmetric() -> None:
    """p1's loop is interrupted (KeyboardInterrupt) inside ``with GossipOptimizer(...)``:
    ``close()`` finishes as interrupted (FINAL, its last exchanges decided), then leaves. p0,
    in the middle of a step, hears of the leaving before its next round: the exchange
    complete at its end, which p1 mixed, was once dropped with the edge (p1 counted 11, p0
    10, both before the fix and with only the run-end order fixed). Both ends now count the
    same exchanges."""
    opts = start_optimizers(2, algorithm="choco", lr=0.05, codec="none", round_timeout=2.0)
    p0, p1 = opts
    gen = torch.Generator().manual_seed(4)
    data = [torch.randn(16, 12, generator=gen) for _ in range(2)]

    def step(o: GossipOptimizer, i: int) -> None:
        o.zero_grad()
        o.model(data[i]).pow(2).mean().backward()
        o.step()

    def interrupted() -> None:
        try:
            with p1:
                for _ in range(30):
                    step(p1, 1)
                    if p1.local_step == 12:
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass

    def goes_on() -> None:
        for _ in range(30):
            step(p0, 0)
            time.sleep(0.01)
        p0.finish()

    try:
        at_once(goes_on, interrupted, timeout=90)
        mine = sum(p1.metrics.exchanges_by_neighbour().values())
        theirs = sum(p0.metrics.exchanges_by_neighbour().values())
        assert mine == theirs > 5, f"p1 {mine} exchanges, p0 {theirs}"
    finally:
        for o in opts:
            o.close()
