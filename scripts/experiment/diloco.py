"""All-reduce DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"), for the ``diloco`` and ``diloco-int8`` baselines.

Every rank runs H inner steps of the task's own optimizer without communicating; then

1. the pseudo-gradient ``Δ = anchor − θ`` (flat, fp32) is averaged over the ranks,
2. ``anchor.grad = mean Δ`` and an outer ``SGD(lr=η, momentum=μ, nesterov=True)`` steps the
   anchor (plain SGD when μ = 0: torch's Nesterov needs a momentum),
3. every rank sets ``θ = anchor``.

The inner optimizer keeps its state across phases, as in the paper. With H = 1, η = 1, μ = 0
the outer step is ``anchor − (anchor − mean θ) = mean θ``: plain parameter averaging after
every step.

Pseudo-gradients travel in fp32 (one ``all_reduce``) or in int8 (``mean_int8``): a quantized
reduce-scatter (``all_to_all_single`` of per-chunk int8 values and float32 block scales), a
local fp32 mean of the chunk this rank owns, then an ``all_gather`` of that mean re-quantized to
int8. Both passes put int8 bytes on the wire, so a rank sends 2 (n−1)/n × P bytes of values plus
their scales, a quarter of fp32 ring all-reduce's 2 (n−1)/n × 4 P, at any n. This is the
two-pass form of INTELLECT-1's int8 ring all-reduce (quantize, accumulate in fp32, re-quantize
for the gather); every value is quantized twice, once as a rank's contribution, once as the
reduced mean. Every rank dequantizes the same gathered bytes, so the ranks' anchors stay
bit-identical. Quantization is ``gossipgrad.compression.Int8`` (absmax per block of 256, error
at most max|block|/254 per value and pass).

Collectives are looked up on ``torch.distributed`` at call time, so a rank's byte counter that
wraps them there (``ddp_worker.WireCounter``) counts these calls too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from gossipgrad.compression import Int8

log = logging.getLogger(__name__)

PSEUDO_GRADIENT_DTYPES = ("fp32", "int8")


@dataclass(frozen=True)
class OuterSettings:
    """Hyperparameters of the outer loop."""

    local_steps: int = 1
    """H: inner optimizer steps per phase."""
    outer_lr: float = 0.7
    """η of the outer SGD (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """μ of the outer Nesterov momentum (the paper's 0.9; 0: plain SGD)."""
    pseudo_gradient_dtype: str = "fp32"
    """What the pseudo-gradients travel as: fp32 or int8."""

    def __post_init__(self) -> None:
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.pseudo_gradient_dtype not in PSEUDO_GRADIENT_DTYPES:
            raise ValueError(
                f"pseudo_gradient_dtype must be one of {PSEUDO_GRADIENT_DTYPES}, "
                f"got {self.pseudo_gradient_dtype!r}"
            )


def mean_fp32(flat: torch.Tensor, world: int) -> torch.Tensor:
    """Mean of ``flat`` over the ranks: one fp32 sum all-reduce, in place."""
    dist.all_reduce(flat)
    return flat.div_(world)


def chunk_length(numel: int, world: int, block: int) -> int:
    """Elements per rank's chunk in ``mean_int8``: ``numel / world`` rounded up to whole
    blocks, so each chunk has scales of its own."""
    blocks = -(-numel // block)
    return -(-blocks // world) * block


def mean_int8(flat: torch.Tensor, world: int, quantizer: Int8 | None = None) -> torch.Tensor:
    """Mean of ``flat`` over the ranks with int8 values on the wire (see the module docstring).

    Steps:
      1. pad ``flat`` to ``world`` chunks of whole blocks; quantize each chunk;
      2. ``all_to_all_single``: chunk j of every rank goes to rank j (values, then scales);
      3. rank j dequantizes what it got and takes the fp32 mean of its chunk;
      4. re-quantize that mean and ``all_gather`` it (values, then scales);
      5. dequantize all chunks: the mean, identical on every rank.

    Returns:
        A new fp32 tensor shaped like ``flat``.
    """
    q = quantizer or Int8()
    n = flat.numel()
    c = chunk_length(n, world, q.block)
    nb = c // q.block
    padded = flat.new_zeros(world * c)
    padded[:n] = flat.reshape(-1)
    parts = [q.quantize(padded[j * c : (j + 1) * c], None) for j in range(world)]
    send_values = torch.cat([v for v, _ in parts])
    send_scales = torch.cat([s for _, s in parts])
    recv_values, recv_scales = torch.empty_like(send_values), torch.empty_like(send_scales)
    dist.all_to_all_single(recv_values, send_values)
    dist.all_to_all_single(recv_scales, send_scales)
    own = torch.zeros(c, dtype=torch.float32)
    for j in range(world):
        own += q.dequantize(
            recv_values[j * c : (j + 1) * c], recv_scales[j * nb : (j + 1) * nb], c, torch.float32
        )
    values, scales = q.quantize(own.div_(world), None)
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_scales = [torch.empty_like(scales) for _ in range(world)]
    dist.all_gather(all_values, values.contiguous())
    dist.all_gather(all_scales, scales.contiguous())
    out = torch.cat(
        [q.dequantize(v, s, c, torch.float32) for v, s in zip(all_values, all_scales, strict=True)]
    )
    return out[:n].view_as(flat)


class OuterOptimizer:
    """The anchor (the global model) and its outer SGD; ``sync()`` ends a phase.

    Args:
        params: the rank's model parameters (θ), updated in place by ``sync()``.
        settings: H, η, μ and the wire dtype.
        world: ranks in the (default) process group.

    Example::

        outer = OuterOptimizer(list(model.parameters()), OuterSettings(local_steps=4), world)
        for step in range(1, steps + 1):
            ...inner optimizer step...
            if outer.phase_ends(step, steps):
                outer.sync()
    """

    def __init__(
        self, params: list[torch.nn.Parameter], settings: OuterSettings, world: int
    ) -> None:
        # Hyperparameters.
        self.settings = settings
        self.world = world
        # State: the anchor starts at θ (every rank builds the same seeded model).
        self.params = params
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in params]
        mu = settings.outer_momentum
        self.optimizer = torch.optim.SGD(
            self.anchor, lr=settings.outer_lr, momentum=mu, nesterov=mu > 0
        )
        # Statistics.
        self.outer_steps = 0
        self.quantizer = Int8() if settings.pseudo_gradient_dtype == "int8" else None

    def phase_ends(self, step: int, steps: int) -> bool:
        """Whether inner step ``step`` (1-based) of ``steps`` ends a phase: every H steps, and
        the last step so that every run ends on the global model."""
        return step % self.settings.local_steps == 0 or step == steps

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients, step the anchor, and set θ to it."""
        pairs = zip(self.anchor, self.params, strict=True)
        delta = torch.cat([(a - p).reshape(-1) for a, p in pairs])
        if self.quantizer is None:
            mean = mean_fp32(delta, self.world)
        else:
            mean = mean_int8(delta, self.world, self.quantizer)
        offset = 0
        for a in self.anchor:
            a.grad = mean[offset : offset + a.numel()].view_as(a)
            offset += a.numel()
        self.optimizer.step()
        for p, a in zip(self.params, self.anchor, strict=True):
            p.copy_(a)
        self.outer_steps += 1

    @contextlib.contextmanager
    def anchor_loaded(self) -> Iterator[None]:
        """Inside the block the model's parameters are the anchor (to evaluate the global
        model mid-phase); the rank's own θ is back afterwards."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)
