"""Algorithm ef-gradient: error-feedback gradient exchange over real gRPC on 127.0.0.1.

Laws: error feedback loses nothing (what was sent plus the residual is what was fed in, for
every codec); neighbours' gradients are averaged with the mixing weights; and a 4-peer swarm
of real processes trains digits to near the centralized accuracy.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.experiment.swarm import summarize
from gossipgrad.peer.config import build_config
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from gossipgrad.peer.tasks import TaskContext, train_centralized
from hypothesis import given, settings
from hypothesis import strategies as st
from support.optimizers import exchange_all, lone_exchange, small_model, start_optimizers
from support.swarms import BASE as SWARM_BASE
from support.swarms import BATCH

CODECS = [
    "none",
    "fp16",
    "int8",
    "int4",
    "sign",
    "qsgd:16",
    "topk:0.05",
    "randomk:0.1",
    "topk:0.05+int8",
]


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_loses_nothing(codec: str, steps: int, seed: int) -> None:
    ex = lone_exchange(codec)
    gen = torch.Generator().manual_seed(seed)
    fed = torch.zeros(ex.flat.numel, dtype=torch.float64)
    sent = torch.zeros(ex.flat.numel, dtype=torch.float64)
    try:
        for _ in range(steps):
            g = torch.randn(ex.flat.numel, generator=gen)
            ex.flat.set_grad(g)
            fed += g.double()
            ex.before_step()
            sent += ex.flat.grad().double()  # alone: the gradient is its own decoded c
        # sum of sent c + residual == sum of gradients fed in (up to fp32 rounding)
        err = (sent + ex.residual.double() - fed).abs().max()
        assert float(err) <= 1e-5 * (1 + float(fed.abs().max())), (codec, float(err))
        if codec != "none":
            assert ex.average.step == steps
    finally:
        ex.close()


@pytest.mark.timeout(60)
def test_momentum_correction_keeps_velocity_of_unsent_coordinates() -> None:
    ex = lone_exchange("topk:0.05", momentum=0.5)
    try:
        g = torch.linspace(-1, 1, ex.flat.numel)
        ex.flat.set_grad(g)
        ex.before_step()
        sent = ex.flat.grad() != 0
        assert 0 < int(sent.sum()) < ex.flat.numel
        # DGC momentum factor masking: sent coordinates restart, the others keep g.
        assert torch.equal(ex.velocity[sent], torch.zeros(int(sent.sum())))
        assert torch.equal(ex.velocity[~sent], g[~sent])
        # Error feedback over the velocity: residual + sent == velocity fed in.
        assert torch.allclose(ex.residual + ex.flat.grad(), g)
    finally:
        ex.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("codec", ["none", "topk:0.1+int8"])
def test_neighbours_gradients_are_averaged(codec: str) -> None:
    opts = start_optimizers(3, codec=codec, topology="full")
    try:
        gen = torch.Generator().manual_seed(3)
        numel = opts[0].flat.numel
        fed = [torch.zeros(numel, dtype=torch.float64) for _ in opts]
        got = [torch.zeros(numel, dtype=torch.float64) for _ in opts]
        for _ in range(5):
            grads = [torch.randn(numel, generator=gen) * (i + 1) for i in range(3)]
            exchange_all(opts, grads)
            for i, o in enumerate(opts):
                assert opts[i].last_exchange.averaged == [
                    p for p in ("p0", "p1", "p2") if p != o.peer.id
                ]
                fed[i] += grads[i].double()
                got[i] += o.flat.grad().double()
        # Full graph of 3: Metropolis-Hastings weights are 1/3, every peer gets the same average.
        mean_fed = sum(fed) / 3
        for i in range(len(opts)):
            assert torch.allclose(got[i], got[0], atol=1e-5)
            if codec == "none":
                assert torch.allclose(got[i], mean_fed, atol=1e-5)
            else:
                # Lossy: the average of what was fed in, minus the residuals still held back.
                held = sum(p.algorithm.residual.double() for p in opts) / 3
                assert torch.allclose(got[i] + held, mean_fed, atol=1e-4)
                assert float(held.norm()) > 0
        sent = sum(
            o.metrics.registry.get_sample_value(
                "gossipgrad_sent_bytes_total", {"neighbor": "p1", "kind": "update"}
            )
            or 0
            for o in opts
        )
        assert sent > 0
    finally:
        for o in opts:
            o.close()


@pytest.mark.timeout(60)
def test_missing_neighbour_does_not_block_forever() -> None:
    opts = start_optimizers(2, codec="int8", topology="ring", round_timeout="1.0")
    try:
        opts[0].flat.set_grad(torch.ones(opts[0].flat.numel))
        t0 = time.monotonic()
        opts[0].exchange_gradients()  # p1 never sends
        stats = opts[0].last_exchange
        assert time.monotonic() - t0 < 5
        assert stats.averaged == []
        # Alone, the peer steps with its own (decoded) gradient.
        assert torch.allclose(opts[0].flat.grad(), torch.ones(opts[0].flat.numel), atol=0.02)
    finally:
        for o in opts:
            o.close()


SWARM_STEPS = 300


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_peer_swarm_ef_gradient_matches_centralized(tmp_path: Path) -> None:
    overrides = {
        **SWARM_BASE,  # digits, batch 32, ring, fast membership, as the CHOCO swarm tests
        "train.steps": str(SWARM_STEPS),
        "gossip.algorithm": "ef-gradient",
        # Measured on this task: consensus every 1-2 steps keeps the ring together (every 4 or
        # 10 steps lost 10-15 points of accuracy); topk:0.05 at gamma 0.3 is stable.
        "gossip.codec": "topk:0.05+int8",
        "gossip.gamma": "0.3",
        "gossip.consensus_every": "2",
    }
    swarm = LocalSwarm(tmp_path / "swarm", 4, overrides)
    try:
        swarm.start()
        assert swarm.wait(240), "swarm did not finish"
        assert swarm.failed() == []
        result = summarize(swarm)
    finally:
        swarm.stop(timeout=10)
    central = train_centralized(
        "digits", SWARM_STEPS, TaskContext(num_peers=4, seed=0, batch_size=BATCH)
    )
    accs = [p["final"]["accuracy"] for p in result["peers"]]
    print(f"ef-gradient swarm accuracies {accs}, centralized {central['accuracy']:.4f}")
    print(f"relative consensus distance {result['relative_consensus_distance']:.3e}")
    # 5 points (18 of 360 test images): under CPU contention some gradient exchanges miss
    # round_timeout and fall back to local steps, which moves the result by a few images.
    for acc in accs:
        assert acc >= central["accuracy"] - 0.05
    assert result["relative_consensus_distance"] < 1e-3  # measured 2.1e-5; alone: 0.036
    for p in result["peers"]:
        assert p["steps"] == SWARM_STEPS
        assert p["dense_bytes"] > 20 * p["sent_update_bytes"] > 0


@pytest.mark.timeout(60)
def test_gradient_routing_and_rejections_over_grpc() -> None:
    """GRADIENT goes to the exchange; a choco peer and a bad payload refuse it."""
    from gossipgrad.compression import from_spec
    from gossipgrad.peer.network import PeerClient
    from gossipgrad.proto import gossip_pb2 as pb

    ef = start_optimizers(1, codec="int8")[0]
    torch.manual_seed(7)
    model = small_model()
    cfg = build_config({}, {"peer.id": "c", "metrics.enabled": False})
    choco = GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    codec = from_spec("int8")
    payload = codec.encode(torch.ones(ef.flat.numel))
    try:
        for target, expect in ((ef, None), (choco, "algorithm choco")):
            header = pb.UpdateHeader(
                swarm=cfg.peer.swarm,
                sender="x",
                receiver=target.peer.id,
                kind=pb.GRADIENT,
                model_fingerprint=ef.flat.fingerprint,
                dense_size=ef.flat.nbytes,
            )
            client = PeerClient(target.peer.address)
            try:
                if expect is None:
                    reply = client.push_detailed(header, payload, timeout=10).reply
                    assert reply.status == pb.PushReply.ACCEPTED
                    # A payload of the wrong size is refused before anything is queued.
                    with pytest.raises(Exception, match=r"decode|fit|shape"):
                        client.push_detailed(header, codec.encode(torch.ones(3)), timeout=10)
                else:
                    with pytest.raises(Exception, match=expect):
                        client.push_detailed(header, payload, timeout=10)
            finally:
                client.close()
        assert ef.algorithm.average.queued("x") == 1
    finally:
        ef.close()
        choco.close()
