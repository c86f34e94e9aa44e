"""The codecs for compressed pseudo-gradients: int2 (ternary blockwise) and chunked top-k.

Laws checked with hypothesis: int2's per-element error bounds, chunktopk's exact per-block
selection, the wire sizes both promise, rejection of malformed payloads, and the multi-chunk
path (tensors above 2**20 elements) of every codec that has one.
"""

from __future__ import annotations

import math

import pytest
import torch
import zstandard
from gossipgrad.compression import ChunkTopK, DecodeError, Int2, from_spec
from gossipgrad.compression.bitpack import pack_uint, unpack_uint
from gossipgrad.compression.envelope_pb2 import TensorEnvelope
from gossipgrad.compression.selection import block_topk_indices
from gossipgrad.compression.wire import _header_crc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(180)

FLOATS = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)
VECTORS = st.lists(FLOATS, min_size=1, max_size=700).map(lambda v: torch.tensor(v))
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def student_t(n: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed like real gradients (3 degrees of freedom)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(n, 3, generator=g, dtype=torch.float64).pow(2).sum(1)
    return (normal / (chi2 / 3).sqrt()).float()


def _resign(env: TensorEnvelope) -> bytes:
    env.crc32 = _header_crc(env)
    return env.SerializeToString()


def _raw_section(env: TensorEnvelope, name: str) -> bytes:
    sec = getattr(env, name)
    if sec.storage == TensorEnvelope.ZSTD:
        return zstandard.ZstdDecompressor().decompress(sec.data)
    return sec.data


def _set_raw(env: TensorEnvelope, name: str, raw: bytes) -> None:
    sec = getattr(env, name)
    sec.storage, sec.data, sec.raw_size = TensorEnvelope.RAW, raw, len(raw)


# ----------------------------------------------------------------------------- int2


@pytest.mark.parametrize("block", [8, 64, 256])
@given(x=VECTORS, seed=st.integers(0, 2**32))
@SETTINGS
def test_int2_nearest_error_bound_and_contraction(block: int, x: torch.Tensor, seed: int) -> None:
    """Round to nearest on {-1, 0, 1} * s: |v - d| <= s/2 and |v - d| <= |v| per element."""
    codec = Int2(block=block)
    d = codec.decode(codec.encode(x, seed=seed))
    for xb, db in zip(x.split(block), d.split(block), strict=True):
        s = float(xb.abs().max())
        err = (xb - db).abs()
        assert float(err.max()) <= 0.5 * s * (1 + 1e-6) + 1e-30
        assert bool((err <= xb.abs() * (1 + 1e-6)).all())
        # only the three levels appear
        levels = torch.tensor([-s, 0.0, s])
        assert bool((db[:, None] == levels).any(1).all())


@given(x=VECTORS, seed=st.integers(0, 2**32))
@SETTINGS
def test_int2_stochastic_error_below_one_step(x: torch.Tensor, seed: int) -> None:
    codec = from_spec("int2:sr:block=32")
    d = codec.decode(codec.encode(x, seed=seed))
    for xb, db in zip(x.split(32), d.split(32), strict=True):
        s = float(xb.abs().max())
        assert float((xb - db).abs().max()) <= s * (1 + 1e-6) + 1e-30
        # stochastic rounding never flips a sign
        assert bool((db * xb >= 0).all())


def test_int2_stochastic_rounding_is_unbiased() -> None:
    x = student_t(256, seed=1)
    codec = Int2(sr=True, block=256)
    mean = torch.stack([codec.decode(codec.encode(x, seed=s)) for s in range(600)]).mean(0)
    s = float(x.abs().max())
    # 600 draws: the standard error of the mean is at most s / (2 * sqrt(600)) ~ s / 49.
    assert float((mean - x).abs().max()) < 0.15 * s


def test_int2_packs_four_values_per_byte() -> None:
    for n in (1, 3, 4, 5, 1000, 4099):
        env = TensorEnvelope.FromString(Int2().encode(student_t(n, seed=n), seed=0))
        assert env.values.raw_size == math.ceil(n / 4)
        assert env.scales.raw_size == 4 * math.ceil(n / 64)


def test_int2_rejects_the_unused_code() -> None:
    x = student_t(37, seed=2)
    codec = Int2(block=8)
    data = codec.encode(x, seed=0)
    # 37 = 9 * 4 + 1 values: byte 9 holds one real code (its high bits) and three padding ones.
    for byte, value in ((0, 0x00), (3, 0b01_10_00_11), (9, 0b00_11_11_11)):
        env = TensorEnvelope.FromString(data)
        raw = bytearray(_raw_section(env, "values"))
        raw[byte] = value
        _set_raw(env, "values", bytes(raw))
        with pytest.raises(DecodeError, match="int2 code 0"):
            codec.decode(_resign(env))
    env = TensorEnvelope.FromString(data)
    _set_raw(env, "values", _raw_section(env, "values"))
    assert torch.equal(codec.decode(_resign(env)), codec.decode(data))  # the edit path is sound


# ----------------------------------------------------------------------------- chunked top-k


def _sent_indices(codec: ChunkTopK, data: bytes, numel: int) -> torch.Tensor:
    """The indices a payload carries, read from its index section."""
    env = TensorEnvelope.FromString(data)
    raw = _u8(_raw_section(env, "indices"))
    return codec.decode_indices(raw, env.index_bits, env.count, numel)


def _u8(raw: bytes) -> torch.Tensor:
    return torch.tensor(list(raw), dtype=torch.uint8)


@pytest.mark.parametrize("block", [8, 64])
@pytest.mark.parametrize("ratio", [0.05, 0.25, 1.0])
@given(x=VECTORS)
@SETTINGS
def test_chunktopk_keeps_exactly_k_largest_per_block(block: int, ratio: float, x) -> None:
    codec = ChunkTopK(ratio, block=block)
    n = x.numel()
    data = codec.encode(x, seed=0)
    idx = _sent_indices(codec, data, n)
    assert bool((idx[1:] > idx[:-1]).all())  # sorted and distinct
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx] = True
    for lo in range(0, n, block):
        xb, kb = x[lo : lo + block].abs(), kept[lo : lo + block]
        assert (
            int(kb.sum())
            == codec.keep_per_block(xb.numel())
            == min(xb.numel(), max(1, round(ratio * xb.numel())))
        )
        if not bool(kb.all()):
            assert float(xb[kb].min()) >= float(xb[~kb].max())
    d = codec.decode(data)
    assert torch.equal(d[kept], x[kept]) and bool((d[~kept] == 0).all())


