"""Algorithm diloco: local phases, compressed pseudo-gradients, an outer optimizer.

Laws: the outer step is torch's SGD with Nesterov momentum; with H = 1, outer lr 1 and no
momentum on a complete graph it is plain parameter averaging; error feedback on the
pseudo-gradient loses nothing; the anchors' edges stay bit-identical with every codec family;
a checkpoint resumes the anchor, momentum and residual, and a joiner takes anchor and momentum
but no residual. Real gRPC peers on 127.0.0.1 throughout.
"""

from __future__ import annotations

import time

import pytest
import torch
from gossipgrad.peer.algorithms import DiLoCo, Identity, Neighbourhood
from gossipgrad.peer.algorithms.averaging import CompressedAverage
from gossipgrad.peer.algorithms.outer import OuterSettings, outer_step
from gossipgrad.peer.config import build_config
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from hypothesis import given, settings
from hypothesis import strategies as st
from support.optimizers import LoneView, NoSender, small_model, start_optimizers
from support.threads import on_threads
from torch import nn

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- the outer step


@settings(max_examples=30, deadline=None)
@given(
    lr=st.floats(0.1, 1.5),
    momentum=st.floats(0.0, 0.95),
    nesterov=st.booleans(),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_outer_step_is_torch_sgd(lr, momentum, nesterov, steps, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.randn(50, generator=gen, dtype=torch.float64)
    param = nn.Parameter(anchor.clone())
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    buf = torch.zeros_like(anchor)
    s = OuterSettings(local_steps=1, lr=lr, momentum=momentum, nesterov=nesterov, overlap=False)
    for _ in range(steps):
        delta = torch.randn(50, generator=gen, dtype=torch.float64)
        outer_step(anchor, delta, buf, s)
        param.grad = delta.clone()
        opt.step()
    assert torch.allclose(anchor, param.detach(), atol=1e-10)


# ---------------------------------------------------------------------- error feedback


def lone_average(codec: str) -> CompressedAverage:
    like = torch.zeros(97)
    nb = Neighbourhood(
        Identity("me", "s", "fp", 388), LoneView(), topology_from_name("ring"), NoSender()
    )
    return CompressedAverage(like, codec, True, nb, round_timeout=1.0)


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None)
@given(
    codec=st.sampled_from(["none", "int8", "topk:0.1", "topk:0.1+int8", "sign", "randomk:0.2"]),
    rounds=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_on_pseudo_gradients_loses_nothing(codec, rounds, seed) -> None:
    avg = lone_average(codec)
    gen = torch.Generator().manual_seed(seed)
    fed = torch.zeros(97, dtype=torch.float64)
    sent = torch.zeros(97, dtype=torch.float64)
    for r in range(rounds):
        delta = torch.randn(97, generator=gen)
        fed += delta.double()
        out, _ = avg.average(delta, r)  # alone: the average is its own decoded c
        sent += out.double()
    err = float((sent + avg.residual.double() - fed).abs().max())
    assert err <= 1e-5 * (1 + float(fed.abs().max())), (codec, err)


# ---------------------------------------------------------------------- real peers


def start_diloco(n: int, **gossip) -> list[GossipOptimizer]:
    """n diloco peers seeded alike (one shared initial model), SGD(lr=1) inner optimizer."""
    return start_optimizers(n, algorithm="diloco", lr=1.0, **gossip)


def close(opts: list[GossipOptimizer]) -> None:
    for o in opts:
        o.close()


def finish_all(opts: list[GossipOptimizer]) -> None:
    on_threads(GossipOptimizer.finish, [(o,) for o in opts], 120)


def step_all(opts: list[GossipOptimizer], targets: list[torch.Tensor]) -> None:
    """Each peer takes one SGD(lr=1) step that lands its parameters on its target."""

    def work(o: GossipOptimizer, target: torch.Tensor) -> None:
        o.flat.set_grad(o.flat.data - target)
        o.step()

    on_threads(work, zip(opts, targets, strict=True))


def steps_land_on_the_mean(opts: list[GossipOptimizer], seed: int, steps: int = 3) -> None:
    """Each peer steps onto a target of its own; with H = 1, outer lr 1 and no momentum every
    peer's parameters (and anchor) must then be the mean of all targets."""
    gen = torch.Generator().manual_seed(seed)
    numel = opts[0].flat.numel
    for _ in range(steps):
        targets = [o.flat.data + torch.randn(numel, generator=gen) for o in opts]
        step_all(opts, targets)
        mean = torch.stack(targets).mean(0)
        for o in opts:
            assert torch.allclose(o.flat.data, mean, atol=1e-5)
            assert torch.equal(o.algorithm.anchor, o.flat.data)


def test_h1_outer_lr1_no_momentum_is_parameter_averaging() -> None:
    opts = start_diloco(
        3, topology="full", codec="none", local_steps=1, outer_lr=1.0, outer_momentum=0.0
    )
    try:
        steps_land_on_the_mean(opts, seed=1)
        assert all(o.round == 3 for o in opts)
    finally:
        close(opts)


def test_pseudo_gradients_on_the_graph_anchors_on_the_ring() -> None:
    """diloco's defaults: pseudo-gradients averaged on the exponential graph (every peer of
    4), anchors gossiped on the ring inside it. With H = 1, outer lr 1 and dense codecs each
    step lands every peer on the mean of all four targets (a ring's average would weigh two
    neighbours and itself by 1/3), and the anchors' edges, the only ones keeping copies, are
    the two ring neighbours', exact."""
    opts = start_diloco(4, codec="none", anchor_codec="none", local_steps=1)
    try:
        g = opts[0].config.gossip
        assert (g.topology, g.anchor_topology) == ("exponential", "ring")
        steps_land_on_the_mean(opts, seed=3)
        finish_all(opts)
        anchors_exact(opts)
        ids = sorted(o.peer.id for o in opts)
        for o in opts:
            i = ids.index(o.peer.id)
            ring = {ids[(i - 1) % 4], ids[(i + 1) % 4]}
            assert set(o.algorithm.anchors.edges) == ring
    finally:
        close(opts)


@pytest.mark.parametrize(
    ("topology", "anchor_topology", "graphs"),
    [
        ("exponential", "ring", ["exponential", "ring"]),  # the defaults
        ("ring", "ring", ["ring"]),
        ("ring", "full", ["ring", "full"]),
    ],
)
def test_a_peer_heartbeats_its_neighbours_on_both_graphs(
    topology: str, anchor_topology: str, graphs: list[str]
) -> None:
    """Membership heartbeats a peer's gossip neighbours every interval: with the anchors on
    a graph of their own, those of both graphs (a ring peer's anchors' neighbour across a
    full graph is one too)."""
    from gossipgrad.peer.algorithms.neighbours import neighbours_in
    from gossipgrad.peer.flat import FlatParameters
    from gossipgrad.peer.runtime.node import Peer

    cfg = build_config(
        {},
        {
            "peer.id": "p0",
            "gossip.algorithm": "diloco",
            "gossip.topology": topology,
            "gossip.anchor_topology": anchor_topology,
        },
    )
    peer = Peer(cfg, FlatParameters(small_model()))
    assert [g.name for g in peer.graphs] == graphs
    ids = ["p0", "p1", "p2", "p3"]  # p2: across the ring
    near = set().union(*(neighbours_in(g, "p0", ids) for g in peer.graphs))
    assert near >= {"p1", "p3"}
    assert ("p2" in near) == (topology == "exponential" or anchor_topology == "full")


def anchors_exact(opts: list[GossipOptimizer]) -> None:
    """The anchors' CHOCO edges: one session, mirrors bit-identical to the public copies."""
    deadline = time.monotonic() + 10
    while any(e.busy for o in opts for e in o.algorithm.anchors.edges.values()):
        assert time.monotonic() < deadline, "pushes still in flight"
        time.sleep(0.02)
    by_id = {o.peer.id: o for o in opts}
    for o in opts:
        for peer, edge in o.algorithm.anchors.edges.items():
            other = by_id[peer].algorithm.anchors.edges[o.peer.id]
            assert edge.epoch == other.epoch != 0
            assert other.received == edge.sent > 0
            assert torch.equal(other.mirror, edge.public)


@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "topk:0.1+int8", "sign", "qsgd:16"])
@pytest.mark.parametrize("overlap", [False, True])
def test_every_codec_keeps_anchors_together(codec: str, overlap: bool) -> None:
    opts = start_diloco(
        2,
        topology="ring",
        codec=codec,
        anchor_codec=codec,
        anchor_gamma=0.2,
        local_steps=2,
        outer_lr=0.7,
        outer_momentum=0.5,
        overlap=overlap,
    )
    try:
        gen = torch.Generator().manual_seed(2)
        numel = opts[0].flat.numel
        for _ in range(8):  # 4 phases of 2 inner steps, each peer drifting its own way
            step_all(opts, [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts])
        finish_all(opts)  # concurrently, as a swarm's peers end their runs
        anchors_exact(opts)
        a, b = (o.algorithm.anchor for o in opts)
        moved = float((a - opts[0].flat.initial.load()).norm())
        assert moved > 0
        assert float((a - b).norm()) < 0.5 * moved, (codec, float((a - b).norm()), moved)
        for o in opts:
            assert torch.isfinite(o.flat.data).all()
            assert torch.equal(o.flat.data, o.algorithm.anchor)  # finish: θ ends on the anchor
    finally:
        close(opts)


