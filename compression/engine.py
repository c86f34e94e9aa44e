"""The one encode/decode pipeline every codec runs: envelope, chunking, validation.

A codec is a (sparsifier or None, quantizer) pair (see :mod:`.base`). Encoding selects the kept
entries, codes their indices, quantizes their values chunk by chunk and builds the envelope;
decoding validates every section against what the codec requires before writing anything, then
dequantizes chunk by chunk. The stages are used only through their methods, so this module
imports none of them.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from gossipgrad.compression import native, wire
from gossipgrad.compression.bitpack import BITMAP_INDEX_BITS, Bitmap, RiceStream, bitmap_pays
from gossipgrad.compression.difference import subtract_into
from gossipgrad.compression.errors import DecodeError
from gossipgrad.compression.finite import all_finite

if TYPE_CHECKING:
    from gossipgrad.compression.base import Codec, Quantizer
    from gossipgrad.compression.selection import Selection

__all__ = [
    "CHUNK",
    "Encoded",
    "Received",
    "add_all",
    "decode",
    "decode_add",
    "encode",
    "encode_difference",
    "encode_parts",
    "inspect",
    "receive",
]

#: Dense tensors are (de)quantized in chunks of this many elements: bounded temporaries, cache
#: friendly, and a multiple of every block size and of 8 (so packed bits concatenate).
CHUNK = 1 << 20
_SEED_MAX = (1 << 63) - 1


def encode(codec: Codec, t: torch.Tensor, seed: int | None) -> bytes:
    """Compress ``t`` with ``codec`` into a serialized envelope (see :meth:`.Codec.encode`)."""
    return encode_parts(codec, t, seed)[0]


@dataclass(frozen=True)
class Encoded:
    """What an encoder built, kept: applying it is ``decode_add`` of its bytes, bit for bit
    (the same dequantization, the same add), without decoding the indices again."""

    codec: Codec
    dtype: torch.dtype
    count: int
    idx: torch.Tensor | Bitmap | None  # the kept positions; None for a dense codec
    values: torch.Tensor
    scales: torch.Tensor | None

    def add_to_(self, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha * decode(bytes)`` in place (same shape; its dtype or, rounded to it,
        another floating one); returns ``out``."""
        _apply(self.codec, self.idx, self.values, self.scales, self.count, self.dtype, out, alpha)
        return out

    def residual_norm(self, t: torch.Tensor, squares: float | None = None) -> float:
        """||t − decode(bytes)|| for the tensor ``t`` that was encoded, ``t`` left unchanged:
        what error feedback keeps of it once these bytes are sent, measured in one read of
        ``t`` instead of subtracting the bytes from it and reading it again. Sparse codecs:
        ||t||² − ||t_S||² + ||t_S − v||² over the kept set S (``squares``: ||t||², when the
        caller has it; then only the kept entries are read); dense ones compare a chunk at a
        time, in cache."""
        flat = t.detach().reshape(-1)
        sp, q = self.codec.stages()
        if sp is None:
            total = 0.0
            scratch = torch.empty(min(CHUNK, flat.numel()), dtype=flat.dtype, device=flat.device)
            for lo in range(0, flat.numel(), CHUNK):
                hi = min(flat.numel(), lo + CHUNK)
                v, s = _chunk_inputs(q, self.values, self.scales, lo, hi, self.dtype)
                sent = q.dequantize(v, s, hi - lo, self.dtype)  # may be a view of t (lossless)
                d = torch.sub(flat[lo:hi], sent.to(flat.dtype), out=scratch[: hi - lo])
                total += float(torch.dot(d, d))
            return total**0.5
        total = float(torch.dot(flat, flat)) if squares is None else squares
        if isinstance(self.idx, Bitmap):
            parts = _bitmap_stretches(q, self.idx, self.values, self.scales, self.dtype)
            for lo, hi, bits, vals in parts:
                kept = _bitmap_gather(bits, flat[lo:hi], vals.numel())
                left = kept - vals.to(flat.dtype)
                total += float(torch.dot(left, left)) - float(torch.dot(kept, kept))
        elif self.idx is not None and self.idx.numel():
            return self.left_of_kept(torch.index_select(flat, 0, self.idx), total)
        return max(total, 0.0) ** 0.5

    def left_of_kept(self, kept: torch.Tensor, squares: float) -> float:
        """:meth:`residual_norm` from the kept entries' values of the tensor encoded, in
        order, and its ||t||² (``squares``): sqrt(||t||² − ||t_S||² + ||t_S − v||²)."""
        _, q = self.codec.stages()
        vals = _dequantize_chunked(q, self.values, self.scales, self.count, self.dtype)
        left = kept - vals.to(kept.dtype)
        total = squares + (float(torch.dot(left, left)) - float(torch.dot(kept, kept)))
        return max(total, 0.0) ** 0.5


