"""Bit-level packing: fixed-width integers, bit vectors, Golomb-Rice and bitmap coded indices.

Every function takes and returns torch tensors and runs on the tensor's device: on CPU the
work is done by numpy's vectorised bit routines (``packbits``/``unpackbits``), elsewhere by
torch ops, so CUDA tensors are packed on the GPU. Both paths produce identical bytes; the
``use_numpy`` argument exists so tests can compare them on CPU. No Python loop runs per element.

Bit order is MSB first throughout (the first value or bit lands in the high bits of byte 0);
the last byte is zero-padded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gossipgrad.compression import native
from gossipgrad.compression.errors import DecodeError

__all__ = [
    "BITMAP_INDEX_BITS",
    "MAX_RICE_BITS",
    "Bitmap",
    "RiceStream",
    "bitmap_decode",
    "bitmap_encode",
    "bitmap_pays",
    "bitmap_pieces",
    "checked_bitmap",
    "checked_rice",
    "pack_bits",
    "pack_uint",
    "rice_bits_for",
    "rice_decode",
    "rice_encode",
    "rice_max_bytes",
    "set_bits",
    "unpack_bits",
    "unpack_uint",
]

#: Largest Golomb-Rice parameter accepted on the wire (gaps of 2**40 are far beyond any tensor).
MAX_RICE_BITS = 40
#: ``index_bits`` of an index section coded as a bitmap (no Rice parameter is that wide).
BITMAP_INDEX_BITS = 64
#: Positions per bitmap chunk: a multiple of 8, so chunks' bytes concatenate.
_BITMAP_CHUNK = 1 << 20

_WEIGHTS_CACHE: dict[torch.device, torch.Tensor] = {}


#: Tests set this to run the torch (GPU) code paths on CPU tensors.
FORCE_TORCH = False


def numpy_path(t: torch.Tensor) -> bool:
    """True when ``t``'s work should go through numpy (CPU tensors, unless FORCE_TORCH)."""
    return t.device.type == "cpu" and not FORCE_TORCH


def _numpy_ok(t: torch.Tensor, use_numpy: bool | None) -> bool:
    return numpy_path(t) if use_numpy is None else use_numpy


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS_CACHE.get(device)
    if w is None:
        w = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
        _WEIGHTS_CACHE[device] = w
    return w


def pack_bits(bits: torch.Tensor, *, use_numpy: bool | None = None) -> torch.Tensor:
    """Pack a 1-D tensor of 0/1 values into uint8 bytes, MSB first, zero-padded."""
    bits = bits.reshape(-1)
    if _numpy_ok(bits, use_numpy):
        arr = bits.cpu().numpy().astype(np.bool_, copy=False)
        return torch.from_numpy(np.packbits(arr)).to(bits.device)
    n = bits.numel()
    pad = (-n) % 8
    b = bits.to(torch.uint8)
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return (b.view(-1, 8) * _bit_weights(b.device)).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(data: torch.Tensor, nbits: int, *, use_numpy: bool | None = None) -> torch.Tensor:
    """Unpack the first ``nbits`` bits of uint8 ``data`` into a uint8 tensor of 0/1 values."""
    if nbits > data.numel() * 8:
        raise DecodeError(f"bit stream holds {data.numel() * 8} bits, {nbits} needed")
    if _numpy_ok(data, use_numpy):
        arr = np.unpackbits(data.cpu().numpy(), count=nbits)
        return torch.from_numpy(arr).to(data.device)
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=data.device)
    return ((data[:, None] >> shifts) & 1).reshape(-1)[:nbits]


