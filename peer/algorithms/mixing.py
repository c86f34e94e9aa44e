"""The consensus step of CHOCO-SGD as a pure function of (x, copies, weights, γ).

x_i += γ Σ_j w_ij (x̂_j − x̂_i)   (Koloskova, Stich, Jaggi, ICML 2019, Algorithm 1, line 9)

with optional self-centred clipping of each neighbour's pull (ClippedGossip, He, Karimireddy,
Jaggi 2022): one neighbour moves x by at most γ·w·clip per round, whatever it sends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pair:
    """One edge's part of a consensus step: the neighbour's copy, ours, and the weight."""

    mirror: torch.Tensor  # x̂_j as this peer holds it
    public: torch.Tensor  # x̂_i as the neighbour holds it
    weight: float


def clipped(diff: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``diff`` scaled down in place to L2 norm ``max_norm`` if longer; a non-finite pull is
    dropped entirely."""
    norm = float(torch.linalg.vector_norm(diff))
    if not math.isfinite(norm):
        return diff.zero_()
    if norm > max_norm:
        diff.mul_(max_norm / norm)
    return diff


def consensus_step(
    x: torch.Tensor,
    pairs: Iterable[Pair],
    gamma: float,
    clip: float = 0.0,
    direction: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply x += γ Σ w (mirror − public) in place; returns the direction Σ w (mirror − public).

    ``direction``: a preallocated buffer (zeroed here) so a round allocates nothing.
    """
    d = direction if direction is not None else torch.empty_like(x)
    d.zero_()
    for p in pairs:
        if p.weight <= 0:
            continue
        if clip > 0:
            d.add_(clipped(p.mirror - p.public, clip), alpha=p.weight)
        else:
            d.add_(p.mirror, alpha=p.weight).sub_(p.public, alpha=p.weight)
    x.add_(d, alpha=gamma)
    return d


def neighbourhood_distance(x: torch.Tensor, pairs: Iterable[Pair]) -> float:
    """||Σ_j w_ij (x̂_j − x_i)||: how far x_i is from its neighbourhood's average."""
    acc = torch.zeros_like(x)
    for p in pairs:
        if p.weight > 0:
            acc.add_(p.mirror - x, alpha=p.weight)
    return float(torch.linalg.vector_norm(acc))


def residual_norm(x: torch.Tensor, publics: list[torch.Tensor]) -> float:
    """RMS over edges of ||x − x̂_{i->j}||: what error feedback still has to send."""
    if not publics:
        return 0.0
    return (sum(float(torch.linalg.vector_norm(x - p)) ** 2 for p in publics) / len(publics)) ** 0.5
