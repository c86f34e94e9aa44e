"""GossipOptimizer: bring your own training loop, gossip happens in the background.

Wrap a model and any ``torch.optim`` optimizer; call ``step()`` as usual. With the default
algorithm ``choco``, every ``gossip.local_steps`` steps a CHOCO-SGD round runs: compressed
differences go out to the neighbours on background threads, and the model takes a consensus
step towards them. With ``ef-gradient``, every step first replaces the gradients by the
neighbourhood's average of error-feedback-compressed gradients (peer/ef_gradient.py), and a
CHOCO round runs every ``gossip.consensus_every`` steps. The daemon's task mode is built on
this class, so both share one code path.

LR schedulers take the wrapped optimizer (``gopt.optimizer``). Gradient accumulation needs
nothing special: gossip happens in ``step()``, never in ``backward()``.

Example::

    model = MyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = load_config(Path("site.toml"))
    with GossipOptimizer(model, opt, cfg) as gopt:
        for x, y in loader:
            gopt.zero_grad()
            loss_fn(model(x), y).backward()
            gopt.step()
"""

from __future__ import annotations

import io
import logging
import threading

import torch
from gossipgrad.peer.choco import RoundStats
from gossipgrad.peer.config import GossipSection, PeerConfig
from gossipgrad.peer.ef_gradient import EFGradientExchange, ExchangeStats
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.node import Peer
from torch import nn

log = logging.getLogger(__name__)


class GossipOptimizer:
    """A torch optimizer wrapper that makes one peer of a gossip swarm.

    Args:
        model: the model; its trainable parameters are re-homed into one flat buffer (they
            become views, so keep using the model as before).
        optimizer: any torch.optim optimizer over the model's parameters.
        config: the peer config ([peer], [gossip], [membership], [metrics], [transport]).
        registry: Prometheus registry for the metrics (None: a fresh one per peer).
        start: join the swarm at once (else call ``start()``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: PeerConfig,
        *,
        registry=None,
        start: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.flat = FlatParameters(model)
        self.local_step = 0
        self.last_round: RoundStats | None = None
        self.last_exchange: ExchangeStats | None = None
        self.exchange: EFGradientExchange | None = None
        self._lock = threading.RLock()  # the training thread vs. state downloads
        self.peer = Peer(
            config, self.flat, state_fn=self._state_blob, registry=registry, state_lock=self._lock
        )
        if start:
            self.start()

    @property
    def metrics(self):
        return self.peer.metrics

    @property
    def round(self) -> int:
        return self.peer.gossip.round if self.peer.gossip is not None else 0

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (to read or set the learning rate)."""
        return self.optimizer.param_groups

    def start(self) -> None:
        """Join the swarm: serve gRPC, start membership (idempotent)."""
        self.peer.start()
        if self.config.gossip.algorithm == "ef-gradient" and self.exchange is None:
            gossip = self.peer.gossip
            self.exchange = EFGradientExchange(
                self.flat,
                self.config.gossip,
                self.peer.id,
                self.config.peer.swarm,
                neighbors_at=gossip.neighbors_at,
                weights_at=gossip.weights_at,
                present_ids=self.peer.membership.present_ids,
                is_alive=self.peer.membership.is_alive,
                push=self.peer._push,
                metrics=self.peer.metrics,
            )
            self.peer.gradient_handler = self.exchange.handle_update

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Block until `count` peers (self included) are known or the timeout passes."""
        return self.peer.membership.wait_for(count, timeout)

    # ------------------------------------------------------------------ optimizer interface

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One local optimizer step, with the gossip the algorithm asks for.

        choco: a model-gossip round every ``local_steps`` steps, after the optimizer step.
        ef-gradient: gradients are exchanged before the optimizer step (a closure, if given,
        is evaluated first to produce them), and a model-gossip round runs every
        ``consensus_every`` steps.
        """
        loss = None
        if self.exchange is not None:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
                closure = None
            self.exchange_gradients()
        with self._lock:
            out = self.optimizer.step(closure)
            self.local_step += 1
        if round_due(self.config.gossip, self.local_step):
            self.gossip_round()
        self.peer.update_progress(self.local_step, self.round)
        return loss if loss is not None else out

    def exchange_gradients(self) -> ExchangeStats:
        """ef-gradient: replace ``.grad`` by the neighbourhood's compressed average."""
        if self.exchange is None:
            raise ValueError("exchange_gradients needs gossip.algorithm = 'ef-gradient'")
        self.last_exchange = self.exchange.exchange()
        return self.last_exchange

    def gossip_round(self) -> RoundStats:
        """Run one CHOCO model-gossip round now."""
        # Takes the lock itself, only around reading and writing x (not while waiting).
        self.last_round = self.peer.gossip.step_round()
        return self.last_round

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything needed to resume: parameters, optimizer state, counters."""
        with self._lock:
            return {
                "params": self.flat.data.detach().clone(),
                "optimizer": self.optimizer.state_dict(),
                "local_step": self.local_step,
                "round": self.round,
                "fingerprint": self.flat.fingerprint,
                **(
                    {"ef_residual": self.exchange.residual.detach().clone()}
                    if self.exchange is not None
                    else {}
                ),
            }

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.flat.fingerprint:
            raise ValueError(
                f"state is for another model (fingerprint {state.get('fingerprint')!r}, "
                f"this model {self.flat.fingerprint!r})"
            )
        with self._lock, torch.no_grad():
            self.flat.data.copy_(state["params"].to(self.flat.data.device))
            self.optimizer.load_state_dict(state["optimizer"])
            self.local_step = int(state["local_step"])
            if self.exchange is not None:
                residual = state.get("ef_residual")
                if residual is None:
                    self.exchange.residual.zero_()
                else:
                    self.exchange.residual.copy_(residual.to(self.flat.data.device))
            if self.peer.gossip is not None:
                self.peer.gossip.round = int(state["round"])
                # Our public copies are gone or stale: every edge starts with a resync.
                for pid in list(self.peer.gossip.out_edges):
                    self.peer.gossip.reset_peer(pid)

    def _state_blob(self) -> tuple[int, int, bytes]:
        state = self.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        return state["local_step"], state["round"], buf.getvalue()

    def join_from_swarm(self, timeout: float = 60.0) -> bool:
        """Download model and optimizer state from the most advanced live peer, if it is at
        least ``peer.join_after_steps`` steps in (peers started together skip this)."""
        got = self.peer.download_state(
            timeout=timeout, min_step=max(1, self.config.peer.join_after_steps)
        )
        if got is None:
            return False
        _, blob = got
        state = torch.load(io.BytesIO(blob), map_location=self.flat.data.device, weights_only=True)
        self.load_state_dict(state)
        log.info("joined at step %d (round %d) from the swarm", self.local_step, self.round)
        return True

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Leave the swarm cleanly (also on ``with`` exit)."""
        if self.exchange is not None:
            self.exchange.close()
        self.peer.close()

    def __enter__(self) -> GossipOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def round_due(cfg: GossipSection, local_step: int) -> bool:
    """Whether a CHOCO model-gossip round follows optimizer step ``local_step`` (1-based)."""
    every = cfg.consensus_every if cfg.algorithm == "ef-gradient" else cfg.local_steps
    return local_step % every == 0
