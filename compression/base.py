"""Codec base classes and the one encode/decode engine every codec shares.

A codec is at most one *sparsifier* (which entries travel) followed by one *quantizer* (how
their values travel). ``TopK(0.01)`` alone is a codec (fp32 values), so is ``Int8()`` alone
(dense), and ``TopK(0.01) >> Int8()`` composes them. Codec classes are small: a sparsifier
implements :meth:`Sparsifier.select`, a quantizer :meth:`Quantizer.quantize` and
:meth:`Quantizer.dequantize`; the engine here does the rest (envelope, chunking, validation).
"""

from __future__ import annotations

import abc
import logging
import math
from typing import ClassVar

import torch
from gossipgrad.compression import wire
from gossipgrad.compression.bitpack import rice_bits_for, rice_decode, rice_encode, rice_max_bytes
from gossipgrad.compression.errors import DecodeError
from gossipgrad.compression.spec import StageArgs

__all__ = ["Codec", "Composed", "Quantizer", "Sparsifier"]

log = logging.getLogger(__name__)

#: Dense tensors are (de)quantized in chunks of this many elements: bounded temporaries, cache
#: friendly, and a multiple of every block size and of 8 (so packed bits concatenate).
CHUNK = 1 << 20
_SEED_MAX = (1 << 63) - 1


