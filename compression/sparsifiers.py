"""Sparsifiers: which entries travel. Each is a small class registered under its spec name."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from gossipgrad.compression.base import Sparsifier
from gossipgrad.compression.bitpack import pack_uint, unpack_uint
from gossipgrad.compression.errors import DecodeError
from gossipgrad.compression.registry import register
from gossipgrad.compression.selection import (
    Selection,
    approx_topk,
    approx_topk_accumulating,
    approx_topk_of_difference,
    block_topk_indices,
    exact_topk_indices,
)
from gossipgrad.compression.stage_args import StageArgs

__all__ = ["ChunkTopK", "RandomK", "TopK", "randomk_indices"]


_MAX_BLOCK = 1 << 16


def _parse_ratio(args: StageArgs) -> float:
    try:
        ratio = float(args.positional[0])
    except ValueError:
        raise ValueError(f"ratio {args.positional[0]!r} is not a number") from None
    return _check_ratio(ratio)


def _check_ratio(ratio: float) -> float:
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 0 < ratio <= 1):
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r} (e.g. 0.01 keeps 1%)")
    return float(ratio)


@register
class TopK(Sparsifier):
    """``topk:RATIO[:exact]``: keep the ``round(RATIO * numel)`` largest magnitudes.

    The default selection is the sampled-threshold one of :mod:`.selection` (as in Deep
    Gradient Compression, Lin et al., ICLR 2018): it keeps the exact top-``count`` set with
    ``0.95 k <= count <= k`` and is >10x faster than ``torch.topk`` on large CPU tensors.
    ``exact`` uses ``torch.topk`` (for ablations). Indices travel Rice-coded.
    """

    name = "topk"
    grammar = "topk:RATIO[:exact] (0 < RATIO <= 1)"

    def __init__(self, ratio: float, *, exact: bool = False) -> None:
        self.ratio = _check_ratio(ratio)
        self.exact = bool(exact)

    @classmethod
    def from_args(cls, args: StageArgs) -> TopK:
        args.expect(positional=1, flags=("exact",))
        return cls(_parse_ratio(args), exact="exact" in args.flags)

    @property
    def spec(self) -> str:
        return f"topk:{self.ratio!r}" + (":exact" if self.exact else "")

    def count_range(self, numel: int) -> tuple[int, int]:
        k = self.k_for(numel)
        # The approximate selection may keep fewer (never more) entries, e.g. when fewer
        # than k entries are non-zero.
        return (k, k) if self.exact else (0, k)

    def select(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        return self._selection(flat, seed, gather=False).idx

    def select_parts(self, flat: torch.Tensor, seed: int) -> Selection:
        return self._selection(flat, seed, gather=True)

    def select_accumulating(
        self,
        e: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        seed: int,
        int2_block: int | None = None,
    ) -> Selection | None:
        if self.exact:
            return None
        k = self.k_for(e.numel())
        return approx_topk_accumulating(e, a, b, k, seed=seed, int2_block=int2_block)

    def select_difference(
        self, a: torch.Tensor, b: torch.Tensor, seed: int
    ) -> tuple[Selection, float] | None:
        if self.exact:
            return None
        return approx_topk_of_difference(a, b, self.k_for(a.numel()), seed=seed)

    def _selection(self, flat: torch.Tensor, seed: int, gather: bool) -> Selection:
        k = self.k_for(flat.numel())
        native = flat.dtype in (torch.float32, torch.float64)
        x = flat if native else flat.float()
        if self.exact:
            return Selection(exact_topk_indices(x, k))
        # Values gathered from a float32 copy of a half tensor would change the payload's.
        return approx_topk(x, k, seed=seed, gather=gather and native)


@register
class ChunkTopK(Sparsifier):
    """``chunktopk:RATIO[:block=N]``: the largest magnitudes within each block of N elements.

    The flat tensor is cut into blocks of ``N`` (default 4096, a power of two in 8..65536; the
    last block may be shorter) and each block keeps exactly its ``round(RATIO * size)`` (at
    least 1) largest magnitudes, as the chunked top-k of DeMo (Peng et al., 2024) and
    SparseLoCo (2025). Selection is a partial selection within each block, batched over the
    blocks (no global sort), and each index travels as its offset in its block in ``log2(N)``
    bits (fewer for a tensor shorter than N), so the index section has a fixed size. Ties
    within a block are broken towards lower indices (:func:`.selection.block_topk_indices`).
    """

    name = "chunktopk"
    grammar = "chunktopk:RATIO[:block=N] (0 < RATIO <= 1)"
    default_block = 4096

    def __init__(self, ratio: float, *, block: int | None = None) -> None:
        self.ratio = _check_ratio(ratio)
        self.block = self.default_block if block is None else block
        if self.block < 8 or self.block > _MAX_BLOCK or self.block & (self.block - 1):
            raise ValueError(f"block={self.block} must be a power of two in 8..{_MAX_BLOCK}")

    @classmethod
    def from_args(cls, args: StageArgs) -> ChunkTopK:
        args.expect(positional=1, options=("block",))
        return cls(_parse_ratio(args), block=args.int_option("block", cls.default_block))

    @property
    def spec(self) -> str:
        suffix = "" if self.block == self.default_block else f":block={self.block}"
        return f"chunktopk:{self.ratio!r}{suffix}"

    def keep_per_block(self, size: int) -> int:
        """Entries kept from a block of ``size`` elements."""
        return min(size, max(1, round(self.ratio * size))) if size else 0

    def k_for(self, numel: int) -> int:
        full, tail = divmod(numel, self.block)
        return full * self.keep_per_block(self.block) + self.keep_per_block(tail)

    def offset_bits(self, numel: int) -> int:
        """Bits per in-block offset: ``log2(block)``, or fewer when numel < block."""
        return (min(self.block, numel) - 1).bit_length() if numel else 0

    def select(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        n, b = flat.numel(), self.block
        full = n // b
        mags = flat.abs() if flat.dtype in (torch.float32, torch.float64) else flat.float().abs()
        parts = []
        if full:
            rows = mags[: full * b].view(full, b)
            parts.append(block_topk_indices(rows, self.keep_per_block(b)))
        if n > full * b:
            tail = mags[full * b :]
            off = block_topk_indices(tail.view(1, -1), self.keep_per_block(tail.numel()))
            parts.append(off + full * b)
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=flat.device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def encode_indices(self, idx: torch.Tensor, numel: int) -> tuple[int, torch.Tensor]:
        bits = self.offset_bits(numel)
        return bits, pack_uint(idx & (self.block - 1), bits)

    def max_index_bytes(self, count: int, numel: int, index_bits: int) -> int:
        if index_bits != self.offset_bits(numel):
            raise DecodeError(
                f"{self.spec} needs index_bits {self.offset_bits(numel)} for {numel} elements, "
                f"payload has {index_bits}"
            )
        return (count * index_bits + 7) // 8

    def decode_indices(
        self, raw: torch.Tensor, index_bits: int, count: int, numel: int
    ) -> torch.Tensor:
        """Offsets back to indices, checking each block's are in range and strictly rising."""
        if raw.numel() != self.max_index_bytes(count, numel, index_bits):
            raise DecodeError(f"index section has {raw.numel()} bytes for {count} offsets")
        off = unpack_uint(raw, index_bits, count)
        b = self.block
        full, tail = divmod(numel, b)
        kb = self.keep_per_block(b)
        head = off[: full * kb].view(full, kb)
        rest = off[full * kb :]
        if bool((head[:, 1:] <= head[:, :-1]).any()) or bool((rest[1:] <= rest[:-1]).any()):
            raise DecodeError("block offsets are not strictly increasing")
        if rest.numel() and int(rest[-1]) >= tail:
            raise DecodeError(f"offset {int(rest[-1])} out of range for a block of {tail}")
        base = torch.arange(full, device=off.device)[:, None] * b
        return torch.cat([(head + base).view(-1), rest + full * b])

    def decode_index_pieces(
        self, raw: torch.Tensor, index_bits: int, count: int, numel: int
    ) -> Iterable[torch.Tensor]:
        """Fixed-width offsets, not Rice codes or a bitmap: decoded whole, one piece."""
        return (self.decode_indices(raw, index_bits, count, numel),)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer (Steele, Lea, Flood, OOPSLA 2014), vectorised, wrapping uint64."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def randomk_indices(numel: int, k: int, seed: int) -> np.ndarray:
    """k sorted distinct indices below numel, a pure function of (numel, k, seed).

    Stratified: the range is cut into k near-equal strata and one index is drawn in each from
    a counter-based hash, so every platform, numpy version and device regenerates the same
    indices, no sort is needed, and each element is kept with probability ~k/numel.
    """
    if k == 0:
        return np.empty(0, dtype=np.int64)
    j = np.arange(k + 1, dtype=np.uint64)
    q, r = divmod(numel, k)
    bounds = j * np.uint64(q) + (j * np.uint64(r)) // np.uint64(k)
    starts, sizes = bounds[:-1], np.diff(bounds)
    base = _splitmix64(np.array([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        h = _splitmix64(j[:-1] * _GOLDEN + base)
    return (starts + h % sizes).astype(np.int64)


@register
class RandomK(Sparsifier):
    """``randomk:RATIO``: keep ``round(RATIO * numel)`` pseudo-random entries (stratified).

    The indices are regenerated by the receiver from the seed in the envelope, so only values
    travel. Unscaled (biased) as used with error feedback (Stich et al., NeurIPS 2018).
    """

    name = "randomk"
    grammar = "randomk:RATIO (0 < RATIO <= 1)"
    sends_indices = False

    def __init__(self, ratio: float) -> None:
        self.ratio = _check_ratio(ratio)

    @classmethod
    def from_args(cls, args: StageArgs) -> RandomK:
        args.expect(positional=1)
        return cls(_parse_ratio(args))

    @property
    def spec(self) -> str:
        return f"randomk:{self.ratio!r}"

    def select(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        return self.indices_for(flat.numel(), seed, flat.device)

    def indices_for(self, numel: int, seed: int, device: torch.device) -> torch.Tensor:
        idx = randomk_indices(numel, self.k_for(numel), seed)
        return torch.from_numpy(idx).to(device)