def _checked_seed(seed: int | None) -> int:
    if seed is None:
        seed = int(torch.randint(0, _SEED_MAX, (1,)).item())
    if not 0 <= seed < (1 << 64):
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def _check_dtype(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in wire.DTYPE_TO_WIRE:
        raise ValueError(f"unsupported dtype {t.dtype}; use float32/16, bfloat16 or float64")


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


_NON_FINITE = "cannot encode a tensor with NaN or infinite values"


def encode_parts(codec: Codec, t: torch.Tensor, seed: int | None) -> tuple[bytes, Encoded]:
    """``encode`` that also returns what it built (see :class:`Encoded`)."""
    _check_dtype(t)
    seed = _checked_seed(seed)
    flat = _flat(t)
    if not all_finite(flat):
        raise ValueError(_NON_FINITE)
    sp, _ = codec.stages()
    kept = None if sp is None else sp.select_parts(flat, seed)
    return _encode_selected(codec, t, flat, kept, seed)


def encode_accumulated(
    codec: Codec, e: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seed: int | None
) -> tuple[bytes, Encoded, float | None] | None:
    """Error feedback's step fused (see :meth:`.Codec.encode_accumulated`): ``e`` ends as
    the residual; None where the codec's sparsifier has no fused pass for these tensors."""
    sp, q = codec.stages()
    if sp is None or not (e.shape == a.shape == b.shape and e.is_contiguous()):
        return None
    if not (a.is_contiguous() and b.is_contiguous()):
        return None
    seed = _checked_seed(seed)
    block = q.fused_selection_block()
    kept = sp.select_accumulating(e.view(-1), a.view(-1), b.view(-1), seed, int2_block=block)
    if kept is None:
        return None
    data, sent = _encode_selected(codec, e, e.view(-1), kept, seed)
    if kept.int2 is None:  # else the pass took the values out already
        sent.add_to_(e, alpha=-1.0)
    return data, sent, kept.left


def _encode_selected(
    codec: Codec, t: torch.Tensor, flat: torch.Tensor, kept: Selection | None, seed: int
) -> tuple[bytes, Encoded]:
    """The envelope of ``t`` (``flat``: its entries, contiguous), ``kept`` of them selected
    (None: a dense codec, all)."""
    sp, q = codec.stages()
    index_bits, idx_bytes, idx = 0, None, None
    if sp is None or kept is None:
        count, vals = flat.numel(), flat
    else:
        count = kept.count
        if kept.idx is None:  # the fused selection: its bitmap holds the positions
            assert kept.bitmap is not None
            idx = Bitmap(kept.bitmap, flat.numel(), count)
        else:
            idx = kept.idx
        vals = torch.index_select(flat, 0, kept.idx) if kept.values is None else kept.values
        if sp.sends_indices:
            index_bits, idx_bytes = sp.encode_selection(kept, flat.numel())
    if kept is not None and kept.int2 is not None:  # the selection's pass quantized them
        values, scales = kept.int2
    else:
        values, scales = _quantize_chunked(q, vals, seed)
    data = wire.build_envelope(
        shape=tuple(t.shape),
        dtype=t.dtype,
        spec=codec.spec,
        seed=seed,
        count=count,
        index_bits=index_bits,
        indices=idx_bytes,
        values=values,
        scales=scales,
    )
    return data, Encoded(codec, t.dtype, count, idx, values, scales)


def encode_difference(
    codec: Codec,
    a: torch.Tensor,
    b: torch.Tensor,
    seed: int | None,
    scratch: torch.Tensor | None = None,
    fold: bool = False,
) -> tuple[bytes, Encoded, float]:
    """``encode_parts(a − b)``, the same bytes, and ||(a − b) − decode(bytes)||: what error
    feedback keeps of the difference once the bytes are sent.

    ``b`` may be narrower than ``a`` (float16 copies of float32 parameters); the difference
    has ``a``'s dtype. A dense codec takes the difference a chunk at a time, quantizes it and
    measures what stays while the chunk is in cache: one read of ``a`` and ``b`` instead of
    some six passes over a model-sized difference, and no model-sized buffer. A sparse top-k
    below 1/32 selects a chunk of the difference at a time (``_encode_sparse_difference``);
    other sparse codecs select over the whole difference, built in ``scratch`` (a buffer of
    ``a``'s shape and dtype; allocated if None).

    ``fold``: then ``b += decode(bytes)``, bit for bit as ``decode_add_`` of the bytes would
    (CHOCO's x̂ += q); a dense codec adds each chunk while it is in cache. ``b`` must then be
    contiguous. On a non-finite difference (ValueError) the chunks before it are folded
    already: ``b`` no longer matches its peer's copy (a CHOCO edge's checksum then calls for
    a resync)."""
    _check_dtype(a)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if fold and not b.is_contiguous():
        raise ValueError("encode_difference(fold=True) needs a contiguous b")
    sp, q = codec.stages()
    if sp is not None:
        chunked = _encode_sparse_difference(codec, a, b, seed, fold)
        if chunked is not None:
            return chunked
        diff = subtract_into(a, b, torch.empty_like(a) if scratch is None else scratch)
        data, sent = encode_parts(codec, diff, seed)
        left = sent.residual_norm(diff)
        if fold:
            sent.add_to_(b)
        return data, sent, left
    seed = _checked_seed(seed)
    fused = q.fused_difference(a, b, fold)
    if fused is not None:
        values, scales, left = fused
        return *_dense_envelope(codec, a, seed, values, scales), left
    fa, fb = _flat(a), _flat(b)
    n, dtype = fa.numel(), a.dtype
    d_buf = torch.empty(min(CHUNK, n), dtype=dtype, device=fa.device)
    kept2 = 0.0

    def difference(lo: int, hi: int) -> torch.Tensor:
        d = subtract_into(fa[lo:hi], fb[lo:hi], d_buf[: hi - lo])
        if not all_finite(d):
            raise ValueError(_NON_FINITE)
        return d

    def measure(lo: int, d: torch.Tensor, v: torch.Tensor, s: torch.Tensor | None) -> None:
        nonlocal kept2
        sent = q.dequantize(v, s, d.numel(), dtype)  # may be a view of d (lossless)
        if fold:  # as _apply_dense adds it, before d is overwritten below
            fb[lo : lo + d.numel()].add_(sent.to(fb.dtype))
        left = torch.sub(d, sent.to(dtype), out=d)
        kept2 += float(torch.dot(left, left))

    values, scales = _quantize_chunks(q, n, dtype, fa.device, seed, difference, measure)
    return *_dense_envelope(codec, a, seed, values, scales), kept2**0.5


def _encode_sparse_difference(
    codec: Codec, a: torch.Tensor, b: torch.Tensor, seed: int | None, fold: bool
) -> tuple[bytes, Encoded, float] | None:
    """:func:`encode_difference` for a sparsifier that selects a chunk of the difference at
    a time (``Sparsifier.select_difference``): the same bytes, no difference built; what
    stays, ||a − b||² − ||kept||² + ||kept − sent||², from the pass's sum and the kept values.
    None where the sparsifier has no such pass for these tensors."""
    sp, _ = codec.stages()
    if sp is None or not (a.is_contiguous() and b.is_contiguous()):
        return None
    seed = _checked_seed(seed)
    found = sp.select_difference(a.view(-1), b.view(-1), seed)
    if found is None:
        return None
    kept, squares = found
    assert kept.values is not None
    data, sent = _encode_selected(codec, a, a.view(-1), kept, seed)
    left = sent.left_of_kept(kept.values, squares)
    if fold:
        sent.add_to_(b)
    return data, sent, left


def _dense_envelope(
    codec: Codec, t: torch.Tensor, seed: int, values: torch.Tensor, scales: torch.Tensor | None
) -> tuple[bytes, Encoded]:
    """The envelope of a dense codec's quantized ``t``, and what it holds."""
    data = wire.build_envelope(
        shape=tuple(t.shape),
        dtype=t.dtype,
        spec=codec.spec,
        seed=seed,
        count=t.numel(),
        index_bits=0,
        indices=None,
        values=values,
        scales=scales,
    )
    return data, Encoded(codec, t.dtype, t.numel(), None, values, scales)


def decode(
    codec: Codec,
    data: bytes,
    *,
    device: torch.device | str | None,
    max_numel: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Rebuild the dense tensor (see :meth:`.Codec.decode`)."""
    if out is not None:
        if not out.is_contiguous():
            raise DecodeError("decode(out=...) needs a contiguous tensor")
        max_numel, dev = max(out.numel(), 1), out.device
    else:
        dev = torch.device("cpu") if device is None else torch.device(device)
    env = wire.parse_envelope(data, codec.spec, max_numel)
    if out is not None and (env.shape != tuple(out.shape) or env.dtype != out.dtype):
        raise DecodeError(
            f"payload {list(env.shape)} {env.dtype} != out {list(out.shape)} {out.dtype}"
        )
    parts = _read(codec, env, dev)
    sp, q = codec.stages()
    if out is None:
        out = torch.empty(env.shape, dtype=env.dtype, device=dev)
    flat = out.view(-1)
    if sp is None:
        _apply_dense(q, parts, flat, alpha=None)
    else:
        flat.zero_()
        idx, vals = parts
        if idx.numel():
            flat.index_copy_(0, idx, vals)
    return out


@dataclass(frozen=True)
class Received:
    """A payload checked on arrival (:func:`receive`): its header's fields and its sections,
    decompressed and checked, so that adding it reads neither again (a zstd section
    decompressed and the CRC taken twice cost about a third of a model copy per message).
    Its indices are decoded, and checked, where it is added, as ``decode_add`` does. A
    section stored raw is a view of the bytes, which it keeps alive (a receiver that keeps
    the bytes too, to forward them, holds it once)."""

    spec: str
    header: wire.Header
    values: torch.Tensor
    scales: torch.Tensor | None
    raw: bytes | memoryview | None  # the index section, decompressed

    @property
    def shape(self) -> tuple[int, ...]:
        return self.header.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.header.dtype


def receive(codec: Codec, data: bytes, max_numel: int | None) -> Received:
    """Check ``data``'s envelope and sections as ``decode`` would, short of decoding sparse
    indices, and keep what the check decompressed (see :meth:`.Codec.receive`)."""
    env = wire.parse_envelope(data, codec.spec, max_numel)
    values, scales, raw = _sections(codec, env, torch.device("cpu"))
    header = wire.Header(env.shape, env.dtype, env.numel, env.seed, env.count, env.index_bits)
    return Received(codec.spec, header, values, scales, raw)


def _opened(
    codec: Codec, payload: bytes | Received, out: torch.Tensor, cast: bool
) -> tuple[wire.Header, torch.Tensor, torch.Tensor | None, bytes | None]:
    """A payload's header and sections, checked to add into ``out`` (``_envelope_for``):
    read from its bytes, or as its receipt kept them."""
    if not isinstance(payload, Received):
        env = _envelope_for(codec, payload, out, cast)
        return (env, *_sections(codec, env, out.device))
    if payload.spec != codec.spec:
        raise DecodeError(f"payload was written by codec {payload.spec!r}, not {codec.spec!r}")
    _check_fits(payload.shape, payload.dtype, out, cast)
    scales = payload.scales
    if scales is not None:
        scales = scales.to(out.device)
    return payload.header, payload.values.to(out.device), scales, payload.raw


def decode_add(
    codec: Codec,
    data: bytes | Received,
    out: torch.Tensor,
    *,
    alpha: float,
    cast: bool = False,
) -> torch.Tensor:
    """``out += alpha * decode(data)`` in place (see :meth:`.Codec.decode_add_`)."""
    env, values, scales, raw = _opened(codec, data, out, cast)
    sp, _ = codec.stages()
    idx = None
    if sp is not None:
        idx = _indices(sp, env, raw, out.device, pieces=True)
    _apply(codec, idx, values, scales, env.count, env.dtype, out, alpha)
    return out


def _envelope_for(codec: Codec, data: bytes, out: torch.Tensor, cast: bool) -> wire.Envelope:
    """``data``'s envelope, checked to add into ``out`` (its shape; its dtype, or with
    ``cast`` any floating one)."""
    env = wire.parse_envelope(data, codec.spec, max(out.numel(), 1))
    _check_fits(env.shape, env.dtype, out, cast)
    return env


def _check_fits(shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor, cast: bool) -> None:
    """DecodeError unless a payload of ``shape`` and ``dtype`` adds into ``out``."""
    if shape != tuple(out.shape):
        raise DecodeError(f"payload shape {list(shape)} != out shape {list(out.shape)}")
    if dtype != out.dtype and not (cast and out.is_floating_point()):
        raise DecodeError(f"payload dtype {dtype} != out dtype {out.dtype}")


def add_all(
    codec: Codec, terms: Sequence[tuple[bytes | Received | Encoded, float]], out: torch.Tensor
) -> list[tuple[int, DecodeError]]:
    """``out += Σ_k alpha_k decode(c_k)`` in the order given (see :meth:`.Codec.add_all_`);
    returns the (index, error) of each payload left out because it did not decode."""
    fused = _add_all_fused(codec, terms, out)
    if fused is not None:
        return fused
    failed = []
    for i, (payload, alpha) in enumerate(terms):
        if isinstance(payload, Encoded):
            payload.add_to_(out, alpha=alpha)
            continue
        try:
            decode_add(codec, payload, out, alpha=alpha)
        except DecodeError as err:
            failed.append((i, err))
    return failed


def _add_all_fused(
    codec: Codec, terms: Sequence[tuple[bytes | Received | Encoded, float]], out: torch.Tensor
) -> list[tuple[int, DecodeError]] | None:
    """:func:`add_all` in one pass over ``out`` where every term is a bitmap-coded message and
    ``out`` takes the kernels (the bits of adding them one after another); None, with
    nothing added, otherwise."""
    sp, q = codec.stages()
    n = out.numel()
    if sp is None or not sp.sends_indices or not 1 < len(terms) <= native.MAX_TERMS:
        return None
    if not (bitmap_pays(sp.count_range(n)[1], n) and native.usable(out)):
        return None
    parts, failed = [], []
    for i, (payload, alpha) in enumerate(terms):
        if isinstance(payload, Encoded):
            if not isinstance(payload.idx, Bitmap):
                return None
            parts.append((payload.idx, payload.values, payload.scales, payload.dtype, alpha))
            continue
        try:
            env, values, scales, raw = _opened(codec, payload, out, cast=False)
            if env.index_bits != BITMAP_INDEX_BITS:
                return None
            idx = _indices(sp, env, raw, out.device, pieces=True)
        except DecodeError as err:
            failed.append((i, err))
            continue
        if not isinstance(idx, Bitmap):
            return None
        parts.append((idx, values, scales, env.dtype, alpha))
    if not parts:
        return failed
    flat = out.view(-1)
    streams = [_bitmap_stretches(q, b, v, s, d, every=True) for b, v, s, d, _ in parts]
    alphas = [alpha for *_, alpha in parts]
    for stretch in zip(*streams, strict=True):
        lo, hi = stretch[0][0], stretch[0][1]
        pieces = [(bits, vals.to(torch.float32)) for _, _, bits, vals in stretch]
        native.bitmap_add_many(pieces, alphas, flat[lo:hi])
    return failed


def _apply(
    codec: Codec,
    idx: torch.Tensor | Iterable[torch.Tensor] | Bitmap | RiceStream | None,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    count: int,
    dtype: torch.dtype,
    out: torch.Tensor,
    alpha: float,
) -> None:
    """``out += alpha * values`` (dequantized; at ``idx`` for a sparse codec: the indices,
    or consecutive pieces of them): the one add that ``decode_add`` and ``Encoded.add_to_``
    share, so both give the same bits."""
    sp, q = codec.stages()
    target = (
        out.view(-1)
        if out.is_contiguous()
        else torch.zeros(out.numel(), dtype=out.dtype, device=out.device)
    )
    if sp is None:
        _apply_dense(q, (values, scales), target, alpha=alpha, dtype=dtype)
    elif isinstance(idx, Bitmap) and native.usable(target):
        for lo, hi, bits, vals in _bitmap_stretches(q, idx, values, scales, dtype):
            native.bitmap_add(bits, vals.to(target.dtype), target[lo:hi], alpha)
    elif isinstance(idx, Bitmap):
        _index_add_chunked(q, idx.pieces(), values, scales, count, dtype, target, alpha)
    elif isinstance(idx, RiceStream) and native.usable(target):
        state = (ctypes.c_int64 * 3)(0, 0, -1)  # head bit, remainder bit, last position
        for _, vals in _dequantized_chunks(q, values, scales, count, dtype):
            vals = vals.to(target.dtype)
            native.rice_add(idx.head, idx.rem, idx.bits, vals, alpha, target, state)
    elif isinstance(idx, RiceStream):
        _index_add_chunked(q, idx.indices(), values, scales, count, dtype, target, alpha)
    elif idx is not None:
        _index_add_chunked(q, idx, values, scales, count, dtype, target, alpha)
    if not out.is_contiguous():
        out.add_(target.view(out.shape))


def _bitmap_stretches(
    q: Quantizer,
    bitmap: Bitmap,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
    every: bool = False,
) -> Iterator[tuple[int, int, np.ndarray, torch.Tensor]]:
    """``(lo, hi, bits, vals)`` for each ``CHUNK`` positions [lo, hi) of ``bitmap`` holding
    any (``every``: each of them): their bytes of the bitmap and the dequantized values of
    their set bits, in order. A stretch's values begin anywhere: they are dequantized from
    the block and byte before them (``align``), and those before are dropped."""
    align = math.lcm(8, q.block or 1)
    done = 0  # values of the stretches before
    for lo, hi, bits, held in bitmap.stretches(CHUNK, every):
        if done + held > bitmap.count:  # validated first: only a bug gets here
            raise DecodeError(f"more positions than the {bitmap.count} values")
        if not held:  # ``every``: a stretch without any
            yield lo, hi, bits, torch.empty(0, dtype=dtype)
            continue
        start = done - done % align
        v, s = _chunk_inputs(q, values, scales, start, done + held, dtype)
        yield lo, hi, bits, q.dequantize(v, s, done + held - start, dtype)[done - start :]
        done += held


def _bitmap_gather(bits: np.ndarray, src: torch.Tensor, held: int) -> torch.Tensor:
    """``src``'s values at the ``held`` set bits of its stretch of a bitmap, in order."""
    if native.usable(src):
        return native.bitmap_gather(bits, src, held)
    hit = np.flatnonzero(np.unpackbits(bits)[: src.numel()])
    return torch.index_select(src, 0, torch.from_numpy(hit))


def _index_add_chunked(
    q: Quantizer,
    idx: torch.Tensor | Iterable[torch.Tensor],
    values: torch.Tensor,
    scales: torch.Tensor | None,
    count: int,
    dtype: torch.dtype,
    target: torch.Tensor,
    alpha: float,
) -> None:
    """``target[idx] += alpha * dequantize(values)``, the values dequantized a chunk at a
    time while in cache and matched to the index pieces as they come: no buffer of all the
    values, nor (with pieces) of all the indices. The indices are distinct, so the adds give
    the same bits in any grouping."""
    pieces = idx.split(CHUNK) if isinstance(idx, torch.Tensor) else idx
    vals, vlo, vhi = None, 0, 0  # the dequantized chunk holds values [vlo, vhi)
    pos = 0  # values applied
    for piece in pieces:
        taken = 0
        while taken < piece.numel():
            if pos == vhi:
                if vhi == count:  # pieces are validated first: only a bug gets here
                    raise DecodeError(f"more positions than the {count} values")
                vlo, vhi = vhi, min(count, vhi + CHUNK)
                v, s = _chunk_inputs(q, values, scales, vlo, vhi, dtype)
                vals = q.dequantize(v, s, vhi - vlo, dtype).to(target.dtype)
            m = min(piece.numel() - taken, vhi - pos)
            at, part = piece[taken : taken + m], vals[pos - vlo : pos - vlo + m]
            target.index_add_(0, at, part, alpha=alpha)
            taken += m
            pos += m


def inspect(
    codec: Codec, data: bytes, max_numel: int | None
) -> tuple[tuple[int, ...], torch.dtype]:
    """Check ``data``'s envelope and sections as ``decode`` would, short of decoding sparse
    indices; returns the payload's shape and dtype (see :meth:`.Codec.inspect`)."""
    received = receive(codec, data, max_numel)
    return received.shape, received.dtype


def _read(codec: Codec, env: wire.Envelope, dev: torch.device) -> tuple:
    """Validate and decode the sections. Dense: (values u8, scales); sparse: (idx, vals)."""
    values, scales, raw = _sections(codec, env, dev)
    sp, q = codec.stages()
    if sp is None:
        return values, scales
    idx = _indices(sp, env, raw, dev)
    vals = _dequantize_chunked(q, values, scales, env.count, env.dtype)
    return idx, vals


def _indices(
    sp, env: wire.Header, raw, dev: torch.device, pieces: bool = False
) -> torch.Tensor | Iterable[torch.Tensor] | Bitmap | RiceStream:
    """The kept entries' indices: decoded from the index section, or drawn from the seed;
    with ``pieces``, possibly as consecutive pieces or a validated bitmap
    (``Sparsifier.decode_index_pieces``)."""
    if raw is not None:
        decode = sp.decode_index_pieces if pieces else sp.decode_indices
        return decode(wire.bytes_to_tensor(raw, dev), env.index_bits, env.count, env.numel)
    return sp.indices_for(env.numel, env.seed, dev)


def _sections(codec: Codec, env: wire.Envelope, dev: torch.device) -> tuple:
    """Check every section against what the codec requires, short of decoding the indices
    (the costly part of a sparse payload): (values u8, scales, raw index bytes or None)."""
    sp, q = codec.stages()
    n, count = env.numel, env.count
    if sp is None and count != n:
        raise DecodeError(f"dense codec with count {count} for {n} elements")
    if sp is not None:
        lo, hi = sp.count_range(n)
        if not lo <= count <= hi:
            raise DecodeError(f"{sp.spec} keeps {lo}..{hi} of {n} elements, payload has {count}")
    vbytes = q.value_bytes(count, env.dtype)
    values = wire.bytes_to_tensor(wire.read_section(env, "values", exact=vbytes), dev)
    nscales = q.scale_count(count)
    sraw = wire.read_section(env, "scales", exact=4 * nscales)
    scales = wire.bytes_to_tensor(sraw, dev).view(torch.float32) if nscales else None
    q.check(values, scales, count, env.dtype)
    carries_indices = bool(env.index_bits or env.msg.indices.raw_size)
    if carries_indices and (sp is None or not sp.sends_indices):
        raise DecodeError(f"{codec.spec} payload must not carry indices")
    raw = None
    if sp is not None and sp.sends_indices:
        limit = sp.max_index_bytes(count, n, env.index_bits)
        raw = wire.read_section(env, "indices", limit=limit)
    return values, scales, raw


def _apply_dense(
    q: Quantizer,
    parts: tuple,
    flat: torch.Tensor,
    *,
    alpha: float | None,
    dtype: torch.dtype | None = None,
) -> None:
    """Dequantize into ``flat`` a chunk at a time (``dtype``: the payload's, when ``flat``
    has another; each chunk is rounded to ``flat``'s dtype before it is added)."""
    values, scales = parts
    n = flat.numel()
    dtype = flat.dtype if dtype is None else dtype
    if alpha is not None and q.fused_add(values, scales, dtype, flat, alpha):
        return
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        v, s = _chunk_inputs(q, values, scales, lo, hi, dtype)
        d = q.dequantize(v, s, hi - lo, dtype).to(flat.dtype)
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
    if n <= CHUNK or q.lossless:  # lossless = a view of the input: no copy
        return q.quantize(vals, _generator(q, seed, vals.device))
    return _quantize_chunks(q, n, vals.dtype, vals.device, seed, lambda lo, hi: vals[lo:hi])


def _generator(q: Quantizer, seed: int, device: torch.device) -> torch.Generator | None:
    if not q.stochastic:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _quantize_chunks(
    q: Quantizer,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    chunk: Callable[[int, int], torch.Tensor],
    then: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize the ``n`` values ``chunk(lo, hi)`` gives, ``CHUNK`` at a time, into one
    values and one scales tensor (one generator for all: the bytes of a whole-tensor
    quantization); ``then(lo, chunk, values, scales)`` sees each chunk's result."""
    gen = _generator(q, seed, device)
    values = torch.empty(q.value_bytes(n, dtype), dtype=torch.uint8, device=device)
    nscales = q.scale_count(n)
    scales = torch.empty(nscales, dtype=torch.float32, device=device) if nscales else None
    bits = q.value_bits(dtype)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        c = chunk(lo, hi)
        v, s = q.quantize(c, gen)
        values[lo * bits // 8 : lo * bits // 8 + v.numel()].copy_(v)
        if scales is not None and s is not None:
            scales[lo // q.block : lo // q.block + s.numel()].copy_(s)
        if then is not None:
            then(lo, c, v, s)
    return values, scales


def _dequantize_chunked(
    q: Quantizer, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype
) -> torch.Tensor:
    if count <= CHUNK:
        return q.dequantize(values, scales, count, dtype)
    out = torch.empty(count, dtype=dtype, device=values.device)
    for lo, chunk in _dequantized_chunks(q, values, scales, count, dtype):
        out[lo : lo + chunk.numel()] = chunk
    return out


def _dequantized_chunks(
    q: Quantizer, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(lo, values lo.. of dtype)``: the ``count`` values dequantized ``CHUNK`` at a time."""
    for lo in range(0, count, CHUNK):
        hi = min(count, lo + CHUNK)
        v, s = _chunk_inputs(q, values, scales, lo, hi, dtype)
        yield lo, q.dequantize(v, s, hi - lo, dtype)