def test_overlap_starts_each_phase_from_the_anchor_and_applies_every_vector_once() -> None:
    # Eager overlap: the outer step takes this phase's own pseudo-gradient and the neighbour's
    # of the phase before, so the next phase starts from the anchor (not from the anchor
    # minus the own progress), and over the run the anchors' sum moves by the sum of all
    # pseudo-gradients, each once (the anchors' CHOCO moves on an edge cancel in the sum).
    opts = start_diloco(
        2, topology="full", codec="none", anchor_codec="none", local_steps=1, overlap=True
    )
    try:
        gen = torch.Generator().manual_seed(5)
        numel = opts[0].flat.numel
        total = torch.zeros(numel)
        for _ in range(5):
            targets = [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts]
            total += sum(o.flat.data - t for o, t in zip(opts, targets, strict=True))
            step_all(opts, targets)
            for o in opts:
                assert torch.equal(o.flat.data, o.algorithm.anchor)
        finish_all(opts)
        moved = sum(opts[0].flat.initial.load() - o.algorithm.anchor for o in opts)
        assert torch.allclose(moved, total, atol=1e-5), float((moved - total).norm())
    finally:
        close(opts)


def test_checkpoint_resumes_outer_state_and_a_joiner_takes_no_residual() -> None:
    opts = start_diloco(
        2, topology="ring", codec="topk:0.1+int8", local_steps=2, outer_momentum=0.9
    )
    try:
        gen = torch.Generator().manual_seed(3)
        numel = opts[0].flat.numel
        for _ in range(6):
            step_all(opts, [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts])
        donor = opts[0]
        algo: DiLoCo = donor.algorithm
        assert float(algo.momentum.norm()) > 0 and float(algo.residual.norm()) > 0
        saved = donor.state_dict()
        joiner_state = donor.state_dict(for_joiner=True)
        assert "feedback" not in joiner_state["gossip"]["average"]
        # Resume into a fresh peer of the same model: everything comes back.
        torch.manual_seed(7)
        model = small_model()
        cfg = build_config(
            {},
            {
                "peer.id": "r",
                "metrics.enabled": False,
                "gossip.algorithm": "diloco",
                "gossip.codec": "topk:0.1+int8",
                "gossip.outer_momentum": 0.9,
            },
        )
        with GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg) as again:
            again.load_state_dict(saved)
            assert again.local_step == donor.local_step and again.round == donor.round
            assert torch.equal(again.algorithm.anchor, algo.anchor)
            assert torch.equal(again.algorithm.momentum, algo.momentum)
            assert torch.equal(again.algorithm.residual, algo.residual)
            # A joiner: anchor and momentum, but its residual starts empty.
            again.load_state_dict(joiner_state)
            assert torch.equal(again.algorithm.anchor, algo.anchor)
            assert torch.equal(again.algorithm.momentum, algo.momentum)
            assert float(again.algorithm.residual.norm()) == 0.0
    finally:
        close(opts)


