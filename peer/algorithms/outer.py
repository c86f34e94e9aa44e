"""DiLoCo's outer optimizer: SGD with (Nesterov) momentum on a pseudo-gradient.

Douillard et al. 2023 (DiLoCo) apply it to the all-reduced pseudo-gradient Δ = θ_anchor − θ
with lr 0.7 and Nesterov momentum 0.9; torch.optim.SGD(nesterov=True) computes the same:

    m = μ m + Δ;   a −= η (Δ + μ m)     (Nesterov)      a −= η m    (heavy ball)

With η = 1 and μ = 0 it is a −= Δ: the anchor moves to the (averaged) inner result, i.e. plain
periodic model averaging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterSettings:
    """The outer loop of ``gossip.algorithm = "diloco"``."""

    local_steps: int  # H: inner steps per phase
    lr: float  # η
    momentum: float  # μ
    nesterov: bool
    overlap: bool  # exchange of phase r runs during phase r + 1


def outer_step(
    anchor: torch.Tensor, pseudo_grad: torch.Tensor, buf: torch.Tensor, s: OuterSettings
) -> None:
    """One outer step in place on ``anchor`` with momentum buffer ``buf``."""
    if s.momentum == 0:
        anchor.sub_(pseudo_grad, alpha=s.lr)
        return
    buf.mul_(s.momentum).add_(pseudo_grad)
    if s.nesterov:
        anchor.sub_(pseudo_grad, alpha=s.lr).sub_(buf, alpha=s.lr * s.momentum)
    else:
        anchor.sub_(buf, alpha=s.lr)
