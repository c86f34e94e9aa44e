"""gossip.error_feedback = false, the ablation without error feedback, over real gRPC peers.

Laws: with the switch off the edge copies on both ends still agree bit for bit (nothing
changes on the wire); what a top-k codec drops is lost for good, so CHOCO peers that
only gossip stay apart where error feedback brings them together; and ef-gradient sends
Q(g) alone, its residual staying zero.
"""

from __future__ import annotations

import pytest
import torch
from gossipgrad.compression import from_spec
from gossipgrad.peer.runtime.node import Peer
from support.optimizers import exchange_all, lone_exchange, start_optimizers
from support.peers import (
    assert_mirrors_exact,
    distance,
    quiesce,
    resyncs,
    run_rounds,
    start_peer,
    start_peers,
    wait_until_met,
)

pytestmark = pytest.mark.timeout(60)

TOPK = {"gossip.codec": "topk:0.1", "gossip.topology": "ring", "gossip.gamma": 0.4}


def choco_peers(n: int, error_feedback: bool, **extra) -> list[Peer]:
    overrides = {**TOPK, "gossip.round_timeout": 10.0, "gossip.error_feedback": error_feedback}
    return start_peers(n, {**overrides, **extra})


def edge_gap(peers: list[Peer]) -> float:
    """Largest ||x_i - xhat_{i->j}|| over all out-edges: what the receivers have not got."""
    return max(
        float((p.flat.data - e.public).norm()) for p in peers for e in p.algorithm.edges.values()
    )


def test_copies_agree_without_error_feedback_and_resync_resets_the_base() -> None:
    peers = choco_peers(3, error_feedback=False)
    run_rounds(peers, 20, end=False)  # copies checked at the end: finish settles them
    quiesce(peers)
    for p in peers:
        for other, edge in p.algorithm.edges.items():
            assert resyncs(p, other) == 1.0  # only the opening one (seeds differ)
            assert edge.last_sent is not None
    # A resync restarts the difference from the model it sends: b = x = xhat.
    p0 = peers[0]
    edge = p0.algorithm.edges["p1"]
    assert not torch.equal(edge.public, edge.last_sent)
    p0.algorithm.forget("p1")  # as if p1 had restarted: a new session
    run_rounds(peers, 1, end=False)
    quiesce(peers)
    assert resyncs(p0, "p1") == 2.0
    assert torch.equal(edge.public, edge.last_sent)
    run_rounds(peers, 5)
    quiesce(peers)
    assert assert_mirrors_exact(peers) == 6


def test_init_opening_starts_the_base_at_the_initial_model() -> None:
    """Peers seeded alike open with INIT (no payload): b starts at x0, no resync needed."""
    overrides = {**TOPK, "gossip.error_feedback": False}
    peers = [start_peer("p0", [], seed=7, overrides=overrides)]
    peers.append(start_peer("p1", [peers[0].address], seed=7, overrides=overrides))
    wait_until_met(peers)
    with torch.no_grad():
        for p in peers:
            p.flat.data.add_(torch.randn_like(p.flat.data), alpha=0.1)
    run_rounds(peers, 10)
    quiesce(peers)
    assert assert_mirrors_exact(peers) == 2
    assert resyncs(peers[0], "p1") == 0.0 and resyncs(peers[1], "p0") == 0.0


def test_default_keeps_no_extra_copy() -> None:
    peers = choco_peers(2, error_feedback=True)
    run_rounds(peers, 3)
    quiesce(peers)
    assert all(e.last_sent is None for p in peers for e in p.algorithm.edges.values())


def test_top_k_without_error_feedback_loses_what_it_drops() -> None:
    """Gossip only, top-10%: with EF the peers reach consensus and each xhat catches up with
    x; without it the dropped 90% never arrives, so they stay far apart."""
    result = {}
    for ef in (True, False):
        peers = choco_peers(3, error_feedback=ef)
        d0 = distance(peers)
        run_rounds(peers, 40)
        quiesce(peers)
        result[ef] = (d0, distance(peers), edge_gap(peers))
        assert assert_mirrors_exact(peers) == 6
    (d0_on, d_on, gap_on), (d0_off, d_off, gap_off) = result[True], result[False]
    assert d0_on == pytest.approx(d0_off)  # same starting models
    assert d_on < d0_on / 20, result
    assert d_off > d0_off / 4, result  # far from consensus
    assert d_off > 10 * d_on, result
    assert gap_off > 3 * gap_on, result


def test_lossless_codec_is_the_same_with_or_without_error_feedback() -> None:
    """With nothing dropped, difference compression and CHOCO send the same thing."""
    models = {}
    for ef in (True, False):
        peers = choco_peers(2, error_feedback=ef, **{"gossip.codec": "none"})
        run_rounds(peers, 8)
        quiesce(peers)
        models[ef] = [p.flat.data.clone() for p in peers]
    for on, off in zip(models[True], models[False], strict=True):
        assert torch.allclose(on, off, atol=1e-5)


@pytest.mark.parametrize("codec", ["topk:0.1", "sign", "int4"])
def test_ef_gradient_without_error_feedback_sends_q_of_g(codec: str) -> None:
    ex = lone_exchange(codec, error_feedback=False)
    q = from_spec(codec)
    gen = torch.Generator().manual_seed(5)
    fed = torch.zeros(ex.flat.numel, dtype=torch.float64)
    sent = torch.zeros(ex.flat.numel, dtype=torch.float64)
    try:
        for step in range(6):
            g = torch.randn(ex.flat.numel, generator=gen)
            expected = q.decode(q.encode(g, seed=step + 1))
            ex.flat.set_grad(g)
            ex.before_step()
            stats = ex.last_exchange
            assert torch.equal(ex.flat.grad(), expected)  # alone: its own decoded Q(g)
            assert torch.count_nonzero(ex.residual) == 0 and stats.residual_norm == 0.0
            fed += g.double()
            sent += ex.flat.grad().double()
        # Lossy and nothing kept: what was dropped is gone.
        assert float((sent - fed).norm()) > 0.1 * float(fed.norm())
    finally:
        ex.close()


def test_ef_gradient_swarm_without_error_feedback_averages_compressed_gradients() -> None:
    codec = "topk:0.1"
    opts = start_optimizers(3, codec=codec, topology="full", error_feedback="false")
    q = from_spec(codec)
    try:
        gen = torch.Generator().manual_seed(3)
        numel = opts[0].flat.numel
        got = [torch.zeros(numel, dtype=torch.float64) for _ in opts]
        want = torch.zeros(numel, dtype=torch.float64)
        for step in range(4):
            grads = [torch.randn(numel, generator=gen) * (i + 1) for i in range(3)]
            exchange_all(opts, grads)
            want += sum(q.decode(q.encode(g, seed=step + 1)).double() for g in grads) / 3
            for i, o in enumerate(opts):
                assert len(o.last_exchange.averaged) == 2
                assert torch.count_nonzero(o.algorithm.residual) == 0
                got[i] += o.flat.grad().double()
        # Full graph of 3 (weights 1/3): the sum of what was exchanged is the average of
        # the compressed gradients alone.
        for g in got:
            assert torch.allclose(g, want, atol=1e-5)
    finally:
        for o in opts:
            o.close()
