"""Codec base classes: what a codec, a sparsifier and a quantizer are, and how they compose.

A codec is at most one *sparsifier* (which entries travel) followed by one *quantizer* (how
their values travel). ``TopK(0.01)`` alone is a codec (fp32 values), so is ``Int8()`` alone
(dense), and ``TopK(0.01) >> Int8()`` composes them. Codec classes are small: a sparsifier
implements :meth:`Sparsifier.select`, a quantizer :meth:`Quantizer.quantize` and
:meth:`Quantizer.dequantize`; :mod:`.engine` does the rest (envelope, chunking, validation).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
from gossipgrad.compression import engine, native
from gossipgrad.compression.bitpack import (
    BITMAP_INDEX_BITS,
    MAX_RICE_BITS,
    Bitmap,
    RiceStream,
    bitmap_decode,
    bitmap_encode,
    bitmap_pays,
    checked_bitmap,
    checked_rice,
    numpy_path,
    rice_bits_for,
    rice_decode,
    rice_encode,
    rice_max_bytes,
)
from gossipgrad.compression.engine import Encoded, Received
from gossipgrad.compression.errors import DecodeError
from gossipgrad.compression.finite import all_finite
from gossipgrad.compression.selection import Selection
from gossipgrad.compression.stage_args import StageArgs

__all__ = ["Codec", "Composed", "Identity", "Quantizer", "Sparsifier"]


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
        return engine.encode(self, t, seed)

    @torch.no_grad()
    def encode_parts(self, t: torch.Tensor, seed: int | None = None) -> tuple[bytes, Encoded]:
        """``encode``, and what it built: ``Encoded.add_to_`` applies the payload exactly as
        ``decode_add_`` of its bytes would, without decoding its indices again (an encoder
        that takes what it sent out of an error-feedback residual)."""
        return engine.encode_parts(self, t, seed)

    @torch.no_grad()
    def encode_accumulated(
        self, e: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seed: int | None = None
    ) -> tuple[bytes, Encoded, float | None] | None:
        """Error feedback's step: ``e += a − b``, ``encode_parts(e)``, and what the bytes
        decode to taken out of ``e`` (``Encoded.add_to_(e, alpha=-1)``): the same bytes and
        residual, in one fused pass where the codec has one for these tensors (a dense top-k
        of float32 on CPU: error feedback's residual accumulating a pseudo-gradient; with
        int2 values, quantized and taken out in the same pass, which also measures ||e||
        after: the third element, else None); None (``e`` untouched) otherwise. ValueError
        on a non-finite sum (``e`` restored up to float rounding)."""
        return engine.encode_accumulated(self, e, a, b, seed)

    @torch.no_grad()
    def encode_difference(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        seed: int | None = None,
        scratch: torch.Tensor | None = None,
        fold: bool = False,
    ) -> tuple[bytes, Encoded, float]:
        """``encode_parts(a − b)`` and ||(a − b) − decode(bytes)||, what error feedback keeps
        (``b`` may be a narrower float copy). A dense codec reads ``a`` and ``b`` a chunk at a
        time and allocates nothing model-sized, and so does a sparse top-k below 1/32 of the
        entries (:meth:`Sparsifier.select_difference`); other sparse ones build the difference
        in ``scratch`` (``a``'s shape and dtype; allocated if None): see :attr:`sparse`.
        ``fold``: and ``b += decode(bytes)`` as ``decode_add_`` would, a dense codec's chunk
        while it is in cache (CHOCO's x̂ += q; details in ``engine.encode_difference``)."""
        return engine.encode_difference(self, a, b, seed, scratch, fold)

    @property
    def sparse(self) -> bool:
        """True when the codec keeps a subset of the entries (it selects over a whole
        tensor, so ``encode_difference`` may need a model-sized scratch: not for a sparse
        top-k below 1/32, which reads the difference a chunk at a time)."""
        return self.stages()[0] is not None

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
        return engine.decode(self, data, device=device, max_numel=max_numel, out=out)

    @torch.no_grad()
    def inspect(
        self, data: bytes, *, max_numel: int | None = None
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """Check ``data`` on arrival and return its shape and dtype, without building the
        dense tensor or decoding sparse indices (the costly part): the envelope, its CRC,
        the element count and every section's size and values. A receiver keeps only the
        bytes until it applies them; ``decode_add_`` then checks the indices themselves
        (sorted, in range) before it writes anything.

        Raises:
            DecodeError: for anything but a bad index coding, as ``decode``.
        """
        return engine.inspect(self, data, max_numel)

    @torch.no_grad()
    def receive(self, data: bytes, *, max_numel: int | None = None) -> Received:
        """:meth:`inspect`, keeping what it checked: the header's fields and the sections,
        decompressed (a receiver holds this instead of the bytes; ``add_all_`` and
        ``decode_add_`` then read neither the envelope nor a section again, only the
        indices, which they check as for bytes).

        Raises:
            DecodeError: as :meth:`inspect`.
        """
        return engine.receive(self, data, max_numel)

    @torch.no_grad()
    def add_all_(
        self, terms: Sequence[tuple[bytes | Received | Encoded, float]], out: torch.Tensor
    ) -> list[tuple[int, DecodeError]]:
        """``out += Σ_k alpha_k decode(c_k)`` for the ``(c_k, alpha_k)`` given, in their order
        (a payload may be what its receipt kept, :class:`Received`, or what an encoder built,
        :class:`Encoded`): the bits of
        ``decode_add_`` (or ``add_to_``) of each in turn. Messages whose positions are
        bitmaps are added in one pass over ``out`` where the fused kernels run. A payload that
        does not decode is left out, the others added; returns each one's (index,
        DecodeError)."""
        return engine.add_all(self, terms, out)

    @torch.no_grad()
    def decode_add_(
        self,
        data: bytes | Received,
        out: torch.Tensor,
        *,
        alpha: float = 1.0,
        cast: bool = False,
    ) -> torch.Tensor:
        """``out += alpha * decode(data)`` in place, and return ``out`` (``data`` may be what
        :meth:`receive` kept of the bytes).

        Sparse codecs scatter-add only the kept entries. Everything is validated before ``out``
        is touched, so on DecodeError ``out`` is unchanged. The result is a deterministic
        function of (``out``, ``data``): sender and receiver applying the same bytes to
        bit-identical tensors on the same kind of device get bit-identical results (CHOCO-SGD
        relies on it). Values are dequantized in a separate op before the add, so no fused
        multiply-add can make devices disagree; ``alpha`` of +-1 is exact.

        ``cast``: ``out`` may have another floating dtype than the payload; the values are
        rounded to ``out``'s dtype before the add (the same rounding at every end: a float16
        copy of a float32 model stays bit-identical at both ends of an edge).

        Raises:
            DecodeError: bad input, or ``out`` of another shape (or, without ``cast``, another
                dtype) than the payload.
        """
        return engine.decode_add(self, data, out, alpha=alpha, cast=cast)


class Sparsifier(Codec):
    """Chooses which entries travel. Alone it sends their values unquantized.

    Indices travel Golomb-Rice coded by default (:mod:`.bitpack`); a sparsifier with a cheaper
    layout overrides :meth:`encode_indices`, :meth:`max_index_bytes` and
    :meth:`decode_indices` together.
    """

    #: False when the receiver regenerates the indices (randomk) instead of reading them.
    sends_indices: ClassVar[bool] = True

    def stages(self) -> tuple[Sparsifier | None, Quantizer]:
        return self, Identity()

    @abc.abstractmethod
    def select(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """Sorted, distinct int64 indices (on ``flat``'s device) of the entries to send."""

    def select_parts(self, flat: torch.Tensor, seed: int) -> Selection:
        """:meth:`select`, with what the selection read on its way where it can give it
        (the kept values, the positions' bitmap), so the encoder need not read them again."""
        return Selection(self.select(flat, seed))

    def select_accumulating(
        self,
        e: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        seed: int,
        int2_block: int | None = None,
    ) -> Selection | None:
        """``e += a − b`` (1-D) and :meth:`select_parts` of the sum in one fused pass, where
        this sparsifier has one for these tensors; None (``e`` untouched) otherwise. With
        ``int2_block`` the pass may also quantize the kept values and take them out of ``e``
        (``Selection.int2``: :func:`.selection.approx_topk_accumulating`)."""
        return None

    def select_difference(
        self, a: torch.Tensor, b: torch.Tensor, seed: int
    ) -> tuple[Selection, float] | None:
        """:meth:`select_parts` of ``a − b`` (1-D; ``b`` may be a narrower float copy) with
        its kept values, read a chunk of the difference at a time, and ||a − b||², where
        this sparsifier can (no model-sized difference); None otherwise. ValueError on a
        non-finite difference."""
        return None

    def encode_selection(self, kept: Selection, numel: int) -> tuple[int, torch.Tensor]:
        """:meth:`encode_indices` of ``kept.idx``, taking the bitmap the selection built
        where a bitmap is the layout (the same bytes)."""
        if kept.bitmap is not None and bitmap_pays(kept.count, numel):
            return BITMAP_INDEX_BITS, kept.bitmap
        if kept.idx is not None:
            return self.encode_indices(kept.idx, numel)
        assert kept.bitmap is not None  # the fused selection: Rice codes from its bitmap
        bits = rice_bits_for(kept.count, numel)
        coded = native.rice_encode_bitmap(kept.bitmap.numpy(), numel, kept.count, bits)
        if coded is None:
            raise RuntimeError(f"a selection's bitmap does not hold its {kept.count} positions")
        return bits, torch.from_numpy(coded)

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

    def encode_indices(self, idx: torch.Tensor, numel: int) -> tuple[int, torch.Tensor]:
        """Code the sorted kept indices: (``index_bits`` for the envelope, uint8 bytes).

        Golomb-Rice coded gaps, or from a density of 1/8 on a bitmap
        (``index_bits = BITMAP_INDEX_BITS``; :func:`.bitpack.bitmap_pays`)."""
        if bitmap_pays(idx.numel(), numel):
            return BITMAP_INDEX_BITS, bitmap_encode(idx, numel)
        bits = rice_bits_for(idx.numel(), numel)
        return bits, rice_encode(idx, bits)

    def max_index_bytes(self, count: int, numel: int, index_bits: int) -> int:
        """Largest index section a valid payload can have (DecodeError on a bad index_bits)."""
        if index_bits == BITMAP_INDEX_BITS:
            return (numel + 7) // 8
        if not 0 <= index_bits <= MAX_RICE_BITS:
            raise DecodeError(f"index_bits {index_bits} outside 0..{MAX_RICE_BITS}")
        return rice_max_bytes(count, numel, index_bits)

    def decode_indices(
        self, raw: torch.Tensor, index_bits: int, count: int, numel: int
    ) -> torch.Tensor:
        """Inverse of :meth:`encode_indices`, validating fully (DecodeError)."""
        if index_bits == BITMAP_INDEX_BITS:
            return bitmap_decode(raw, count, numel)
        return rice_decode(raw, index_bits, count, numel)

    def decode_index_pieces(
        self, raw: torch.Tensor, index_bits: int, count: int, numel: int
    ) -> Iterable[torch.Tensor] | Bitmap | RiceStream:
        """:meth:`decode_indices` as consecutive pieces, validated in full before it returns:
        a bitmap on CPU as itself (read a stretch at a time, no array of every position), a
        Rice stream on CPU as itself where the fused kernels run, else one piece."""
        if index_bits == BITMAP_INDEX_BITS and numpy_path(raw):
            return checked_bitmap(raw, count, numel)
        if index_bits != BITMAP_INDEX_BITS and count and numpy_path(raw) and native.available():
            return checked_rice(raw, index_bits, count, numel)
        return (self.decode_indices(raw, index_bits, count, numel),)


class Quantizer(Codec):
    """Encodes a 1-D vector of values into bytes (plus optional float32 per-block scales).

    ``quantize`` and ``dequantize`` see chunks of at most ``engine.CHUNK`` elements whose
    boundaries are multiples of ``block`` and of 8, so packed outputs concatenate.
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
            bad = not all_finite(scales) or bool((scales < 0).any())
            if bad or not math.isfinite(float(scales.max()) * self.max_level()):
                raise DecodeError(f"{self.spec}: negative, non-finite or overflowing scales")

    def max_level(self) -> float:
        """Largest |integer level| a scale multiplies (for the overflow check)."""
        return 1.0

    def fused_difference(
        self, a: torch.Tensor, b: torch.Tensor, fold: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, float] | None:
        """The whole of ``encode_difference``'s quantization of ``a − b`` in one fused pass
        where this quantizer has one for these tensors (values, scales, what error feedback
        keeps; with ``fold``, ``b += decoded`` as ``decode_add_`` would): None otherwise."""
        return None

    def fused_add(
        self,
        values: torch.Tensor,
        scales: torch.Tensor | None,
        dtype: torch.dtype,
        target: torch.Tensor,
        alpha: float,
    ) -> bool:
        """``target += alpha * dequantize(...)`` (the whole tensor's values, payload
        ``dtype``) in one fused pass, the same bits as the chunked add, where this quantizer
        has one for these tensors; False (nothing done) otherwise."""
        return False

    def fused_selection_block(self) -> int | None:
        """The block of kept values a fused top-k pass quantizes as this quantizer does,
        taking them out of error feedback's residual as it goes
        (:meth:`Sparsifier.select_accumulating`); None where it has no such pass."""
        return None


class Identity(Quantizer):
    """``none``: values travel in the tensor's own dtype. Lossless.

    Defined here because every bare sparsifier runs it; :mod:`.quantizers` registers it.
    """

    name = "none"
    grammar = "none"
    lossless = True

    @classmethod
    def from_args(cls, args: StageArgs) -> Identity:
        args.expect()
        return cls()

    @property
    def spec(self) -> str:
        return "none"

    def value_bits(self, dtype: torch.dtype) -> int:
        return torch.finfo(dtype).bits

    def quantize(
        self, v: torch.Tensor, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return v.contiguous().view(torch.uint8), None

    def dequantize(
        self, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return values.view(dtype)[:count]

    def check(
        self, values: torch.Tensor, scales: torch.Tensor | None, count: int, dtype: torch.dtype
    ) -> None:
        step = engine.CHUNK * 8
        for lo in range(0, values.numel(), step):
            if not all_finite(values[lo : lo + step].view(dtype)):
                raise DecodeError("non-finite value in payload")


class Composed(Codec):
    """A sparsifier followed by a quantizer of its kept values (``TopK(r) >> Int8()``)."""

    def __init__(self, sparsifier: Sparsifier, quantizer: Quantizer) -> None:
        self._sp = sparsifier
        self._q = quantizer

    @staticmethod
    def of(first: Codec, second: Codec) -> Codec:
        """Compose two stages, rejecting combinations that mean nothing (ValueError)."""
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