def test_late_joiner_downloads_the_anchor_over_grpc() -> None:
    opts = start_diloco(2, topology="ring", codec="int8", local_steps=2, outer_momentum=0.9)
    try:
        gen = torch.Generator().manual_seed(4)
        numel = opts[0].flat.numel
        for _ in range(4):
            step_all(opts, [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts])
        torch.manual_seed(7)
        model = small_model()
        cfg = build_config(
            {},
            {
                "peer.id": "p9",
                "peer.bootstrap": [opts[0].peer.address],
                "peer.join_after_steps": 2,
                "metrics.enabled": False,
                "membership.heartbeat_interval": 0.1,
                "gossip.algorithm": "diloco",
                "gossip.outer_momentum": 0.9,
            },
        )
        with GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg) as joiner:
            assert joiner.wait_for_peers(3, 20)
            joiner.peer.membership.beat_once()
            assert joiner.join_from_swarm(timeout=20)
            donor = max(opts, key=lambda o: o.local_step)
            assert joiner.local_step == donor.local_step == 4
            assert torch.equal(joiner.algorithm.anchor, donor.algorithm.anchor)
            assert torch.equal(joiner.algorithm.momentum, donor.algorithm.momentum)
            assert torch.equal(joiner.flat.data, donor.flat.data)
            assert float(joiner.algorithm.residual.norm()) == 0.0
    finally:
        close(opts)
