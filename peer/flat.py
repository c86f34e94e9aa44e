"""One contiguous buffer for all trainable parameters of a model.

Gossip works on the model as one flat vector x: compressing, checksumming and mixing one
tensor is simpler and faster than doing it per parameter. After ``FlatParameters(model)`` the
model's parameters are views into ``flat.data``, so optimizer steps and gossip updates see the
same memory with no copies.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


class FlatParameters:
    """The trainable parameters of ``model`` re-homed into one flat tensor ``data``."""

    def __init__(self, model: nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device, got "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.numel = sum(p.numel() for _, p in named)
        self.data = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self._params = [p for _, p in named]
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                view = self.data[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                offset += n
        self.fingerprint = model_fingerprint(self.names, self.shapes, self.dtype)
        # The model as built: peers seeded alike hold the same one, so a new edge's public
        # copies can start from it without sending it (costs one more copy of the model).
        self.initial = self.data.detach().clone()

    def grad(self) -> torch.Tensor:
        """The parameters' gradients as one flat tensor (zeros where a grad is None)."""
        parts = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
            for p in self._params
        ]
        return torch.cat(parts)

    def set_grad(self, flat_grad: torch.Tensor) -> None:
        """Write a flat gradient back into the parameters' ``.grad``."""
        offset = 0
        for p in self._params:
            n = p.numel()
            g = flat_grad[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    @property
    def nbytes(self) -> int:
        return self.numel * self.data.element_size()


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's buffers that belong to its state (those ``state_dict()`` saves): not the
    non-persistent ones (attention masks, rotary caches), which every peer rebuilds alike."""
    out = []
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in skip:
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


class FloatBuffers:
    """A model's floating-point buffers (BatchNorm running mean and variance, and the like)
    gathered into one flat fp32 vector and written back.

    They are copied, not re-homed like the parameters, because modules may replace a buffer
    tensor rather than update it in place. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are left out: they count local batches, not a statistic to
    average; so are non-persistent ones (:func:`persistent_buffers`).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        named = [(n, b) for n, b in persistent_buffers(model) if b.is_floating_point()]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(b.shape) for _, b in named]
        self.numel = sum(b.numel() for _, b in named)
        self.device = named[0][1].device if named else torch.device("cpu")

    def __bool__(self) -> bool:
        return self.numel > 0

    def _tensors(self) -> list[torch.Tensor]:
        buffers = dict(persistent_buffers(self._model))
        return [buffers[n] for n in self.names]

    def gather(self) -> torch.Tensor:
        """The buffers' current values as one fp32 vector (a copy)."""
        return torch.cat([b.detach().reshape(-1).float() for b in self._tensors()])

    def add_(self, delta: torch.Tensor) -> None:
        """Add a flat fp32 vector to the buffers, in place (each keeps its dtype)."""
        offset = 0
        with torch.no_grad():
            for b in self._tensors():
                n = b.numel()
                b.add_(delta[offset : offset + n].view_as(b).to(b.dtype))
                offset += n


def model_fingerprint(names: list[str], shapes: list[tuple[int, ...]], dtype: torch.dtype) -> str:
    """A short hash of parameter names, shapes and dtype: peers must train the same model."""
    h = hashlib.sha256(str(dtype).encode())
    for n, s in zip(names, shapes, strict=True):
        h.update(f"{n}:{'x'.join(map(str, s))};".encode())
    return h.hexdigest()[:16]


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(t: torch.Tensor) -> int:
    """A cheap, exact, order-independent checksum of a tensor's bits (64-bit).

    Sums the bit patterns as integers (exact and associative, so identical on any device or
    thread count) at three strides, which catches lost, duplicated and corrupted updates of a
    public copy. Not cryptographic: it guards against accidents, not adversaries.
    """
    bits = t.detach().reshape(-1).view(_INT_VIEW[t.element_size()])
    s1 = int(bits.sum(dtype=torch.int64))
    s2 = int(bits[::2].sum(dtype=torch.int64))
    s3 = int(bits[::3].sum(dtype=torch.int64))
    return (s1 * 0x9E3779B1 + s2 * 0x85EBCA77 + s3 * 0xC2B2AE3D + t.numel()) & 0xFFFFFFFFFFFFFFFF