def _all_finite(t: torch.Tensor) -> bool:
    """True when every element is finite. A sum is ~40x faster than isfinite().all() on CPU;
    only when the sum is not finite (a non-finite element or an overflow) do we look closer."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if math.isfinite(float(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


class Codec(abc.ABC):
    """Tensors in, bytes out: an encoder/decoder pair named by a spec string.

    Subclasses provide :meth:`stages` and :attr:`spec`; encode/decode are shared. Codecs are
    immutable and hashable by spec, and safe to share between threads.
    """

    #: Registry name (``topk``, ``int8``, ...) for registered stage classes.
    name: ClassVar[str] = ""
    #: How the stage is written in a spec, for error messages, e.g. ``topk:RATIO[:exact]``.
    grammar: ClassVar[str] = ""

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The canonical spec string; ``from_spec(c.spec) == c``."""

    @abc.abstractmethod
    def stages(self) -> tuple[Sparsifier | None, Quantizer]:
        """The (sparsifier or None, quantizer) pair this codec runs."""

    @classmethod
    def from_args(cls, args: StageArgs) -> Codec:
        """Build this stage from its parsed spec arguments (ValueError naming the problem)."""
        raise ValueError(f"{cls.name!r} cannot be built from a spec")

    def __rshift__(self, other: Codec) -> Codec:
        """``TopK(0.01) >> Int8()``: sparsify, then quantize the kept values."""
        if not isinstance(other, Codec):
            return NotImplemented
        return Composed.of(self, other)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"from_spec({self.spec!r})"

    # ----------------------------------------------------------------------------- encode

    @torch.no_grad()
    def encode(self, t: torch.Tensor, seed: int | None = None) -> bytes:
        """Compress ``t`` into a serialized TensorEnvelope.

        Args:
            t: a float32/float16/bfloat16/float64 tensor of any shape, on any device; the work
                runs on that device and only the final bytes are copied to the host.
            seed: randomness for randomk indices and stochastic rounding (it travels in the
                envelope). None draws one from torch's default generator, so
                ``torch.manual_seed`` makes runs reproducible.

        Raises:
            ValueError: unsupported dtype, or non-finite values in ``t``.
        """
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in wire.DTYPE_TO_WIRE:
            raise ValueError(f"unsupported dtype {t.dtype}; use float32/16, bfloat16 or float64")
        if seed is None:
            seed = int(torch.randint(0, _SEED_MAX, (1,)).item())
        if not 0 <= seed < (1 << 64):
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        flat = t.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if not _all_finite(flat):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        sp, q = self.stages()
        n = flat.numel()
        index_bits = 0
        idx_bytes = None
        if sp is None:
            count = n
            vals = flat
        else:
            idx = sp.select(flat, seed)
            count = idx.numel()
            vals = torch.index_select(flat, 0, idx)
            if sp.sends_indices:
                index_bits = rice_bits_for(count, n)
                idx_bytes = rice_encode(idx, index_bits)
        values, scales = _quantize_chunked(q, vals, seed)
        return wire.build_envelope(
            shape=tuple(t.shape),
            dtype=t.dtype,
            spec=self.spec,
            seed=seed,
            count=count,
            index_bits=index_bits,
            indices=idx_bytes,
            values=values,
            scales=scales,
        )

    # ----------------------------------------------------------------------------- decode

    @torch.no_grad()
    def decode(
        self,
        data: bytes,
        *,
        device: torch.device | str | None = None,
        max_numel: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rebuild the dense tensor (same shape and dtype as encoded) on ``device`` (CPU default).

        Args:
            max_numel: reject payloads whose shape has more elements (default 2**31).
            out: optional contiguous tensor of the payload's shape and dtype to overwrite
                instead of allocating (a fresh 400 MB tensor costs ~200 ms of page faults).

        Raises:
            DecodeError: on any malformed, corrupted, inconsistent or oversized input, or an
                ``out`` that does not match (then ``out`` is left untouched).
        """
        if out is not None:
            if not out.is_contiguous():
                raise DecodeError("decode(out=...) needs a contiguous tensor")
            max_numel, dev = max(out.numel(), 1), out.device
        else:
            dev = torch.device("cpu") if device is None else torch.device(device)
        env = wire.parse_envelope(data, self.spec, max_numel)
        if out is not None and (env.shape != tuple(out.shape) or env.dtype != out.dtype):
            raise DecodeError(
                f"payload {list(env.shape)} {env.dtype} != out {list(out.shape)} {out.dtype}"
            )
        parts = self._read(env, dev)
        sp, _ = self.stages()
        if out is None:
            out = torch.empty(env.shape, dtype=env.dtype, device=dev)
        flat = out.view(-1)
        if sp is None:
            self._apply_dense(parts, flat, alpha=None)
        else:
            flat.zero_()
            idx, vals = parts
            if idx.numel():
                flat.index_copy_(0, idx, vals)
        return out

    @torch.no_grad()
    def decode_add_(self, data: bytes, out: torch.Tensor, *, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha * decode(data)`` in place, and return ``out``.

        Sparse codecs scatter-add only the kept entries. Everything is validated before ``out``
        is touched, so on DecodeError ``out`` is unchanged. The result is a deterministic
        function of (``out``, ``data``): sender and receiver applying the same bytes to
        bit-identical tensors on the same kind of device get bit-identical results (CHOCO-SGD
        relies on it). Values are dequantized in a separate op before the add, so no fused
        multiply-add can make devices disagree; ``alpha`` of +-1 is exact.

        Raises:
            DecodeError: bad input, or ``out`` of another shape or dtype than the payload.
        """
        env = wire.parse_envelope(data, self.spec, max(out.numel(), 1))
        if env.shape != tuple(out.shape):
            raise DecodeError(f"payload shape {list(env.shape)} != out shape {list(out.shape)}")
        if env.dtype != out.dtype:
            raise DecodeError(f"payload dtype {env.dtype} != out dtype {out.dtype}")
        parts = self._read(env, out.device)
        sp, _ = self.stages()
        target = (
            out.view(-1)
            if out.is_contiguous()
            else torch.zeros(out.numel(), dtype=out.dtype, device=out.device)
        )
        if sp is None:
            self._apply_dense(parts, target, alpha=alpha)
        else:
            idx, vals = parts
            if idx.numel():
                target.index_add_(0, idx, vals, alpha=alpha)
        if not out.is_contiguous():
            out.add_(target.view(out.shape))
        return out

    # ----------------------------------------------------------------------------- internals

    def _read(self, env: wire.Envelope, dev: torch.device) -> tuple:
        """Validate and decode the sections. Dense: (values u8, scales); sparse: (idx, vals)."""
        sp, q = self.stages()
        n, count = env.numel, env.count
        if sp is None and count != n:
            raise DecodeError(f"dense codec with count {count} for {n} elements")
        if sp is not None:
            lo, hi = sp.count_range(n)
            if not lo <= count <= hi:
                raise DecodeError(
                    f"{sp.spec} keeps {lo}..{hi} of {n} elements, payload has {count}"
                )
        vbytes = q.value_bytes(count, env.dtype)
        values = wire.bytes_to_tensor(wire.read_section(env, "values", exact=vbytes), dev)
        nscales = q.scale_count(count)
        sraw = wire.read_section(env, "scales", exact=4 * nscales)
        scales = wire.bytes_to_tensor(sraw, dev).view(torch.float32) if nscales else None
        q.check(values, scales, count, env.dtype)
        if sp is None:
            if env.index_bits or env.msg.indices.raw_size:
                raise DecodeError("dense codec payload carries indices")
            return values, scales
        if sp.sends_indices:
            bits = env.index_bits
            if bits > 40:
                raise DecodeError(f"index_bits {bits} too large")
            raw = wire.read_section(env, "indices", limit=rice_max_bytes(count, n, bits))
            idx = rice_decode(wire.bytes_to_tensor(raw, dev), bits, count, n)
        else:
            if env.index_bits or env.msg.indices.raw_size:
                raise DecodeError(f"{sp.spec} payload must not carry indices")
            idx = sp.indices_for(n, env.seed, dev)
        vals = _dequantize_chunked(q, values, scales, count, env.dtype)
        return idx, vals

    def _apply_dense(self, parts: tuple, flat: torch.Tensor, *, alpha: float | None) -> None:
        _, q = self.stages()
        values, scales = parts
        n = flat.numel()
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            v, s = _chunk_inputs(q, values, scales, lo, hi, flat.dtype)
            d = q.dequantize(v, s, hi - lo, flat.dtype)
            if alpha is None:
                flat[lo:hi].copy_(d)
            else:
                flat[lo:hi].add_(d, alpha=alpha)


def _chunk_inputs(
    q: Quantizer, values: torch.Tensor, scales: torch.Tensor | None, lo: int, hi: int, dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    bits = q.value_bits(dtype)
    v = values[lo * bits // 8 : (hi * bits + 7) // 8]
    s = None
    if scales is not None:
        s = scales[lo // q.block : (hi + q.block - 1) // q.block]
    return v, s


def _quantize_chunked(
    q: Quantizer, vals: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = vals.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.uint8, device=vals.device)
        return empty, (empty.float() if q.block else None)
    gen = None
    if q.stochastic:
        gen = torch.Generator(device=vals.device)
        gen.manual_seed(seed)
    if n <= CHUNK or q.lossless:  # lossless = a view of the input: no copy
        return q.quantize(vals, gen)
    values = torch.empty(q.value_bytes(n, vals.dtype), dtype=torch.uint8, device=vals.device)
    nscales = q.scale_count(n)
    scales = torch.empty(nscales, dtype=torch.float32, device=vals.device) if nscales else None
    bits = q.value_bits(vals.dtype)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        v, s = q.quantize(vals[lo:hi], gen)
        values[lo * bits // 8 : lo * bits // 8 + v.numel()].copy_(v)
        if scales is not None and s is not None:
            scales[lo // q.block : lo // q.block + s.numel()].copy_(s)
    return values, scales


def _dequantize_chunked(
    q: Quantizer, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype
) -> torch.Tensor:
    if count <= CHUNK:
        return q.dequantize(values, scales, count, dtype)
    out = torch.empty(count, dtype=dtype, device=values.device)
    for lo in range(0, count, CHUNK):
        hi = min(count, lo + CHUNK)
        v, s = _chunk_inputs(q, values, scales, lo, hi, dtype)
        out[lo:hi] = q.dequantize(v, s, hi - lo, dtype)
    return out


class Sparsifier(Codec):
    """Chooses which entries travel. Alone it sends their values unquantized."""

    #: False when the receiver regenerates the indices (randomk) instead of reading them.
    sends_indices: ClassVar[bool] = True

    def stages(self) -> tuple[Sparsifier | None, Quantizer]:
        from gossipgrad.compression.quantizers import Identity

        return self, Identity()

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """Sorted, distinct int64 indices (on ``flat``'s device) of the entries to send."""

    def count_range(self, numel: int) -> tuple[int, int]:
        """Smallest and largest number of kept entries a payload may declare for ``numel``."""
        k = self.k_for(numel)
        return k, k

    def indices_for(self, numel: int, seed: int, device: torch.device) -> torch.Tensor:
        """Regenerate the indices on the receiver (only for ``sends_indices = False``)."""
        raise NotImplementedError

    def k_for(self, numel: int) -> int:
        """Target kept count: ``round(ratio * numel)``, at least 1 for a non-empty tensor."""
        if numel == 0:
            return 0
        return min(numel, max(1, round(self.ratio * numel)))  # type: ignore[attr-defined]


class Quantizer(Codec):
    """Encodes a 1-D vector of values into bytes (plus optional float32 per-block scales).

    ``quantize`` and ``dequantize`` see chunks of at most CHUNK elements whose boundaries are
    multiples of ``block`` and of 8, so packed outputs concatenate.
    """

    #: Elements per scale (0: no scales).
    block: int = 0
    #: Uses random numbers (a generator seeded from the envelope seed is passed in).
    stochastic: bool = False
    #: decode(encode(x)) == x for every finite x.
    lossless: ClassVar[bool] = False

    def stages(self) -> tuple[Sparsifier | None, Quantizer]:
        return None, self

    @abc.abstractmethod
    def value_bits(self, dtype: torch.dtype) -> int:
        """Bits per value on the wire for a tensor of ``dtype``."""

    def value_bytes(self, count: int, dtype: torch.dtype) -> int:
        """Bytes of the values section for ``count`` values."""
        return (count * self.value_bits(dtype) + 7) // 8

    def scale_count(self, count: int) -> int:
        """Number of float32 scales for ``count`` values."""
        return 0 if not self.block else (count + self.block - 1) // self.block

    @abc.abstractmethod
    def quantize(
        self, v: torch.Tensor, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (uint8 value bytes, float32 scales or None) for the 1-D vector ``v``."""

    @abc.abstractmethod
    def dequantize(
        self, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Inverse of :meth:`quantize`: ``count`` values of ``dtype`` on ``values``' device."""

    def check(
        self, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype: torch.dtype
    ) -> None:
        """Raise DecodeError unless every value that decoding can produce is finite."""
        if scales is not None and scales.numel():
            bad = not _all_finite(scales) or bool((scales < 0).any())
            if bad or not math.isfinite(float(scales.max()) * self.max_level()):
                raise DecodeError(f"{self.spec}: negative, non-finite or overflowing scales")

    def max_level(self) -> float:
        """Largest |integer level| a scale multiplies (for the overflow check)."""
        return 1.0


class Composed(Codec):
    """A sparsifier followed by a quantizer of its kept values (``TopK(r) >> Int8()``)."""

    def __init__(self, sparsifier: Sparsifier, quantizer: Quantizer) -> None:
        self._sp = sparsifier
        self._q = quantizer

    @staticmethod
    def of(first: Codec, second: Codec) -> Codec:
        """Compose two stages, rejecting combinations that mean nothing (ValueError)."""
        from gossipgrad.compression.quantizers import Identity

        if isinstance(first, Composed) or isinstance(second, Composed):
            raise ValueError("a spec has at most one sparsifier and one quantizer")
        if isinstance(first, Quantizer):
            raise ValueError(
                f"nothing can follow the quantizer {first.spec!r}: its output is packed bytes; "
                "put the sparsifier first"
            )
        if isinstance(second, Sparsifier):
            raise ValueError(
                f"two sparsifiers ({first.spec!r}, {second.spec!r}): use one ratio instead"
            )
        assert isinstance(first, Sparsifier) and isinstance(second, Quantizer)
        if isinstance(second, Identity):
            return first
        return Composed(first, second)

    @property
    def spec(self) -> str:
        return f"{self._sp.spec}+{self._q.spec}"

    def stages(self) -> tuple[Sparsifier | None, Quantizer]:
        return self._sp, self._q