def _pack_small(v: np.ndarray, width: int) -> np.ndarray:
    """numpy pack for width < 8: eight values make one ``width``-byte big-endian group."""
    n = v.size
    groups = (n + 7) // 8
    padded = np.zeros(groups * 8, dtype=np.uint64)
    padded[:n] = v
    padded = padded.reshape(groups, 8)
    g = np.zeros(groups, dtype=np.uint64)
    for i in range(8):
        g |= padded[:, i] << np.uint64(width * (7 - i))
    out = g.astype(">u8").view(np.uint8).reshape(groups, 8)[:, 8 - width :]
    return np.ascontiguousarray(out).reshape(-1)[: (n * width + 7) // 8]


def _unpack_small(data: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`_pack_small`: ``count`` int64 values."""
    groups = (count + 7) // 8
    buf = np.zeros((groups, 8), dtype=np.uint8)
    flat = np.zeros(groups * width, dtype=np.uint8)
    used = min(data.size, groups * width)
    flat[:used] = data[:used]
    buf[:, 8 - width :] = flat.reshape(groups, width)
    g = buf.view(">u8").reshape(-1).astype(np.uint64)
    # All eight shifts in one broadcast pass, written in order (eight strided column writes
    # took 55 ms for 10M values of 3 bits, this 32).
    shifts = np.arange(7, -1, -1, dtype=np.uint64) * np.uint64(width)
    out = (g[:, None] >> shifts[None, :]) & np.uint64((1 << width) - 1)
    return out.view(np.int64).reshape(-1)[:count]


def pack_uint(values: torch.Tensor, width: int, *, use_numpy: bool | None = None) -> torch.Tensor:
    """Pack non-negative integers below ``2**width`` into ``ceil(n*width/8)`` bytes.

    Args:
        values: 1-D integer tensor; values must already be in ``[0, 2**width)``.
        width: bits per value, 0..64 (0 packs to nothing).
    """
    if not 0 <= width <= 64:
        raise ValueError(f"width must be in 0..64, got {width}")
    n = values.numel()
    if width == 0 or n == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    if width == 8:
        return values.reshape(-1).to(torch.uint8)
    if _numpy_ok(values, use_numpy):
        v = values.reshape(-1).cpu().numpy()
        if width < 8:
            return torch.from_numpy(_pack_small(v, width)).to(values.device)
        container = 8 if width <= 8 else 16 if width <= 16 else 32 if width <= 32 else 64
        as_bytes = v.astype(f">u{container // 8}").view(np.uint8).reshape(n, container // 8)
        bits = np.unpackbits(as_bytes, axis=1)[:, container - width :]
        return torch.from_numpy(np.packbits(bits.reshape(-1))).to(values.device)
    shifts = torch.arange(width - 1, -1, -1, dtype=torch.int64, device=values.device)
    bits = (values.reshape(-1, 1).to(torch.int64) >> shifts) & 1
    return pack_bits(bits.reshape(-1), use_numpy=False)


def unpack_uint(
    data: torch.Tensor, width: int, count: int, *, use_numpy: bool | None = None
) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: read ``count`` values of ``width`` bits as int64."""
    if count == 0 or width == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    nbits = count * width
    if nbits > data.numel() * 8:
        raise DecodeError(f"packed stream holds {data.numel() * 8} bits, {nbits} needed")
    if width == 8:
        return data[:count].to(torch.int64)
    if _numpy_ok(data, use_numpy):
        if width < 8:
            return torch.from_numpy(_unpack_small(data.cpu().numpy(), width, count)).to(data.device)
        bits = np.unpackbits(data.cpu().numpy(), count=nbits).reshape(count, width)
        container = 16 if width <= 16 else 32 if width <= 32 else 64
        full = np.zeros((count, container), dtype=np.uint8)
        full[:, container - width :] = bits
        vals = np.packbits(full, axis=1).view(f">u{container // 8}").reshape(-1)
        return torch.from_numpy(vals.astype(np.int64)).to(data.device)
    bits = unpack_bits(data, nbits, use_numpy=False).view(count, width).to(torch.int64)
    shifts = torch.arange(width - 1, -1, -1, dtype=torch.int64, device=data.device)
    return (bits << shifts).sum(1)


def rice_bits_for(count: int, numel: int) -> int:
    """Golomb-Rice parameter for ``count`` sorted indices spread over ``numel`` positions.

    For geometric gaps with mean m the best power-of-two Golomb parameter is close to
    ``m * ln 2`` (Gallager and van Voorhis 1975); we round its log down.
    """
    if count == 0:
        return 0
    mean_gap = numel / count
    return max(0, min(MAX_RICE_BITS, math.floor(math.log2(max(1.0, mean_gap * math.log(2))))))


def rice_max_bytes(count: int, numel: int, bits: int) -> int:
    """Upper bound on the Rice-coded size of ``count`` distinct indices below ``numel``.

    The gaps (minus one) sum to at most ``numel - count``, so the unary parts use at most
    ``count + (numel >> bits)`` bits and the remainders ``count * bits``.
    """
    return (count + (numel >> bits) + 7) // 8 + (count * bits + 7) // 8


def rice_encode(indices: torch.Tensor, bits: int, *, use_numpy: bool | None = None) -> torch.Tensor:
    """Delta-encode sorted distinct indices and Golomb-Rice pack the gaps.

    Layout: the unary parts (``q`` zero bits then a one, per index) as one bit stream, padded
    to a byte, then the ``bits``-wide remainders packed back to back. Gap ``i`` is
    ``idx[i] - idx[i-1] - 1`` (``idx[0]`` for the first), so every gap is non-negative.
    """
    idx = indices.reshape(-1).to(torch.int64)
    n = idx.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=idx.device)
    if _numpy_ok(idx, use_numpy):
        a = idx.cpu().numpy()
        gaps = np.diff(a, prepend=-1)
        gaps -= 1
        ones = np.right_shift(gaps, bits)  # q, then in place the terminators' positions
        ones += 1
        np.cumsum(ones, out=ones)
        ones -= 1
        unary = np.zeros(int(ones[-1]) + 1, dtype=np.bool_)
        unary[ones] = True
        head = np.packbits(unary)
        gaps &= (1 << bits) - 1  # the remainders
        rem = pack_uint(torch.from_numpy(gaps), bits, use_numpy=True)
        return torch.from_numpy(np.concatenate([head, rem.numpy()])).to(idx.device)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    q = gaps >> bits
    ones = torch.cumsum(q + 1, 0) - 1
    unary = torch.zeros(int(ones[-1].item()) + 1, dtype=torch.uint8, device=idx.device)
    unary[ones] = 1
    head = pack_bits(unary, use_numpy=False)
    rem = pack_uint(gaps & ((1 << bits) - 1), bits, use_numpy=False)
    return torch.cat([head, rem])


def rice_decode(
    data: torch.Tensor, bits: int, count: int, numel: int, *, use_numpy: bool | None = None
) -> torch.Tensor:
    """Decode :func:`rice_encode` output, validating it fully.

    Raises:
        DecodeError: wrong number of unary terminators, non-zero padding, stray bytes, or an
            index at or beyond ``numel``.
    """
    if not 0 <= bits <= MAX_RICE_BITS:
        raise DecodeError(f"index_bits {bits} outside 0..{MAX_RICE_BITS}")
    if count == 0:
        if data.numel():
            raise DecodeError(f"index section has {data.numel()} bytes for 0 indices")
        return torch.empty(0, dtype=torch.int64, device=data.device)
    rem_bytes = (count * bits + 7) // 8
    head_bytes = data.numel() - rem_bytes
    if head_bytes <= 0:
        raise DecodeError("index section too short for its remainders")
    head, rem = data[:head_bytes], data[head_bytes:]
    if _numpy_ok(data, use_numpy):
        # As bools: numpy finds the set positions of a bool array four times faster.
        hb = np.unpackbits(head.cpu().numpy()).view(np.bool_)
        ones_np = np.flatnonzero(hb).astype(np.int64, copy=False)
        if ones_np.size != count:
            raise DecodeError(f"index stream holds {ones_np.size} gaps, header says {count}")
        ones = torch.from_numpy(ones_np)
    else:
        ones = torch.nonzero(unpack_bits(head, head_bytes * 8, use_numpy=False)).reshape(-1)
        if ones.numel() != count:
            raise DecodeError(f"index stream holds {ones.numel()} gaps, header says {count}")
    last_one = int(ones[-1].item())
    if last_one // 8 != head_bytes - 1:
        raise DecodeError("index stream has trailing bytes after its last gap")
    if rem_bytes and bits and (count * bits) % 8:
        pad_bits = 8 - (count * bits) % 8
        if int(rem[-1].item()) & ((1 << pad_bits) - 1):
            raise DecodeError("non-zero padding bits in the index remainders")
    ones = ones.to(data.device)
    r = unpack_uint(rem, bits, count, use_numpy=use_numpy)
    # idx_i = Σ_{j<=i} ((q_j << bits) + r_j + 1) − 1, where ones_i − i = Σ_{j<=i} q_j (the
    # i-th terminator follows i earlier ones and the zeros of q_0..q_i): in place, no gaps.
    # numpy's arange on CPU: torch's took 37 ms for 10M positions on one thread, numpy's 10.
    counter = (
        torch.from_numpy(np.arange(count, dtype=np.int64))
        if ones.device.type == "cpu"
        else torch.arange(count, device=ones.device)
    )
    idx = ones.sub_(counter).bitwise_left_shift_(bits)
    idx.add_(r.add_(1).cumsum_(0)).sub_(1)
    if int(idx[-1].item()) >= numel:
        raise DecodeError(f"index {int(idx[-1].item())} out of range for {numel} elements")
    return idx


def bitmap_pays(count: int, numel: int) -> bool:
    """Whether ``count`` of ``numel`` positions travel as a bitmap rather than Rice-coded.

    From a density of 1/8 on, a bitmap compressed by the envelope's zstd is within 1 % of the
    Rice stream's bytes (0.735 against 0.728 bits per position at 20 %, measured on random
    sets) and several times cheaper to build and read: no gaps, no prefix sums, one bit per
    position. Below it the Rice stream is clearly smaller (0.142 against 0.227 at 2 %).
    """
    return count * 8 >= numel > 0


def bitmap_encode(
    indices: torch.Tensor, numel: int, *, use_numpy: bool | None = None
) -> torch.Tensor:
    """One bit per position, set at the sorted distinct ``indices``; MSB first, zero-padded."""
    idx = indices.reshape(-1).to(torch.int64)
    if not _numpy_ok(idx, use_numpy):
        mask = torch.zeros(numel, dtype=torch.uint8, device=idx.device)
        mask[idx] = 1
        return pack_bits(mask, use_numpy=False)
    a = idx.cpu().numpy()
    out = np.empty((numel + 7) // 8, dtype=np.uint8)
    mask = np.empty(min(numel, _BITMAP_CHUNK), dtype=np.bool_)
    bounds = np.searchsorted(a, np.arange(0, numel + _BITMAP_CHUNK, _BITMAP_CHUNK))
    for c, lo in enumerate(range(0, numel, _BITMAP_CHUNK)):
        hi = min(numel, lo + _BITMAP_CHUNK)
        m = mask[: hi - lo]
        m.fill(False)
        m[a[bounds[c] : bounds[c + 1]] - lo] = True
        out[lo // 8 : (hi + 7) // 8] = np.packbits(m)
    return torch.from_numpy(out).to(idx.device)


def bitmap_decode(
    data: torch.Tensor, count: int, numel: int, *, use_numpy: bool | None = None
) -> torch.Tensor:
    """Decode :func:`bitmap_encode` output: the int64 positions of its set bits, validated.

    Raises:
        DecodeError: a length other than ``ceil(numel / 8)`` bytes, non-zero padding bits, or
            a number of set bits other than ``count`` (counted before any index is held).
    """
    if not _numpy_ok(data, use_numpy):
        _check_bitmap_frame(data, numel)
        idx = torch.nonzero(unpack_bits(data, numel, use_numpy=False)).reshape(-1)
        if idx.numel() != count:
            raise DecodeError(f"index bitmap holds {idx.numel()} positions, header says {count}")
        return idx
    out = np.empty(count, dtype=np.int64)
    held = 0
    for piece in bitmap_pieces(data, count, numel):
        out[held : held + piece.numel()] = piece.numpy()
        held += piece.numel()
    return torch.from_numpy(out).to(data.device)


def _check_bitmap_frame(data: torch.Tensor, numel: int) -> int:
    """The bitmap's byte count, checked against ``numel`` with its padding bits (DecodeError)."""
    nbytes = (numel + 7) // 8
    if data.numel() != nbytes:
        raise DecodeError(f"index bitmap has {data.numel()} bytes, {numel} positions need {nbytes}")
    pad = (-numel) % 8
    if pad and int(data[-1].item()) & ((1 << pad) - 1):
        raise DecodeError("non-zero padding bits in the index bitmap")
    return nbytes


def set_bits(d: np.ndarray) -> int:
    """How many bits of the uint8 array ``d`` are set (eight bytes to a word where numpy
    counts bits itself, from 2.0 on)."""
    if not hasattr(np, "bitwise_count"):
        return sum(
            int(np.unpackbits(d[lo : lo + _BITMAP_CHUNK]).sum(dtype=np.int64))
            for lo in range(0, d.size, _BITMAP_CHUNK)
        )
    words = d.size // 8
    total = int(np.bitwise_count(d[: words * 8].view(np.uint64)).sum(dtype=np.int64))
    return total + int(np.bitwise_count(d[words * 8 :]).sum(dtype=np.int64))


@dataclass(frozen=True)
class Bitmap:
    """``count`` sorted distinct positions of ``numel``, held as :func:`bitmap_encode`'s
    bitmap (uint8, on CPU): a dense selection's positions, read a stretch at a time where an
    array of them would take 8 bytes per kept entry."""

    data: torch.Tensor
    numel: int
    count: int

    def stretches(
        self, size: int, every: bool = False
    ) -> Iterator[tuple[int, int, np.ndarray, int]]:
        """``(lo, hi, bytes, set)`` for each ``size`` positions [lo, hi) holding a set bit
        (``every``: for each, set or not): their bytes of the bitmap and how many of them are
        set (``size``: a multiple of 8)."""
        d = self.data.numpy()
        for lo in range(0, self.numel, size):
            hi = min(self.numel, lo + size)
            part = d[lo // 8 : (hi + 7) // 8]
            held = set_bits(part)
            if held or every:
                yield lo, hi, part, held

    def pieces(self) -> Iterator[torch.Tensor]:
        """The positions as int64 pieces of at most ``_BITMAP_CHUNK`` positions' worth, in
        order."""
        for lo, _, part, _ in self.stretches(_BITMAP_CHUNK):
            hit = np.flatnonzero(np.unpackbits(part).view(np.bool_))
            yield torch.from_numpy(np.add(hit, lo, out=hit))


@dataclass(frozen=True)
class RiceStream:
    """``count`` positions of ``numel``, Rice coded (:func:`rice_encode`'s layout) and
    validated as :func:`rice_decode` validates them, held as the stream: its unary ``head``
    and its ``rem``-ainders, each with ``native.PAD`` zero bytes past its end, for the fused
    kernel that adds through them without an array of positions."""

    head: np.ndarray
    rem: np.ndarray
    bits: int
    count: int
    numel: int

    def indices(self) -> torch.Tensor:
        """The positions as int64 (numpy's decode)."""
        head, rem = self.head[: -native.PAD], self.rem[: -native.PAD]
        data = torch.from_numpy(np.concatenate([head, rem]))
        return rice_decode(data, self.bits, self.count, self.numel)


def checked_rice(data: torch.Tensor, bits: int, count: int, numel: int) -> RiceStream:
    """``data`` as a :class:`RiceStream`, validated in full (DecodeError) with the fused
    kernels' sum of the remainders: the terminators' count, no byte past the last one, zero
    padding, and the last position (from the last terminator and the remainders' sum) below
    ``numel`` -- so every position is, the gaps being non-negative."""
    if not 0 <= bits <= MAX_RICE_BITS:
        raise DecodeError(f"index_bits {bits} outside 0..{MAX_RICE_BITS}")
    d = data.cpu().numpy()
    rem_bytes = (count * bits + 7) // 8
    head_bytes = d.size - rem_bytes
    if count == 0 or head_bytes <= 0:
        raise DecodeError("index section too short for its remainders")
    head, rem = d[:head_bytes], d[head_bytes:]
    held = set_bits(head)
    if held != count:
        raise DecodeError(f"index stream holds {held} gaps, header says {count}")
    last = int(head[-1])
    if not last:
        raise DecodeError("index stream has trailing bytes after its last gap")
    last_one = 8 * head_bytes - (last & -last).bit_length()  # the last terminator's bit
    pad_bits = (-count * bits) % 8
    if pad_bits and int(rem[-1]) & ((1 << pad_bits) - 1):
        raise DecodeError("non-zero padding bits in the index remainders")
    pad = np.zeros(native.PAD, dtype=np.uint8)
    head, rem = np.concatenate([head, pad]), np.concatenate([rem, pad])
    final = ((last_one - (count - 1)) << bits) + native.field_sum(rem, bits, count) + count - 1
    if final >= numel:
        raise DecodeError(f"index {final} out of range for {numel} elements")
    return RiceStream(head, rem, bits, count, numel)


def checked_bitmap(data: torch.Tensor, count: int, numel: int) -> Bitmap:
    """``data`` as a :class:`Bitmap` of ``count`` positions of ``numel``, validated in full
    (DecodeError: its length, padding bits or number of set bits) before any is read."""
    _check_bitmap_frame(data, numel)
    cpu = data.cpu()
    held = set_bits(cpu.numpy())
    if held != count:
        raise DecodeError(f"index bitmap holds {held} positions, header says {count}")
    return Bitmap(cpu, numel, count)


def bitmap_pieces(data: torch.Tensor, count: int, numel: int) -> Iterator[torch.Tensor]:
    """:func:`bitmap_decode`'s positions, a chunk at a time (numpy): validated in full before
    this returns (DecodeError), then produced as int64 pieces of at most ``_BITMAP_CHUNK``
    positions' worth, in order. A caller that applies each piece as it comes never holds the
    positions of the whole bitmap (8 bytes per kept entry) nor fails half-way through."""
    return checked_bitmap(data, count, numel).pieces()