@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 40),
    k=st.integers(0, 41),
    data=st.data(),
)
@SETTINGS
def test_block_topk_ties_go_to_lower_indices_on_both_paths(rows, width, k, data) -> None:
    """Few distinct values, so ties are everywhere: both paths equal a stable-sort reference."""
    vals = data.draw(st.lists(st.integers(0, 3), min_size=rows * width, max_size=rows * width))
    mags = torch.tensor(vals, dtype=torch.float32).view(rows, width)
    expected = []
    for r in range(rows):
        order = sorted(range(width), key=lambda c: (-float(mags[r, c]), c))[: min(k, width)]
        expected += sorted(r * width + c for c in order)
    for use_numpy in (True, False):
        got = block_topk_indices(mags, k, use_numpy=use_numpy)
        assert got.tolist() == expected, use_numpy


def test_chunktopk_index_width_and_section_size() -> None:
    x = student_t(1_000_000, seed=3)
    for block, bits in ((4096, 12), (256, 8), (65536, 16)):
        codec = ChunkTopK(0.01, block=block)
        env = TensorEnvelope.FromString(codec.encode(x, seed=0))
        assert env.index_bits == bits
        assert env.count == codec.k_for(x.numel())
        assert env.indices.raw_size == math.ceil(env.count * bits / 8)
    # a tensor shorter than the block needs only enough bits to address it
    env = TensorEnvelope.FromString(ChunkTopK(0.1).encode(student_t(700, seed=4), seed=0))
    assert env.index_bits == 10 and env.count == 70


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("chunktopk:0.01:block=100", "power of two"),
        ("chunktopk:0.01:block=4", "power of two"),
        ("chunktopk:0.01:exact", "unknown flag 'exact'"),
        ("chunktopk:0", "ratio must be in (0, 1]"),
        ("chunktopk:0.01+topk:0.5", "two sparsifiers"),
        ("int2+chunktopk:0.01", "nothing can follow the quantizer"),
        ("int2:block=3", "power of two"),
        ("int2:0.5", "0 positional"),
    ],
)
def test_bad_new_specs_are_rejected(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match="Valid forms") as info:
        from_spec(spec)
    assert problem in str(info.value)
    assert "chunktopk:RATIO" in str(info.value) and "int2" in str(info.value)


