"""Top-k magnitude selection: exact, and a fast sampled-threshold approximation.

``torch.topk`` on a CPU tensor with k in the millions spends seconds (2.7 s for 1% of
100M). Deep Gradient Compression (Lin et al., ICLR 2018) estimates the threshold from a sample
instead; we do the same and then make one streaming pass:

1. Read a strided sample of ``s`` magnitudes (random start, so no fixed positions are favoured)
   and take the threshold at rank ``k'/n * s`` from the top, where ``k' = k * (1 + margin)`` and
   the margin (four standard deviations of the sampled count) makes undershooting k rare.
2. One pass over the tensor, chunks of 1M elements with reused scratch buffers, collects the
   candidate indices with ``|x| >= threshold`` (no ``masked_select``, no full-size temporaries).
3. If there are more than k candidates, keep the k largest of them (a partition over ~k values,
   ties broken towards lower indices). If there are fewer than ``(1 - tolerance) * k``, lower
   the threshold once; if that still undershoots, fall back to the exact selection.

Dense selections (k of at least 1/32 of the elements: exact-diloco's top-10 %, diloco's
top-20 %, up to all of them but one) would pay for step 3's partition of millions of
candidates every time. There a larger stratified sample (one random position in each of ``s``
equal strata, so no period of the tensor's layout biases it) holds enough hits to aim just
below k instead: four standard deviations of the sampled count under it (1.6 % of k, far
above ``(1 - tolerance) * k``), so the pass keeps its candidates as they are and step 3 is
left for the rare overshoot.

The pass can also gather what an encoder reads next while each chunk is in cache
(:func:`approx_topk`): the kept values and the positions' bitmap, which would otherwise cost
a gather over the whole tensor and a bitmap built from the indices (at top-20 % of 100M:
1.4 and 0.8 copies of the tensor).

The kept set is therefore always the exact top-``count`` set (up to ties), with
``(1 - tolerance) * k <= count <= k``; in practice ``count == k`` for sparse selections and
about 1.6 % under k for dense ones.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gossipgrad.compression import native
from gossipgrad.compression.bitpack import bitmap_pays, numpy_path

__all__ = [
    "Selection",
    "approx_topk",
    "approx_topk_accumulating",
    "approx_topk_indices",
    "approx_topk_of_difference",
    "block_topk_indices",
    "exact_topk_indices",
]

#: Below this many elements the exact selection is cheap enough and is always used.
EXACT_BELOW = 1 << 16
#: Sample size is chosen so that about this many sampled elements lie above the threshold.
SAMPLE_HITS = 2048
#: Elements per streaming chunk (4 MiB of float32): fewer numpy calls beat L2-sized chunks
#: (100M elements, top-20 %: 2.4 against 4.6 copies of the tensor with 64K-element chunks).
CHUNK = 1 << 20
#: Accepted shortfall of the kept count below k before a second pass is made.
TOLERANCE = 0.05
#: Sampled hits that make the count's standard deviation (1/sqrt(hits)) 0.4 % of k: enough
#: to aim below k instead of above it.
AIMED_HITS = 1 << 16
#: Largest sample drawn to aim (8 MiB of float32): reached from k/n = AIMED_HITS/AIMED_SAMPLE,
#: 1/32. At 100M entries the aimed threshold's sample costs less than the trim it spares: an
#: encode with error feedback took 12.6 copies of the model at top-10 % and 9.1 at top-5 %,
#: against 15.4 and 11.8 when it began at 1/8 (``scripts/bench_round.py``'s copies).
AIMED_SAMPLE = 1 << 21

_scratch = threading.local()


def exact_topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest-magnitude entries of 1-D ``flat`` (torch.topk)."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    return torch.sort(idx).values


def _aimed_threshold(flat: torch.Tensor, k: int, seed: int) -> float | None:
    """Magnitude threshold expected to keep four standard deviations fewer than ``k``
    entries, from a stratified sample; None where the sample would be too large (a sparse
    selection)."""
    return _aimed_threshold_of(lambda at: torch.index_select(flat, 0, at), flat, k, seed)


def _aimed_threshold_of(
    read: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor, k: int, seed: int
) -> float | None:
    """:func:`_aimed_threshold` of the vector whose entries at positions ``at`` are
    ``read(at)`` (of ``like``'s size and device)."""
    n = like.numel()
    s = math.ceil(AIMED_HITS * n / k)
    if s > min(AIMED_SAMPLE, n // 8):
        return None
    stride = n // s
    jitter = np.random.default_rng(seed).integers(0, stride, s)
    positions = torch.from_numpy(np.arange(s, dtype=np.int64) * stride + jitter)
    sample = read(positions.to(like.device)).abs().float()
    hits = k * s / n
    rank = max(1, math.ceil(hits - 4.0 * math.sqrt(hits)))
    return float(torch.kthvalue(sample, s - rank + 1).values)


def _sample_threshold(flat: torch.Tensor, k: int, seed: int, margin_scale: float) -> float | None:
    """Magnitude threshold expected to keep about ``k * (1 + margin)`` entries, or None."""
    return _sample_threshold_of(lambda at: flat[at], flat.numel(), k, seed, margin_scale)


def _sample_threshold_of(
    read: Callable[[slice], torch.Tensor], n: int, k: int, seed: int, margin_scale: float
) -> float | None:
    """:func:`_sample_threshold` of the vector of ``n`` entries whose entries at the strided
    positions ``at`` are ``read(at)``."""
    s = min(n // 8, max(SAMPLE_HITS * 4, math.ceil(SAMPLE_HITS * n / k)))
    if s < SAMPLE_HITS:
        return None
    stride = n // s
    start = seed % stride
    sample = read(slice(start, start + stride * s, stride)).abs().float()
    hits = k * s / n
    margin = margin_scale * (4.0 / math.sqrt(hits) + 0.01)
    rank = min(s, max(1, math.ceil(hits * (1.0 + margin))))
    # kthvalue counts from the smallest: the rank-th largest is the (s - rank + 1)-th smallest.
    return float(torch.kthvalue(sample, s - rank + 1).values)


def _candidates_native(flat: torch.Tensor, threshold: float, k: int) -> Selection | None:
    """The entries with ``|x| >= threshold`` as their bitmap and values, in one pass of the
    fused kernel (no indices: the bitmap is their positions); None on an overshoot of ``k``,
    which numpy's pass then takes (its candidates can be trimmed)."""
    bits = np.empty((flat.numel() + 7) // 8, dtype=np.uint8)
    values = np.empty(k + 8, dtype=np.float32)  # 8: a vector store's overrun
    held = native.select(flat.numpy(), threshold, bits, values)
    if held < 0:
        return None
    return Selection(None, torch.from_numpy(values[:held]), torch.from_numpy(bits))


def _candidates_numpy(
    flat: torch.Tensor,
    threshold: float,
    k: int,
    gather: bool,
    bitmap: bool,
    aimed: bool = False,
    chunk_of: Callable[[int, int], np.ndarray] | None = None,
) -> Selection:
    """The indices of ``|x| >= threshold`` (written into an array of ``k``, grown only on
    an overshoot, which the caller trims); with ``gather`` their values, with ``bitmap``
    their bitmap, each read while its chunk is in cache. A float32 tensor whose values are
    wanted at a threshold ``aimed`` below k takes the fused kernel where it is built (the
    same kept set and values; their bitmap for positions, no indices). ``chunk_of(lo, hi)``:
    the entries [lo, hi) where they are not ``flat``'s (then ``flat`` gives the size)."""
    if gather and aimed and chunk_of is None and native.usable(flat):
        found = _candidates_native(flat, threshold, k)
        if found is not None:
            return found
    x = flat.numpy()
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].dtype != x.dtype:
        bufs = (np.empty(CHUNK, dtype=x.dtype), np.empty(CHUNK, dtype=np.bool_))
        _scratch.bufs = bufs
    absbuf, maskbuf = bufs
    idx = np.empty(k, dtype=np.int64)
    values = np.empty(k, dtype=x.dtype) if gather else None
    bits = np.empty((x.size + 7) // 8, dtype=np.uint8) if bitmap else None
    held, over, over_values = 0, [], []
    for lo in range(0, x.size, CHUNK):
        chunk = x[lo : lo + CHUNK] if chunk_of is None else chunk_of(lo, min(x.size, lo + CHUNK))
        m = chunk.size
        a = np.abs(chunk, out=absbuf[:m])
        mask = np.greater_equal(a, threshold, out=maskbuf[:m])
        hit = np.flatnonzero(mask)
        if bits is not None:
            bits[lo // 8 : (lo + m + 7) // 8] = np.packbits(mask)
        fits = min(hit.size, k - held)
        np.add(hit[:fits], lo, out=idx[held : held + fits])
        if values is not None:
            np.take(chunk, hit[:fits], out=values[held : held + fits], mode="clip")
        held += fits
        if fits < hit.size:  # an overshoot, for the trim
            over.append(hit[fits:] + lo)
            if values is not None:
                over_values.append(chunk[hit[fits:]])
    if over:
        idx = np.concatenate([idx, *over])
        values = None if values is None else np.concatenate([values, *over_values])
        bits = None  # the trim drops positions from it
    else:
        idx = idx[:held]
        values = None if values is None else values[:held]
    return Selection(
        torch.from_numpy(idx),
        None if values is None else torch.from_numpy(values),
        None if bits is None else torch.from_numpy(bits),
    )


def _candidates_torch(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    return torch.nonzero(flat.abs() >= threshold).reshape(-1)


def _trim_selection(flat: torch.Tensor, found: Selection, k: int, numpy_pass: bool) -> Selection:
    """``found`` cut to its k largest magnitudes (``_trim``), the values it gathered kept
    for the kept ones."""
    assert found.idx is not None  # the fused kernel never overshoots: it gives way instead
    if found.idx.numel() <= k:
        return Selection(found.idx)
    if not numpy_pass or found.values is None:
        return Selection(_trim(flat, found.idx, k, numpy_pass))
    values = found.values.numpy()
    keep = _kept_of(np.abs(values), k)
    return Selection(torch.from_numpy(found.idx.numpy()[keep]), torch.from_numpy(values[keep]))


def _kept_of(mags_np: np.ndarray, k: int) -> np.ndarray:
    """A boolean mask of the k largest of these magnitudes, ties towards lower positions."""
    kth_np = np.partition(mags_np, mags_np.size - k)[mags_np.size - k]  # the k-th largest
    above_np = mags_np > kth_np
    tie_np = mags_np == kth_np
    need = k - int(np.count_nonzero(above_np))
    if need == int(np.count_nonzero(tie_np)):
        return above_np | tie_np
    # The first `need` ties (in index order) complete the set.
    return above_np | (tie_np & (np.cumsum(tie_np) <= need))


def _trim(flat: torch.Tensor, cand: torch.Tensor, k: int, numpy_pass: bool) -> torch.Tensor:
    """Keep the k largest-magnitude candidates, ties towards lower indices, order preserved."""
    if numpy_pass:
        c = cand.numpy()
        return torch.from_numpy(c[_kept_of(np.abs(flat.numpy()[c]), k)])
    mags = torch.index_select(flat, 0, cand).abs()
    kth = torch.kthvalue(mags, cand.numel() - k + 1).values
    above = mags > kth
    tie = mags == kth
    need = k - int(above.sum())
    keep = above | (tie & (torch.cumsum(tie, 0) <= need))
    return cand[keep]


@dataclass(frozen=True)
class Selection:
    """The kept entries of a 1-D tensor: their sorted int64 indices and, where the selection
    pass gathered them (else None), their values and the positions' bitmap (MSB first, as
    :func:`.bitpack.bitmap_encode` writes it). The fused kernel gives values and bitmap
    only (``idx`` None: the bitmap holds the positions)."""

    idx: torch.Tensor | None
    values: torch.Tensor | None = None
    bitmap: torch.Tensor | None = None
    #: The kept values as int2 codes and scales, where the fused pass quantized them and
    #: took what they send out of the residual it accumulated (``int2_block``, below).
    int2: tuple[torch.Tensor, torch.Tensor] | None = None
    #: ||residual|| after that pass, summed as it wrote it (None: not measured; only the
    #: int2 pass measures it).
    left: float | None = None

    def __post_init__(self) -> None:
        if self.idx is None and (self.values is None or self.bitmap is None):
            raise ValueError("a selection without indices needs its values and bitmap")

    @property
    def count(self) -> int:
        """How many entries are kept."""
        return self.idx.numel() if self.idx is not None else self.values.numel()  # type: ignore[union-attr]


def approx_topk_indices(
    flat: torch.Tensor, k: int, *, seed: int = 0, use_numpy: bool | None = None
) -> torch.Tensor:
    """Sorted int64 indices of (about) the k largest-magnitude entries of 1-D ``flat``.

    See the module docstring for the algorithm and guarantees. ``seed`` only picks the sample
    offset; ``use_numpy`` forces (True) or forbids (False) the numpy streaming pass, which is
    the default for CPU tensors.
    """
    return approx_topk(flat, k, seed=seed, use_numpy=use_numpy).idx  # type: ignore[return-value]


def approx_topk(
    flat: torch.Tensor,
    k: int,
    *,
    seed: int = 0,
    use_numpy: bool | None = None,
    gather: bool = False,
) -> Selection:
    """:func:`approx_topk_indices`, and with ``gather`` (the numpy pass) the kept values,
    read in the same pass as the candidates (a trim keeps those of the kept ones), and the
    positions' bitmap where it is their layout (``bitmap_pays``) and no trim was needed."""
    n = flat.numel()
    if n <= EXACT_BELOW or k >= n or k <= 0:
        return Selection(exact_topk_indices(flat, k))
    numpy_pass = numpy_path(flat) if use_numpy is None else use_numpy
    for attempt, margin_scale in enumerate((1.0, 3.0)):
        threshold = _aimed_threshold(flat, k, seed) if attempt == 0 else None
        aimed = threshold is not None
        if threshold is None:
            threshold = _sample_threshold(flat, k, seed, margin_scale)
        if threshold is None:
            break
        if threshold <= 0.0:
            # Fewer than ~k non-zeros: the non-zeros are the whole useful top-k.
            cand = torch.nonzero(flat).reshape(-1)
            return _trim_selection(flat, Selection(cand), k, numpy_pass)
        if numpy_pass:
            bitmap = gather and bitmap_pays(k, n)
            found = _candidates_numpy(flat, threshold, k, gather, bitmap, aimed)
        else:
            found = Selection(_candidates_torch(flat, threshold))
        settled = _settled(flat, found, k, numpy_pass)
        if settled is not None:
            return settled
    return Selection(exact_topk_indices(flat, k))


def _settled(flat: torch.Tensor, found: Selection, k: int, numpy_pass: bool) -> Selection | None:
    """A threshold's candidates as the selection: trimmed to the k largest on an overshoot,
    as they are within the tolerance under k; None when too few (a lower threshold next)."""
    if found.count > k:
        return _trim_selection(flat, found, k, numpy_pass)
    if found.count >= math.ceil((1.0 - TOLERANCE) * k):
        return found
    return None


def approx_topk_accumulating(
    e: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    k: int,
    *,
    seed: int = 0,
    int2_block: int | None = None,
) -> Selection | None:
    """``e += a − b`` (1-D), then :func:`approx_topk` of ``e`` with ``gather``: in one pass
    of the fused kernel where it applies (float32 on CPU, a selection of 1/32 or more whose
    threshold is aimed: the same sample, read off ``e + (a − b)`` before the pass, so the
    same selection); None where it does not, ``e`` untouched. Past an overshoot or a shortfall
    ``e`` is the sum and :func:`approx_topk` takes it from there.

    ``int2_block``: the same pass also quantizes the kept values as ``Int2(block=...)`` does
    (round to nearest; ``Selection.int2``) and takes their dequantized values out of ``e``
    (error feedback's step, the bits of ``Encoded.add_to_(e, alpha=-1)``), a tile at a time
    while it is in cache. A selection without ``int2`` leaves ``e`` the sum.

    Raises:
        ValueError: a non-finite sum (the entries already added are taken out again, up to
            float rounding).
    """
    n = e.numel()
    if n <= EXACT_BELOW or not 0 < k < n or not native.usable(e, a, b):
        return None

    def sums(at: torch.Tensor) -> torch.Tensor:  # e + (a − b) there, rounded as the pass does
        return torch.index_select(e, 0, at) + (
            torch.index_select(a, 0, at) - torch.index_select(b, 0, at)
        )

    threshold = _aimed_threshold_of(sums, e, k, seed)
    if threshold is None or threshold <= 0.0:
        return None
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    values = np.empty(k + 8, dtype=np.float32)  # 8: a vector store's overrun
    written, int2, left = 0, None, None
    if int2_block is None:
        held, bad = native.accumulate_select(e, a, b, threshold, bits, values)
    else:
        codes = np.empty((k + 3) // 4, dtype=np.uint8)
        scales = np.empty(-(-k // int2_block), dtype=np.float32)
        held, written, bad, left = native.accumulate_select_int2(
            e, a, b, threshold, bits, values, codes, scales, int2_block
        )
        int2 = (codes, scales)
    if bad:
        _put_back(e, bits, values, written)
        done = 8 * (bad - 1)
        e[:done].sub_(a[:done]).add_(b[:done])
        raise ValueError("cannot encode a tensor with NaN or infinite values")
    if held >= math.ceil((1.0 - TOLERANCE) * k):
        if int2 is not None:
            codes, scales = int2
            int2 = (
                torch.from_numpy(codes[: (held + 3) // 4]),
                torch.from_numpy(scales[: -(-held // int2_block)]),  # type: ignore[operator]
            )
        return Selection(None, torch.from_numpy(values[:held]), torch.from_numpy(bits), int2, left)
    _put_back(e, bits, values, written)
    return approx_topk(e, k, seed=seed, gather=True)


def approx_topk_of_difference(
    a: torch.Tensor, b: torch.Tensor, k: int, *, seed: int = 0
) -> tuple[Selection, float] | None:
    """:func:`approx_topk` of ``a − b`` (1-D) with ``gather``, without the difference as a
    tensor: the sample read off ``a`` and ``b`` at its positions, the pass a ``CHUNK`` at a
    time, each chunk's difference in a buffer in cache (no model-sized buffer to write, and
    to page in every round: CHOCO's x − x̂), and ||a − b||² summed there. The same selection
    and values as on the difference: (selection, ||a − b||²).

    None where it does not apply: ``a`` not float32 on CPU (``b`` may be a float16 copy), a
    dense selection (1/32 or more: the fused kernel's aimed pass serves), or the rare
    fallbacks that need the whole difference (fewer than k non-zeros; both thresholds
    falling short).

    Raises:
        ValueError: a non-finite difference.
    """
    n = a.numel()
    if n <= EXACT_BELOW or not 0 < k < n or a.dtype != torch.float32:
        return None
    if b.dtype not in (torch.float32, torch.float16):  # numpy reads both (not bfloat16)
        return None
    if not (numpy_path(a) and numpy_path(b) and a.is_contiguous() and b.is_contiguous()):
        return None
    if math.ceil(AIMED_HITS * n / k) <= min(AIMED_SAMPLE, n // 8):
        return None  # a dense selection: its threshold is aimed, its pass fused
    fa, fb = a.numpy(), b.numpy()
    buf = np.empty(min(CHUNK, n), dtype=np.float32)
    squares = 0.0

    def chunk_of(lo: int, hi: int) -> np.ndarray:
        nonlocal squares
        d = np.subtract(fa[lo:hi], fb[lo:hi], out=buf[: hi - lo])  # float16 b: in float32
        part = float(np.dot(d, d))
        if not math.isfinite(part) and not np.isfinite(d).all():
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        squares += part
        return d

    def strided(at: slice) -> torch.Tensor:
        return a[at] - b[at].to(a.dtype)

    for margin_scale in (1.0, 3.0):
        threshold = _sample_threshold_of(strided, n, k, seed, margin_scale)
        if threshold is None or threshold <= 0.0:
            return None
        squares = 0.0
        found = _candidates_numpy(a, threshold, k, True, False, chunk_of=chunk_of)
        settled = _settled(a, found, k, True)  # its trim reads the values gathered, not a
        if settled is not None:
            return settled, squares
    return None


def _put_back(e: torch.Tensor, bits: np.ndarray, values: np.ndarray, written: int) -> None:
    """``e`` at the first ``written`` set bits of ``bits`` = ``values[:written]``: the sums
    a fused int2 selection had replaced by what stays of them (its fallbacks)."""
    flat, done, step = e.numpy(), 0, 1 << 17
    for lo in range(0, bits.size, step):
        if done >= written:
            return
        hit = np.flatnonzero(np.unpackbits(bits[lo : lo + step]))[: written - done]
        flat[hit + 8 * lo] = values[done : done + hit.size]
        done += hit.size


def block_topk_indices(
    mags: torch.Tensor, k: int, *, use_numpy: bool | None = None
) -> torch.Tensor:
    """Sorted flat int64 indices of exactly the ``k`` largest entries of each row of ``mags``.

    ``mags`` is 2-D and non-negative (magnitudes, one block per row). Per row: the k-th largest
    value ``t`` is found by a partial selection (``np.partition`` on CPU, ``torch.topk``
    elsewhere), entries ``> t`` are kept and entries ``== t`` fill up to k in column order, so
    ties go towards lower indices and both paths return the same indices. No sort is needed:
    the kept mask read in row-major order is already sorted.
    """
    rows, b = mags.shape
    if k >= b:
        return torch.arange(rows * b, device=mags.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=mags.device)
    if numpy_path(mags) if use_numpy is None else use_numpy:
        m = mags.numpy()
        kth_np = np.partition(m, b - k, axis=1)[:, b - k : b - k + 1]
        keep_np = m >= kth_np
        over_np = np.flatnonzero(keep_np.sum(1) > k)
        if over_np.size:  # ties at the k-th value: keep the first ones in column order
            sub, th = m[over_np], kth_np[over_np]
            tie = sub == th
            need = k - (sub > th).sum(1, keepdims=True)
            keep_np[over_np] = (sub > th) | (tie & (np.cumsum(tie, 1) <= need))
        return torch.from_numpy(np.flatnonzero(keep_np))
    kth = torch.topk(mags, k, dim=1, sorted=False).values.amin(1, keepdim=True)
    keep = mags >= kth
    over = torch.nonzero(keep.sum(1) > k).reshape(-1)
    if over.numel():
        sub, th = mags[over], kth[over]
        tie = sub == th
        need = k - (sub > th).sum(1, keepdim=True)
        keep[over] = (sub > th) | (tie & (torch.cumsum(tie, 1) <= need))
    return torch.nonzero(keep.reshape(-1)).reshape(-1)
