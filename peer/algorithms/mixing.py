"""The consensus step of CHOCO-SGD as a pure function of (x, copies, weights, γ).

x_i += γ Σ_j w_ij (x̂_j − x̂_i)   (Koloskova, Stich, Jaggi, ICML 2019, Algorithm 1, line 9)

with optional self-centred clipping of each neighbour's pull (ClippedGossip, He, Karimireddy,
Jaggi 2022): one neighbour moves x by at most γ·w·clip per round, whatever it sends.

Every function here walks the model-sized vectors one slice of ``CHUNK`` elements at a time,
with scratch of that size: a round allocates nothing model-sized, and the consensus-distance
metric comes from the same slices the step reads anyway, while they are in cache, instead of
from a pass of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: Elements per slice (4 MiB of fp32): small enough to stay in cache, large enough that the
#: per-slice overhead of a torch call is noise.
CHUNK = 1 << 20


@dataclass(frozen=True)
class Pair:
    """One edge's part of a consensus step: the neighbour's copy, ours, and the weight."""

    mirror: torch.Tensor  # x̂_j as this peer holds it
    public: torch.Tensor  # x̂_i as the neighbour holds it
    weight: float


def _slices(n: int) -> Iterable[tuple[int, int]]:
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


def _scratch(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = like.dtype if dtype is None else dtype
    return torch.empty(min(CHUNK, like.numel()), dtype=dtype, device=like.device)


def difference_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a − b||, a slice at a time (no model-sized temporary), summed in at least float32
    (float16 copies would round the squares)."""
    d = _scratch(a, torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32))
    total = 0.0
    for lo, hi in _slices(a.numel()):
        s = torch.sub(a[lo:hi], b[lo:hi], out=d[: hi - lo])
        total += float(torch.dot(s, s))
    return math.sqrt(total)


def clip_scale(mirror: torch.Tensor, public: torch.Tensor, max_norm: float) -> float:
    """The factor that brings the pull ``mirror − public`` to L2 norm ``max_norm`` if longer
    (1 otherwise); a non-finite pull gets 0: it is dropped entirely."""
    norm = difference_norm(mirror, public)
    if not math.isfinite(norm):
        return 0.0
    return max_norm / norm if norm > max_norm else 1.0


def consensus_step(
    x: torch.Tensor, pairs: Iterable[Pair], gamma: float, clip: float = 0.0
) -> float:
    """Apply x += γ Σ w (mirror − public) in place (pairs of weight <= 0 are skipped).

    Returns ||Σ_j w_ij (x̂_j − x_i)||, how far x was from its neighbourhood's average before
    the step (the consensus-distance metric), computed from the same slices. With ``clip``,
    each neighbour's pull is scaled down to norm ``clip`` first (one more read of its copies).
    """
    live = [p for p in pairs if p.weight > 0]
    if not live:
        return 0.0
    scales = [clip_scale(p.mirror, p.public, clip) if clip > 0 else 1.0 for p in live]
    total_w = sum(p.weight for p in live)
    direction, toward = _scratch(x), _scratch(x)
    dist2 = 0.0
    for lo, hi in _slices(x.numel()):
        d, m = direction[: hi - lo].zero_(), toward[: hi - lo].zero_()
        xs = x[lo:hi]
        for p, s in zip(live, scales, strict=True):
            mirror = p.mirror[lo:hi]
            m.add_(mirror, alpha=p.weight)
            if s > 0:
                d.add_(mirror, alpha=p.weight * s).sub_(p.public[lo:hi], alpha=p.weight * s)
        m.sub_(xs, alpha=total_w)
        dist2 += float(torch.dot(m, m))
        xs.add_(d, alpha=gamma)
    return math.sqrt(dist2)
