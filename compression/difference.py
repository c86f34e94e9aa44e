"""a − b for float tensors of mixed widths: what an encoder of a difference reads."""

from __future__ import annotations

import torch

__all__ = ["subtract_into"]


def subtract_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a − b``, bit for bit as ``torch.sub(a, b, out=out)``; returns ``out``.

    A copy of a narrower float dtype (float16 copies against float32 parameters) is first
    converted into ``out``: PyTorch's CPU kernels for mixed float32/float16 operands take 5-8
    times as long as that exact conversion plus a same-dtype subtraction, which computes the
    same float32 values."""
    if b.dtype != a.dtype and a.dtype == out.dtype == torch.promote_types(a.dtype, b.dtype):
        out.copy_(b)
        return torch.sub(a, out, out=out)
    return torch.sub(a, b, out=out)
