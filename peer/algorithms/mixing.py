"""The consensus step of CHOCO-SGD as a pure function of (x, copies, weights, γ).

x_i += γ Σ_j w_ij (x̂_j − x̂_i)   (Koloskova, Stich, Jaggi, ICML 2019, Algorithm 1, line 9)

with optional self-centred clipping of each neighbour's pull (ClippedGossip, He, Karimireddy,
Jaggi 2022): one neighbour moves x by at most γ·w·clip per round, whatever it sends.

Every function here walks the model-sized vectors one slice of ``CHUNK`` elements at a time,
with scratch of that size: a round allocates nothing model-sized, and the consensus-distance
metric comes from the same slices the step reads anyway, while they are in cache, instead of
from a pass of its own. Where compression/kernels.c is built, the step is one pass of it
(eight entries at a time, every copy read once: 1.4 copies of the model against 3.5 with two
neighbours' float16 copies).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from gossipgrad.compression import native
from gossipgrad.compression.difference import subtract_into

#: Elements per slice (256 KiB of fp32): a slice and its scratch stay in a core's cache while
#: the step reads it several times, and the per-slice overhead of a torch call is still
#: noise. A consensus step over two float16 neighbours at 100M parameters, one thread, in
#: copies of the model (three runs): 3.57-3.91 with 64K-element slices, 3.89-4.15 with 128K,
#: 4.08-4.41 with 256K, 4.84-5.73 with 16K.
CHUNK = 1 << 16


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
        s = subtract_into(a[lo:hi], b[lo:hi], d[: hi - lo])
        total += float(torch.dot(s, s))
    return math.sqrt(total)


def clip_scale(mirror: torch.Tensor, public: torch.Tensor, max_norm: float) -> float:
    """The factor that brings the pull ``mirror − public`` to L2 norm ``max_norm`` if longer
    (1 otherwise); a non-finite pull gets 0: it is dropped entirely."""
    norm = difference_norm(mirror, public)
    if not math.isfinite(norm):
        return 0.0
    return max_norm / norm if norm > max_norm else 1.0


def _fused_consensus(
    x: torch.Tensor,
    weighted: list[tuple[Pair, float]],
    gamma: float,
    also_into: torch.Tensor | None,
) -> float | None:
    """The step in one pass of compression/kernels.c where it is built and applies (float32
    ``x`` and ``also_into``, every copy of one dtype, contiguous, on CPU); None otherwise."""
    publics = [p.public for p, _ in weighted]
    mirrors = [p.mirror for p, _ in weighted]
    if not (native.usable(x) and native.usable(*publics, *mirrors, dtype=mirrors[0].dtype)):
        return None
    if also_into is not None and not native.usable(also_into):
        return None
    return native.consensus(x, publics, mirrors, [w for _, w in weighted], gamma, also_into)


def consensus_step(
    x: torch.Tensor,
    pairs: Iterable[Pair],
    gamma: float,
    clip: float = 0.0,
    also_into: torch.Tensor | None = None,
) -> float:
    """Apply x += γ Σ w (mirror − public) in place (pairs of weight <= 0 are skipped); with
    ``also_into`` (x's shape and dtype), leave it equal to the new x, written in the same pass
    where the kernels run (diloco's parameters after its anchors' round: no copy of its own).

    Returns ||Σ_j w_ij (x̂_j − x̂_i)||, the pull of the neighbourhood's copies before γ: how far
    this peer's copy is from its neighbours' (the consensus-distance metric; it differs from
    ||Σ_j w_ij (x̂_j − x_i)|| by what error feedback has still to send), read off the slices the
    step computes anyway. Each neighbour's difference is taken before it is weighted (the
    copies are close: weighting first would round away the small difference). With ``clip``,
    each neighbour's pull is scaled down to norm ``clip`` first (one more read of its copies).
    """
    live = [p for p in pairs if p.weight > 0]
    scales = [clip_scale(p.mirror, p.public, clip) if clip > 0 else 1.0 for p in live]
    weighted = [(p, p.weight * s) for p, s in zip(live, scales, strict=True) if s > 0]
    if not weighted:
        if also_into is not None:
            also_into.copy_(x)
        return 0.0
    fused = _fused_consensus(x, weighted, gamma, also_into)
    if fused is not None:
        return fused
    pull, diff = _scratch(x), _scratch(x)
    dist2 = 0.0
    for lo, hi in _slices(x.numel()):
        d, e = pull[: hi - lo], diff[: hi - lo]
        for i, (p, w) in enumerate(weighted):
            torch.sub(p.mirror[lo:hi], p.public[lo:hi], out=e)
            if i == 0:
                torch.mul(e, w, out=d)
            else:
                d.add_(e, alpha=w)
        dist2 += float(torch.dot(d, d))
        x[lo:hi].add_(d, alpha=gamma)
        if also_into is not None:
            also_into[lo:hi].copy_(x[lo:hi])
    return math.sqrt(dist2)
