"""Algorithm ``ef-gradient``: compressed gradient exchange with error feedback, plus CHOCO.

Every local step, before the optimizer step, the gradient is replaced by the neighbourhood's
average of error-feedback-compressed gradients (peer/algorithms/averaging.py; Deep Gradient
Compression, Lin et al., ICLR 2018, with its optional momentum correction: u = m·u + g is what
gets compressed, and coordinates that were sent restart their velocity). Averaged gradients
alone let the models drift apart, so a CHOCO model-gossip round runs every
``gossip.consensus_every`` steps.
"""

from __future__ import annotations

import threading

import torch
from gossipgrad.peer.algorithms.averaging import AverageStats, CompressedAverage
from gossipgrad.peer.algorithms.base import GossipAlgorithm, RoundStats
from gossipgrad.peer.algorithms.choco import ChocoGossip
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.proto import gossip_pb2 as pb


class EFGradient(GossipAlgorithm):
    """Error-feedback gradient averaging over a CHOCO consensus (module docstring).

    Args:
        flat: the model's parameters; gradients are read from and written to their ``.grad``.
        average: the compressed averaging of the gradient.
        consensus: CHOCO gossip over the parameters.
        consensus_every: local steps between CHOCO rounds.
        momentum: DGC momentum correction factor (0: off).
    """

    name = "ef-gradient"
    kinds = (pb.GRADIENT, *ChocoGossip.kinds)

    def __init__(
        self,
        flat: FlatParameters,
        average: CompressedAverage,
        consensus: ChocoGossip,
        consensus_every: int,
        momentum: float,
        state_lock: threading.RLock,
    ) -> None:
        self.flat = flat
        self.average = average
        self.consensus = consensus
        self.consensus_every = consensus_every
        self.momentum = momentum
        self.state_lock = state_lock
        self.velocity = torch.zeros_like(flat.data) if momentum > 0 else None
        self.last_exchange: AverageStats | None = None

    @property
    def round(self) -> int:
        return self.consensus.round

    @property
    def residual(self) -> torch.Tensor:
        return self.average.residual

    def before_step(self) -> None:
        """Replace the parameters' gradients by the neighbourhood's compressed average."""
        g = self.flat.grad()
        if self.velocity is not None:
            g = self.velocity.mul_(self.momentum).add_(g)
        avg, stats = self.average.average(g, self.average.step)
        if self.velocity is not None:
            # DGC momentum factor masking: coordinates that were sent restart their velocity.
            self.velocity.masked_fill_(self.average.mine != 0, 0.0)
        self.flat.set_grad(avg)
        self.last_exchange = stats

    def after_step(self, local_step: int) -> RoundStats | None:
        if local_step % self.consensus_every:
            return None
        return self.consensus.step_round()

    def consensus_round(self) -> RoundStats:
        return self.consensus.step_round(trained=False)

    def finish(self, interrupted: bool = False) -> None:
        self.consensus.finish(interrupted)

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        if header.kind == pb.GRADIENT:
            return self.average.handle_update(header, payload)
        return self.consensus.handle_update(header, payload)

    def state_dict(self, for_joiner: bool = False, copy: bool = True) -> dict:
        state = {
            "average": self.average.state_dict(for_joiner, copy),
            "consensus": self.consensus.state_dict(for_joiner, copy),
        }
        if self.velocity is not None and not for_joiner:
            state["velocity"] = self.velocity.clone() if copy else self.velocity.detach()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.average.load_state_dict(state.get("average", {}))
        self.consensus.load_state_dict(state.get("consensus", {}))
        if self.velocity is not None:
            v = state.get("velocity")
            if v is None:
                self.velocity.zero_()
            else:
                self.velocity.copy_(v)

    def forget(self, peer: str) -> None:
        self.average.forget(peer)
        self.consensus.forget(peer)

    def prune(self, present: set[str]) -> None:
        self.average.prune(present)
        self.consensus.prune(present)

    def close(self) -> None:
        self.consensus.close()
