"""The fused kernels of ``kernels.c``, loaded with ctypes where they were built.

numpy and torch make one pass over memory per operation; a codec's steps chain several (a
top-k selection: abs, compare, nonzero, pack, gather). Each kernel is one pass: a top-k's
selection, fused with error feedback's accumulation, giving its bitmap and values; a bitmap's
positions Rice coded; adding one or several bitmap- or Rice-coded messages into a tensor;
the sign codec against a float16 copy with the copy's x̂ += q folded in, and its decode; the
consensus step. A diloco round's tensor work at 100M parameters: 15 copies of the model
against 32 (``scripts/bench_round.py``; docs/compression.md, "Fused kernels").

They give numpy's bits where a peer without them must agree (the selection, so the bytes;
every add into a tensor); an encoder's scales are its own (a sum in another order) and its
fold adds what its bytes decode to. Callers use them only where they apply (the dtypes
below, contiguous, on CPU) and keep numpy's path otherwise.

The library is built with the package (an optional extension: a wheel or install without a
C compiler has none) and used on x86-64 CPUs with AVX2 and F16C. ``GOSSIPGRAD_NATIVE_KERNELS=0``
turns it off (benchmarks compare both paths that way).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "accumulate_select",
    "accumulate_select_int2",
    "add_difference",
    "available",
    "bitmap_add",
    "bitmap_add_many",
    "bitmap_gather",
    "consensus",
    "dequantize_codes",
    "field_sum",
    "int2_first_zero",
    "rice_add",
    "rice_encode_bitmap",
    "select",
    "sign_add",
    "sign_encode",
    "status",
    "usable",
]

log = logging.getLogger(__name__)

#: Set to "0" to keep numpy's passes even where the kernels are built.
ENV = "GOSSIPGRAD_NATIVE_KERNELS"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "gg_select_f32": ([_ptr, _i64, _f32, _ptr, _ptr, _i64], _i64),
    "gg_accumulate_select_f32": ([_ptr, _ptr, _ptr, _i64, _f32, _ptr, _ptr, _i64, _ptr], _i64),
    "gg_accumulate_select_int2": (
        [_ptr, _ptr, _ptr, _i64, _f32, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr],
        _i64,
    ),
    "gg_bitmap_add_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _f32], _i64),
    "gg_bitmap_gather_f32": ([_ptr, _i64, _ptr, _ptr, _i64], _i64),
    "gg_bitmap_add_many_f32": ([_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr], _i64),
    "gg_int2_first_zero": ([_ptr, _i64], _i64),
    "gg_int2_dequantize": ([_ptr, _ptr, _i64, _i64, _ptr], None),
    "gg_int4_dequantize": ([_ptr, _ptr, _i64, _i64, _ptr], None),
    "gg_rice_encode_bitmap": ([_ptr, _i64, _i64, ctypes.c_int, _ptr, _i64, _ptr], _i64),
    "gg_field_sum": ([_ptr, ctypes.c_int, _i64], _i64),
    "gg_rice_add_f32": ([_ptr, _ptr, ctypes.c_int, _i64, _ptr, _f32, _ptr, _ptr], None),
    "gg_sign_encode_f16": ([_ptr, _ptr, _i64, _i64, _ptr, _ptr, ctypes.c_int, _ptr], _i64),
    "gg_sign_add_f16": ([_ptr, _ptr, _i64, _i64, _ptr], None),
    "gg_add_difference_f32": ([_ptr, _ptr, _ptr, _i64], None),
    "gg_consensus_f32": (
        [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, ctypes.c_int, _ptr],
        ctypes.c_double,
    ),
}


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.is_file():
            return path
    return None


def _load() -> None:
    global _lib, _status
    if os.environ.get(ENV, "1") == "0":
        _status = f"off ({ENV}=0)"
        return
    path = _library_path()
    if path is None:
        _status = "not built (no C compiler at install): numpy passes"
        return
    try:
        lib = ctypes.CDLL(str(path))
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        if not lib.gg_fast():
            _status = "built, but this CPU has no AVX2 and F16C: numpy passes"
            return
    except (OSError, AttributeError) as exc:
        _status = f"not loadable ({exc}): numpy passes"
        return
    _lib, _status = lib, "avx2"


def status() -> str:
    """What the codecs' fused passes run on: ``avx2``, or why numpy's serve (loads the
    library on the first call)."""
    with _lock:
        if _status is None:
            _load()
            log.info("fused kernels: %s", _status)
        return _status  # type: ignore[return-value]


def available() -> bool:
    """Whether the kernels are loaded and this CPU runs them."""
    if _status is None:  # once: every later call only reads what it found
        status()
    return _lib is not None


def usable(*tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels apply to these tensors: loaded, of ``dtype``, contiguous, on CPU."""
    return available() and all(
        t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def select(x: np.ndarray, threshold: float, bits: np.ndarray, values: np.ndarray) -> int:
    """The entries of float32 ``x`` with ``|x| >= threshold``: their bitmap into ``bits``
    (``ceil(x.size / 8)`` bytes) and their values, packed in order, into ``values``. Returns
    how many were kept, or -1 where they would not fit in ``values.size - 8`` (the last 8
    take a vector store's overrun)."""
    _need(x.dtype == np.float32 and x.flags.c_contiguous, "x must be contiguous float32")
    _need(bits.dtype == np.uint8 and bits.size >= (x.size + 7) // 8, "bits too short")
    _need(values.dtype == np.float32 and values.size >= 8, "values too short")
    assert _lib is not None
    return int(
        _lib.gg_select_f32(
            x.ctypes.data, x.size, threshold, bits.ctypes.data, values.ctypes.data, values.size - 8
        )
    )


def accumulate_select(
    e: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    threshold: float,
    bits: np.ndarray,
    values: np.ndarray,
) -> tuple[int, int]:
    """``e += a − b`` (float32, contiguous, one size) and :func:`select` of the sum, in one
    pass: (kept, bad). ``kept`` is -1 where more than ``values.size - 8`` would be kept (``e``
    is then accumulated all the same); ``bad`` is 0, or 1 + the index of the first group of
    eight entries whose sum is not finite (``e`` accumulated before that group only)."""
    room = _accumulation_room(e, a, b, bits, values)
    assert _lib is not None
    kept = ctypes.c_int64()
    bad = _lib.gg_accumulate_select_f32(
        e.data_ptr(), a.data_ptr(), b.data_ptr(), e.numel(), threshold, bits.ctypes.data,
        values.ctypes.data, room, ctypes.byref(kept),
    )  # fmt: skip
    return kept.value, int(bad)


def _accumulation_room(
    e: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: np.ndarray, values: np.ndarray
) -> int:
    """The kept values ``values`` has room for (8 fewer than its size: a vector store's
    overrun), once an accumulating selection's arguments are checked."""
    _need(usable(e, a, b) and e.numel() == a.numel() == b.numel(), "e, a, b: one float32 size")
    _need(bits.dtype == np.uint8 and bits.size >= (e.numel() + 7) // 8, "bits too short")
    _need(values.dtype == np.float32 and values.size >= 8, "values too short")
    return values.size - 8


def _codes_of(codes: torch.Tensor, count: int, per_byte: int = 4) -> None:
    _need(
        codes.dtype == torch.uint8 and codes.device.type == "cpu" and codes.is_contiguous(),
        "codes must be contiguous uint8 on CPU",
    )
    _need(codes.numel() >= -(-count // per_byte), "codes too short")


def int2_first_zero(codes: torch.Tensor, count: int) -> int:
    """The index of the first of ``count`` int2 codes (four a byte, high bits first) that
    is 0, which ``Int2`` never writes; -1 where none is."""
    _codes_of(codes, count)
    assert _lib is not None
    return int(_lib.gg_int2_first_zero(codes.data_ptr(), count))


#: The code widths :func:`dequantize_codes` takes: its kernel per width.
DEQUANTIZED_BITS = {2: "gg_int2_dequantize", 4: "gg_int4_dequantize"}


def dequantize_codes(
    bits: int, codes: torch.Tensor, scales: torch.Tensor, block: int, count: int
) -> torch.Tensor:
    """``count`` codes of ``bits`` bits (int2: four a byte, int4: two; high bits first)
    dequantized as ``Int2`` and ``Int4`` do (the level times its block's scale, one
    rounding), into a new float32 tensor, in one pass."""
    _need(bits in DEQUANTIZED_BITS, f"bits {bits}: one of {sorted(DEQUANTIZED_BITS)}")
    _codes_of(codes, count, 8 // bits)
    _need(block >= 8 and block & (block - 1) == 0, f"block {block}: a power of two, 8 or more")
    _need(usable(scales) and scales.numel() >= -(-count // block), "scales too short")
    out = torch.empty(count, dtype=torch.float32)
    assert _lib is not None
    getattr(_lib, DEQUANTIZED_BITS[bits])(
        codes.data_ptr(), scales.data_ptr(), block.bit_length() - 1, count, out.data_ptr()
    )
    return out


#: Most kept values per block :func:`accumulate_select_int2` quantizes (kernels.c's bound).
MAX_INT2_BLOCK = 1024


def accumulate_select_int2(
    e: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    threshold: float,
    bits: np.ndarray,
    values: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    block: int,
) -> tuple[int, int, int, float | None]:
    """:func:`accumulate_select`, the kept values also quantized as ``Int2(block=block)``
    quantizes them (round to nearest) into ``codes`` and ``scales``, and error feedback's
    ``e -= dequantized`` at their positions, in the same pass: (kept, written, bad, left).
    ``written``: how many kept values, the first in order, ``e`` holds the residual of
    (all of them when ``kept >= 0`` and ``bad == 0``; a caller falling back puts
    ``values[:written]`` back first). ``left``: ||e|| after, summed as the pass wrote it
    (within float32 rounding), where the pass ended with a selection; else None."""
    room = _accumulation_room(e, a, b, bits, values)
    _need(8 <= block <= MAX_INT2_BLOCK and block & (block - 1) == 0, f"block {block}")
    _need(codes.dtype == np.uint8 and codes.size >= (room + 3) // 4, "codes too short")
    _need(scales.dtype == np.float32 and scales.size >= -(-room // block), "scales too short")
    assert _lib is not None
    out, left2 = (ctypes.c_int64 * 2)(), ctypes.c_double()
    bad = _lib.gg_accumulate_select_int2(
        e.data_ptr(), a.data_ptr(), b.data_ptr(), e.numel(), threshold, bits.ctypes.data,
        values.ctypes.data, room, codes.ctypes.data, scales.ctypes.data,
        block.bit_length() - 1, out, ctypes.byref(left2),
    )  # fmt: skip
    left = left2.value**0.5 if left2.value >= 0 and not bad else None
    return out[0], out[1], int(bad), left


def bitmap_add(bits: np.ndarray, values: torch.Tensor, target: torch.Tensor, alpha: float) -> None:
    """``target[p] += values[j] * alpha`` for the j-th set bit p of the bitmap ``bits`` over
    ``target``'s positions; ``values`` holds exactly one value per set bit (ValueError
    otherwise, before anything is added only where the caller counted them)."""
    n, count = target.numel(), values.numel()
    _need(bits.dtype == np.uint8 and bits.size >= (n + 7) // 8, "bits too short")
    _need(usable(values, target), "values and target must be contiguous float32 on CPU")
    assert _lib is not None
    used = _lib.gg_bitmap_add_f32(
        bits.ctypes.data, n, values.data_ptr(), count, target.data_ptr(), alpha
    )
    _need(used == count, f"the bitmap holds other than {count} positions")


#: Most terms ``bitmap_add_many`` takes in one pass (kernels.c's bound).
MAX_TERMS = 64


def bitmap_add_many(
    parts: list[tuple[np.ndarray, torch.Tensor]], alphas: list[float], target: torch.Tensor
) -> None:
    """:func:`bitmap_add` of each ``(bits, values)`` in turn, with its alpha, in one pass over
    ``target``: the bits of the adds one after another (ValueError where a bitmap holds
    other than its values; the target may then be part-added)."""
    n, terms = target.numel(), len(parts)
    _need(0 < terms == len(alphas) <= MAX_TERMS, f"1..{MAX_TERMS} terms, one alpha each")
    _need(usable(target, *(v for _, v in parts)), "target and values contiguous float32")
    _need(all(b.dtype == np.uint8 and b.size >= (n + 7) // 8 for b, _ in parts), "bits short")
    assert _lib is not None
    bits = (ctypes.c_void_p * terms)(*(b.ctypes.data for b, _ in parts))
    values = (ctypes.c_void_p * terms)(*(v.data_ptr() for _, v in parts))
    counts = (ctypes.c_int64 * terms)(*(v.numel() for _, v in parts))
    weights = (ctypes.c_float * terms)(*alphas)
    bad = _lib.gg_bitmap_add_many_f32(terms, bits, values, counts, weights, n, target.data_ptr())
    _need(bad == 0, "a bitmap holds more positions than its values")


def bitmap_gather(bits: np.ndarray, src: torch.Tensor, count: int) -> torch.Tensor:
    """``src``'s values at the set bits of ``bits`` (exactly ``count`` of them: ValueError
    otherwise), packed in order into a new float32 tensor."""
    n = src.numel()
    _need(bits.dtype == np.uint8 and bits.size >= (n + 7) // 8, "bits too short")
    _need(usable(src), "src must be contiguous float32 on CPU")
    assert _lib is not None
    out = torch.empty(count, dtype=torch.float32)
    got = _lib.gg_bitmap_gather_f32(bits.ctypes.data, n, src.data_ptr(), out.data_ptr(), count)
    _need(got == count, f"the bitmap holds other than {count} positions")
    return out


def sign_encode(
    a: torch.Tensor, b: torch.Tensor, block: int, fold: bool
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The sign codec of ``a − b`` (``a`` float32, ``b`` a float16 copy of its shape), a
    ``block`` at a time: its sign bits (MSB first), its float32 scales (the blocks' mean
    magnitudes) and ||(a − b) − decoded||; with ``fold``, ``b += decoded`` as a float16
    ``decode_add_`` would. ValueError on a non-finite difference (the blocks before it are
    folded already)."""
    _need(usable(a) and usable(b, dtype=torch.float16), "a float32, b float16, both contiguous")
    _need(a.numel() == b.numel() and block >= 8 and block & (block - 1) == 0, "bad shape/block")
    assert _lib is not None
    n = a.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
    scales = torch.empty((n + block - 1) // block, dtype=torch.float32)
    left2 = ctypes.c_double()
    bad = _lib.gg_sign_encode_f16(
        a.data_ptr(), b.data_ptr(), n, block, bits.data_ptr(), scales.data_ptr(), int(fold),
        ctypes.byref(left2),
    )  # fmt: skip
    if bad:
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    return bits, scales, max(left2.value, 0.0) ** 0.5


def sign_add(bits: torch.Tensor, scales: torch.Tensor, block: int, target: torch.Tensor) -> None:
    """``target += decode(bits, scales)`` for a float16 ``target``: each value ±scale rounded
    to float16, added in float32 and rounded once, as torch's add of the decoded tensor."""
    n = target.numel()
    _need(usable(target, dtype=torch.float16), "target must be contiguous float16 on CPU")
    _need(bits.numel() >= (n + 7) // 8 and bits.is_contiguous(), "bits too short")
    _need(scales.numel() >= (n + block - 1) // block and usable(scales), "scales too short")
    assert _lib is not None
    _lib.gg_sign_add_f16(bits.data_ptr(), scales.data_ptr(), n, block, target.data_ptr())


def add_difference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``x += a − b`` (float32, contiguous, one size; ``a − b`` rounded first, as a ``sub``
    into a buffer and an ``add_`` give it) in one pass."""
    _need(usable(x, a, b) and x.numel() == a.numel() == b.numel(), "x, a, b: one float32 size")
    assert _lib is not None
    _lib.gg_add_difference_f32(x.data_ptr(), a.data_ptr(), b.data_ptr(), x.numel())


def consensus(
    x: torch.Tensor,
    publics: list[torch.Tensor],
    mirrors: list[torch.Tensor],
    weights: list[float],
    gamma: float,
    also_into: torch.Tensor | None = None,
) -> float:
    """CHOCO's consensus step ``x += γ Σ_j w_j (mirror_j − public_j)`` in one pass (float32
    ``x``; every copy float16, or every one float32), each edge's difference taken in float32
    before it is weighted; returns ||Σ_j w_j (mirror_j − public_j)||. ``also_into`` (float32,
    x's size, not overlapping it): written the new x too, in the same pass."""
    dtype = mirrors[0].dtype if mirrors else torch.float32
    _need(usable(x) and dtype in (torch.float16, torch.float32), "x float32, copies float")
    if also_into is not None:
        _need(usable(also_into) and also_into.numel() == x.numel(), "also_into float32 of x's size")
    _need(usable(*publics, *mirrors, dtype=dtype), "copies of one dtype, contiguous, on CPU")
    _need(0 < len(mirrors) == len(publics) == len(weights), "one public and weight per mirror")
    _need(all(t.numel() == x.numel() for t in (*publics, *mirrors)), "copies of x's size")
    assert _lib is not None
    count = len(mirrors)
    public_at = (ctypes.c_void_p * count)(*(p.data_ptr() for p in publics))
    mirror_at = (ctypes.c_void_p * count)(*(m.data_ptr() for m in mirrors))
    w = (ctypes.c_float * count)(*weights)
    half = int(dtype == torch.float16)
    dist2 = _lib.gg_consensus_f32(
        x.data_ptr(),
        public_at,
        mirror_at,
        w,
        count,
        x.numel(),
        gamma,
        half,
        None if also_into is None else also_into.data_ptr(),
    )
    return max(dist2, 0.0) ** 0.5


#: Readable bytes a Rice stream's head and remainders need past their ends (64-bit reads).
PAD = 9


def rice_encode_bitmap(bits: np.ndarray, n: int, count: int, rbits: int) -> np.ndarray | None:
    """The ``count`` set positions of the bitmap ``bits`` (over ``n`` positions) Rice coded
    with parameter ``rbits`` in bitpack.rice_encode's layout (the same bytes); None where the
    bitmap holds other than ``count``."""
    _need(bits.dtype == np.uint8 and bits.size >= (n + 7) // 8, "bits too short")
    _need(0 <= rbits <= 40 and count >= 0, "bad Rice parameter or count")
    assert _lib is not None
    head = np.zeros(count + (n >> rbits) // 8 + 2, dtype=np.uint8)
    rem = np.empty((count * rbits + 7) // 8 + 1, dtype=np.uint8)
    used = _lib.gg_rice_encode_bitmap(
        bits.ctypes.data, n, count, rbits, head.ctypes.data, head.size, rem.ctypes.data
    )
    if used < 0:
        return None
    return np.concatenate([head[:used], rem[: (count * rbits + 7) // 8]])


def field_sum(padded: np.ndarray, rbits: int, count: int) -> int:
    """The sum of ``count`` fields ``rbits`` wide packed in ``padded`` (PAD bytes past the
    fields)."""
    _need(padded.dtype == np.uint8 and padded.size >= (count * rbits + 7) // 8 + PAD, "short")
    assert _lib is not None
    return int(_lib.gg_field_sum(padded.ctypes.data, rbits, count))


def rice_add(
    head: np.ndarray,
    rem: np.ndarray,
    rbits: int,
    values: torch.Tensor,
    alpha: float,
    target: torch.Tensor,
    state: ctypes.Array,
) -> None:
    """``target[idx_j] += values[j] * alpha`` for the next ``values.numel()`` positions of a
    validated Rice stream (``head``, ``rem``: each with PAD bytes past its end); ``state``
    (three int64: 0, 0, -1 to start) carries the stream's place from one call to the next.
    The caller has checked the positions (all below ``target.numel()``) and their count."""
    _need(usable(values, target), "values and target must be contiguous float32 on CPU")
    assert _lib is not None
    _lib.gg_rice_add_f32(
        head.ctypes.data, rem.ctypes.data, rbits, values.numel(), values.data_ptr(), alpha,
        target.data_ptr(), state,
    )  # fmt: skip