@pytest.mark.parametrize(
    ("written", "canonical"),
    [("chunktopk:1e-2:block=4096", "chunktopk:0.01"), ("int2:block=64", "int2")],
)
def test_new_specs_normalise(written: str, canonical: str) -> None:
    assert from_spec(written).spec == canonical


# ----------------------------------------------------------------------------- malformed input

MALFORMED_SPECS = ["int2", "topk:0.05+int2", "chunktopk:0.05:block=64", "chunktopk:0.1+int2:sr"]


@pytest.mark.parametrize("spec", MALFORMED_SPECS)
def test_truncated_payloads_are_rejected(spec: str) -> None:
    codec = from_spec(spec)
    data = codec.encode(student_t(5000, seed=5), seed=1)
    for cut in sorted({1, 2, 5, 17, len(data) // 3, len(data) // 2, len(data) - 9, len(data) - 1}):
        with pytest.raises(DecodeError):
            codec.decode(data[:cut])


def _edited(spec: str, edit) -> tuple[object, bytes]:
    codec = from_spec(spec)
    env = TensorEnvelope.FromString(codec.encode(student_t(1000, seed=6), seed=1))
    edit(env)
    return codec, _resign(env)


def _offsets_edit(change):
    """Rewrite the in-block offsets of a chunktopk payload (still well-packed)."""

    def edit(env: TensorEnvelope) -> None:
        off = unpack_uint(_u8(_raw_section(env, "indices")), env.index_bits, env.count)
        change(off, env.index_bits)
        _set_raw(env, "indices", bytes(pack_uint(off, env.index_bits).tolist()))

    return edit


def _repeat_first(off: torch.Tensor, bits: int) -> None:
    off[1] = off[0]


def _past_the_end(off: torch.Tensor, bits: int) -> None:
    off[-1] = (1 << bits) - 1


def _resize(name: str, delta: int):
    def edit(env: TensorEnvelope) -> None:
        raw = _raw_section(env, name)
        _set_raw(env, name, raw + bytes(delta) if delta > 0 else raw[:delta])

    return edit


@pytest.mark.parametrize(
    ("spec", "edit", "match"),
    [
        ("int2", _resize("values", 1), "the codec needs"),
        ("int2", _resize("values", -1), "the codec needs"),
        ("int2", _resize("scales", -4), "the codec needs"),
        ("topk:0.05+int2", _resize("values", 1), "the codec needs"),
        ("chunktopk:0.05:block=64", _resize("values", -4), "the codec needs"),
        ("chunktopk:0.05:block=64", _resize("indices", 1), "at most|bytes for"),
        ("chunktopk:0.05:block=64", _resize("indices", -1), "bytes for"),
        ("chunktopk:0.05:block=64", _offsets_edit(_repeat_first), "strictly increasing"),
        # 1000 elements < one block of 4096: 10-bit offsets, and 1023 is past the end
        ("chunktopk:0.1+int2:sr", _offsets_edit(_past_the_end), "out of range"),
    ],
)
def test_wrong_sizes_and_bad_offsets_are_rejected(spec: str, edit, match: str) -> None:
    codec, data = _edited(spec, edit)
    with pytest.raises(DecodeError, match=match):
        codec.decode(data)
    with pytest.raises(DecodeError, match=match):
        codec.decode_add_(data, torch.zeros(1000))


@pytest.mark.parametrize("bits", [0, 9, 11, 40])
def test_chunktopk_rejects_a_foreign_index_width(bits: int) -> None:
    def edit(env: TensorEnvelope) -> None:
        env.index_bits = bits

    codec, data = _edited("chunktopk:0.1+int2:sr", edit)  # 1000 < 4096 elements: 10 bits
    with pytest.raises(DecodeError, match="index_bits"):
        codec.decode(data)


def test_chunktopk_rejects_a_wrong_count() -> None:
    def edit(env: TensorEnvelope) -> None:
        env.count -= 1

    codec, data = _edited("chunktopk:0.05:block=64", edit)
    with pytest.raises(DecodeError, match="keeps"):
        codec.decode(data)


# ----------------------------------------------------------------------------- multi-chunk

#: Above engine.CHUNK (2**20) elements and not a multiple of it, nor of any block.
BIG = (1 << 21) + 4099
PIECE = 1 << 20


@pytest.fixture(scope="module")
def big() -> torch.Tensor:
    return student_t(BIG, seed=7)


@pytest.mark.parametrize(
    "spec",
    ["none", "fp16", "int8", "int4", "int2", "sign", "chunktopk:0.5+int2", "chunktopk:0.01+int8"],
)
def test_multi_chunk_equals_chunk_by_chunk(spec: str, big: torch.Tensor) -> None:
    """Blocks never straddle a chunk, so for deterministic codecs whose blocks align with the
    2**20-element chunks, encoding the whole tensor decodes to the concatenation of encoding
    each chunk on its own, bit for bit (chunktopk:0.5 keeps over 2**20 values, so its int2
    stage also runs chunked)."""
    codec = from_spec(spec)
    whole = codec.decode(codec.encode(big, seed=3))
    pieces = [codec.decode(codec.encode(p, seed=3)) for p in big.split(PIECE)]
    assert torch.equal(whole, torch.cat(pieces))
    out = torch.zeros(BIG)
    assert torch.equal(codec.decode_add_(codec.encode(big, seed=3), out), whole)


@pytest.mark.parametrize(
    ("spec", "rel"),
    [
        # relative error ||x - d|| / ||x|| on Student-t(3): measured 0.27, 1.63, 1.30, 0.80,
        # 0.76, 0.64; stochastic rounding trades variance for unbiasedness
        ("int4:sr", 0.4),
        ("qsgd:4", 2.5),
        ("int2:sr", 2.0),
        ("topk:0.01+int8", 0.9),
        ("topk:0.4+int2", 0.9),
        ("randomk:0.6+int4", 0.8),
    ],
)
def test_multi_chunk_stochastic_and_global_codecs(spec: str, rel: float, big) -> None:
    codec = from_spec(spec)
    data = codec.encode(big, seed=4)
    d = codec.decode(data, max_numel=BIG)
    assert d.shape == big.shape and bool(torch.isfinite(d).all())
    assert float((big - d).norm()) < rel * float(big.norm())
    assert torch.equal(codec.decode_add_(data, torch.zeros(BIG)), d)
    out = torch.full((BIG,), 3.0)
    assert torch.equal(codec.decode(data, out=out), d)
    with pytest.raises(DecodeError, match="over the limit"):
        codec.decode(data, max_numel=BIG - 1)
