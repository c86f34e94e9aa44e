"""GossipOptimizers and algorithms for tests: several seeded alike over real gRPC on
127.0.0.1, or one with no neighbours (only its compression runs)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from gossipgrad.peer.algorithms import EFGradient, Identity, Neighbourhood, build_algorithm
from gossipgrad.peer.config import build_config
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from torch import nn

from support.threads import on_threads


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))


class LoneView:
    """A swarm of one: no neighbours to exchange with."""

    def present_ids(self) -> list[str]:
        return ["me"]

    def is_alive(self, peer: str) -> bool:
        return True


class NoSender:
    def push(self, *args):
        raise AssertionError("no neighbours to push to")


def lone_exchange(codec: str, momentum: float = 0.0, error_feedback: bool = True) -> EFGradient:
    """An ef-gradient algorithm with no neighbours: only the (error-feedback) compression runs."""
    flat = FlatParameters(small_model())
    overrides = {
        "gossip.algorithm": "ef-gradient",
        "gossip.codec": codec,
        "gossip.ef_momentum": momentum,
        "gossip.error_feedback": error_feedback,
    }
    cfg = build_config({}, overrides).gossip
    nb = Neighbourhood(
        Identity("me", "s", flat.fingerprint, flat.nbytes),
        LoneView(),
        topology_from_name("ring"),
        NoSender(),
    )
    algorithm = build_algorithm(cfg, flat, nb, threading.RLock())
    assert isinstance(algorithm, EFGradient)
    return algorithm


def start_optimizers(
    n: int,
    algorithm: str = "ef-gradient",
    lr: float = 0.1,
    model_fn: Callable[[], nn.Module] = small_model,
    **gossip,
) -> list[GossipOptimizer]:
    """n GossipOptimizers seeded alike (one shared initial ``model_fn()``), plain SGD at
    ``lr``."""
    opts: list[GossipOptimizer] = []
    for i in range(n):
        bootstrap = [opts[0].peer.address] if opts else []
        opts.append(gossip_optimizer(f"p{i}", bootstrap, algorithm, lr, model_fn, **gossip))
    for o in opts:
        assert o.wait_for_peers(n, 20), "peers did not discover each other"
    return opts


def gossip_optimizer(
    peer_id: str,
    bootstrap: list[str],
    algorithm: str = "ef-gradient",
    lr: float = 0.1,
    model_fn: Callable[[], nn.Module] = small_model,
    **gossip,
) -> GossipOptimizer:
    """One peer of ``start_optimizers``' swarms (a later one: a joiner), started."""
    torch.manual_seed(7)
    model = model_fn()
    overrides = {
        "peer.id": peer_id,
        "peer.bootstrap": bootstrap,
        "metrics.enabled": False,
        "membership.heartbeat_interval": 0.1,
        # These tests assert exact agreement, which holds only while nobody is left out
        # of an exchange; failure detection is not what they test, and with the suite on
        # every core the peers' threads (one process, one GIL) can starve for seconds.
        "membership.suspect_after": 30.0,
        "membership.dead_after": 60.0,
        "gossip.algorithm": algorithm,
        "gossip.round_timeout": 30.0,
        **{f"gossip.{k}": v for k, v in gossip.items()},
    }
    return GossipOptimizer(
        model, torch.optim.SGD(model.parameters(), lr=lr), build_config({}, overrides)
    )


def exchange_all(opts: list[GossipOptimizer], grads: list[torch.Tensor]) -> None:

    def work(o: GossipOptimizer, g: torch.Tensor) -> None:
        o.flat.set_grad(g)
        o.exchange_gradients()

    on_threads(work, zip(opts, grads, strict=True), 30)


def train_concurrently(
    opts: list[GossipOptimizer],
    loss_of: Callable[[int, nn.Module, torch.Generator], torch.Tensor],
    steps: int,
    timeout: float = 90.0,
) -> list[float]:
    """Each peer takes ``steps`` optimizer steps on ``loss_of(i, model, its generator)`` and
    then ``finish()``, on its own thread, as a swarm's training threads run (gossip rounds
    need the neighbours at the same time). Returns each peer's last loss."""
    losses = [float("nan")] * len(opts)

    def work(i: int, o: GossipOptimizer) -> None:
        gen = torch.Generator().manual_seed(i)
        for _ in range(steps):
            o.zero_grad()
            loss = loss_of(i, o.model, gen)
            loss.backward()
            o.step()
            losses[i] = float(loss.detach())
        o.finish()

    on_threads(work, enumerate(opts), timeout)
    return losses
