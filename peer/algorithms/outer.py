"""DiLoCo's outer optimizer: SGD with (Nesterov) momentum on a pseudo-gradient.

Douillard et al. 2023 (DiLoCo) apply it to the all-reduced pseudo-gradient Δ = θ_anchor − θ
with lr 0.7 and Nesterov momentum 0.9; torch.optim.SGD(nesterov=True) computes the same:

    m = μ m + Δ;   a −= η (Δ + μ m)     (Nesterov)      a −= η m    (heavy ball)

With η = 1 and μ = 0 it is a −= Δ: the anchor moves to the (averaged) inner result, i.e. plain
periodic model averaging. Δ may be a dense tensor or an ``Average`` of compressed messages
(peer/algorithms/averaging.py), which is decoded straight into the anchor and the momentum
buffer: the step holds no dense copy of Δ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class PseudoGradient(Protocol):
    """Anything that can add itself, scaled, into a tensor (``Average``)."""

    def add_to_(self, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor: ...


@dataclass(frozen=True)
class OuterSettings:
    """The outer loop of ``gossip.algorithm = "diloco"``."""

    local_steps: int  # H: inner steps per phase
    lr: float  # η
    momentum: float  # μ
    nesterov: bool
    overlap: bool | str  # exchange of phase r runs during phase r + 1 ("auto": as measured)
    background: bool = False  # the phase end runs beside the next phase's first steps
    qsr_alpha: float = 0.0  # exact-diloco: H grows as the learning rate decays (phase_clock.py)


def outer_step(
    anchor: torch.Tensor,
    pseudo_grad: torch.Tensor | PseudoGradient,
    buf: torch.Tensor | None,
    s: OuterSettings,
) -> None:
    """One outer step in place on ``anchor`` with momentum buffer ``buf`` (None: μ = 0)."""

    def add(out: torch.Tensor, alpha: float) -> None:
        if isinstance(pseudo_grad, torch.Tensor):
            out.add_(pseudo_grad, alpha=alpha)
        else:
            pseudo_grad.add_to_(out, alpha=alpha)

    if s.momentum == 0:
        add(anchor, -s.lr)
        return
    if buf is None:
        raise ValueError("an outer step with momentum needs its momentum buffer")
    add(buf.mul_(s.momentum), 1.0)
    if s.nesterov:
        add(anchor, -s.lr)
        anchor.sub_(buf, alpha=s.lr * s.momentum)
    else:
        anchor.sub_(buf, alpha=s.lr)


def restore_outer(anchor: torch.Tensor, momentum: torch.Tensor | None, state: dict) -> int:
    """Load a checkpoint's or a donor's anchor and outer momentum in place (the momentum
    starts from zero where the state has none: a state saved without momentum, or a peer
    that runs with it now); returns the state's phase counter."""
    anchor.copy_(state["anchor"])
    if momentum is not None:
        saved = state.get("momentum")
        if saved is None:
            momentum.zero_()
        else:
            momentum.copy_(saved)
    return int(state.get("phase", 0))
