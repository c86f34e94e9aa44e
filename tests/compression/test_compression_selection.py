"""Top-k selection (approximate vs exact) and the bit-packing it relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gossipgrad.compression import DecodeError, bitpack, wire
from gossipgrad.compression.bitpack import (
    BITMAP_INDEX_BITS,
    bitmap_decode,
    bitmap_encode,
    bitmap_pays,
    bitmap_pieces,
    pack_bits,
    pack_uint,
    rice_bits_for,
    rice_decode,
    rice_encode,
    rice_max_bytes,
    unpack_bits,
    unpack_uint,
)
from gossipgrad.compression.selection import approx_topk_indices, exact_topk_indices
from gossipgrad.compression.spec import from_spec
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def student_t(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=g)
    chi2 = torch.randn(n, 3, generator=g).pow(2).sum(1)
    return normal / (chi2 / 3).sqrt()


@pytest.mark.parametrize("use_numpy", [True, False])
@pytest.mark.parametrize(("n", "ratio"), [(1_000_000, 0.01), (2_000_000, 0.001), (300_000, 0.1)])
def test_approx_topk_matches_exact_energy_and_count(use_numpy: bool, n: int, ratio: float) -> None:
    x = student_t(n, seed=n)
    k = round(ratio * n)
    approx = approx_topk_indices(x, k, seed=3, use_numpy=use_numpy)
    exact = exact_topk_indices(x, k)
    assert approx.dtype == torch.int64 and bool((approx.diff() > 0).all())
    assert 0.95 * k <= approx.numel() <= k
    e_approx = float(x[approx].double().pow(2).sum())
    e_exact = float(x[exact].double().pow(2).sum())
    assert e_approx >= 0.95 * e_exact
    # In practice the selection is the exact top-k set (continuous data: no ties).
    assert torch.equal(approx, exact)


def test_approx_topk_ties_and_zeros() -> None:
    x = torch.zeros(200_000)
    x[::7] = 1.0  # 28572 tied non-zeros, k below that: ties resolved towards low indices
    idx = approx_topk_indices(x, 1000, seed=1)
    assert idx.numel() == 1000 and bool((x[idx] == 1).all())
    assert torch.equal(idx, torch.arange(0, 7000, 7))
    sparse = torch.zeros(500_000)
    sparse[[5, 17, 400_000]] = torch.tensor([3.0, -4.0, 0.5])
    # fewer non-zeros than k: the non-zeros are all that is worth sending
    assert approx_topk_indices(sparse, 5000, seed=0).tolist() == [5, 17, 400_000]
    assert approx_topk_indices(torch.zeros(100_000), 100).numel() == 0


def test_exact_topk_edges() -> None:
    x = torch.tensor([3.0, -5.0, 1.0])
    assert exact_topk_indices(x, 0).numel() == 0
    assert exact_topk_indices(x, 3).tolist() == [0, 1, 2]
    assert exact_topk_indices(x, 1).tolist() == [1]


# ----------------------------------------------------------------------------- bit packing


@pytest.mark.parametrize("use_numpy", [True, False])
@given(bits=st.lists(st.booleans(), max_size=100))
@SETTINGS
def test_pack_bits_round_trip(use_numpy: bool, bits: list[bool]) -> None:
    t = torch.tensor(bits, dtype=torch.bool)
    packed = pack_bits(t, use_numpy=use_numpy)
    assert packed.numel() == (len(bits) + 7) // 8
    assert torch.equal(unpack_bits(packed, len(bits), use_numpy=use_numpy).bool(), t)
    assert torch.equal(packed, pack_bits(t, use_numpy=not use_numpy))


@given(
    width=st.integers(1, 40),
    data=st.data(),
)
@SETTINGS
def test_pack_uint_round_trip_both_paths(width: int, data: st.DataObject) -> None:
    vals = data.draw(st.lists(st.integers(0, 2**width - 1), max_size=60))
    t = torch.tensor(vals, dtype=torch.int64)
    a = pack_uint(t, width, use_numpy=True)
    b = pack_uint(t, width, use_numpy=False)
    assert torch.equal(a, b) and a.numel() == (len(vals) * width + 7) // 8
    for use_numpy in (True, False):
        assert unpack_uint(a, width, len(vals), use_numpy=use_numpy).tolist() == vals


@given(
    numel=st.integers(1, 5000),
    data=st.data(),
)
@SETTINGS
def test_rice_round_trip_and_size_bound(numel: int, data: st.DataObject) -> None:
    idx = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=300)))
    t = torch.tensor(idx, dtype=torch.int64)
    bits = rice_bits_for(len(idx), numel)
    if data.draw(st.booleans()):
        bits = data.draw(st.integers(0, 12))
    enc = rice_encode(t, bits, use_numpy=True)
    assert torch.equal(enc, rice_encode(t, bits, use_numpy=False))
    assert enc.numel() <= rice_max_bytes(len(idx), numel, bits)
    for use_numpy in (True, False):
        assert rice_decode(enc, bits, len(idx), numel, use_numpy=use_numpy).tolist() == idx


def test_rice_size_near_entropy_floor() -> None:
    rng = np.random.default_rng(0)
    n, k = 10_000_000, 100_000
    idx = torch.from_numpy(np.sort(rng.choice(n, k, replace=False)))
    enc = rice_encode(idx, rice_bits_for(k, n))
    # entropy of the gaps ~ log2(e * n / k) bits = 1.04 bytes per index
    assert enc.numel() / k < 1.12


@pytest.mark.parametrize("use_numpy", [True, False])
def test_rice_decode_rejects_bad_streams(use_numpy: bool) -> None:
    idx = torch.tensor([3, 9, 10, 500], dtype=torch.int64)
    enc = rice_encode(idx, 4)
    with pytest.raises(DecodeError, match="out of range"):
        rice_decode(enc, 4, 4, 500, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="gaps"):
        rice_decode(enc, 4, 3, 1000, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="trailing"):
        # an extra zero byte between the unary stream and the remainders (2 bytes)
        padded = torch.cat([enc[:-2], torch.zeros(1, dtype=torch.uint8), enc[-2:]])
        rice_decode(padded, 4, 4, 1000, use_numpy=use_numpy)
    with pytest.raises(DecodeError):
        rice_decode(enc[:1], 4, 4, 1000, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="index_bits"):
        rice_decode(enc, 99, 4, 1000, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="0 indices"):
        rice_decode(enc, 4, 0, 1000, use_numpy=use_numpy)


@pytest.mark.parametrize("use_numpy", [True, False])
@pytest.mark.parametrize("layout", ["plain", "outlier_columns"])
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.3, 0.9])
def test_dense_selection_aims_below_k_and_keeps_the_exact_top_set(
    use_numpy: bool, layout: str, ratio: float
) -> None:
    """From 1/32 of the elements on (to nearly all of them), the threshold is aimed below k
    from a stratified sample: the count lands in the accepted range, the set is the exact
    top-count set, and a layout with a period (a few large columns of 768, as transformers'
    outlier features) does not bias the sample out of range."""
    n = 16_000_000 if ratio < 1 / 8 else 4_000_000  # the sample is at most an eighth of n
    k = round(ratio * n)
    x = student_t(n, seed=11)
    if layout == "outlier_columns":
        x = x * (1.0 + 20.0 * (torch.arange(n) % 768 < 8))
    idx = approx_topk_indices(x, k, seed=5, use_numpy=use_numpy)
    assert 0.95 * k <= idx.numel() <= k
    assert idx.numel() < k  # aimed below k: no partition of the candidates was needed
    assert torch.equal(idx, exact_topk_indices(x, idx.numel()))


@given(numel=st.integers(1, 5000), data=st.data())
@SETTINGS
def test_bitmap_round_trip_both_paths(numel: int, data: st.DataObject) -> None:
    idx = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
    t = torch.tensor(idx, dtype=torch.int64)
    enc = bitmap_encode(t, numel, use_numpy=True)
    assert torch.equal(enc, bitmap_encode(t, numel, use_numpy=False))
    assert enc.numel() == (numel + 7) // 8
    for use_numpy in (True, False):
        assert bitmap_decode(enc, len(idx), numel, use_numpy=use_numpy).tolist() == idx


def test_bitmap_round_trip_across_chunks() -> None:
    n = 3 * (1 << 20) + 13  # three whole chunks and a partial byte
    rng = np.random.default_rng(2)
    idx = torch.from_numpy(np.flatnonzero(rng.random(n) < 0.3))
    enc = bitmap_encode(idx, n)
    assert torch.equal(bitmap_decode(enc, idx.numel(), n), idx)


@pytest.mark.parametrize("use_numpy", [True, False])
def test_bitmap_decode_rejects_bad_streams(use_numpy: bool) -> None:
    idx = torch.tensor([0, 3, 9, 10], dtype=torch.int64)
    enc = bitmap_encode(idx, 12)
    assert bitmap_decode(enc, 4, 12, use_numpy=use_numpy).tolist() == [0, 3, 9, 10]
    with pytest.raises(DecodeError, match="bytes"):
        bitmap_decode(enc[:1], 4, 12, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="padding"):
        bitmap_decode(enc | torch.tensor([0, 1], dtype=torch.uint8), 4, 12, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="positions"):
        bitmap_decode(enc, 3, 12, use_numpy=use_numpy)
    with pytest.raises(DecodeError, match="positions"):
        bitmap_decode(enc, 5, 12, use_numpy=use_numpy)


def test_dense_topk_travels_as_a_bitmap_about_as_small_as_rice() -> None:
    """top-20 %: the index section is a bitmap (index_bits = 64), and after the envelope's
    zstd it is within 2 % of the Rice stream it replaces; below 1/8 Rice stays."""
    import zstandard

    n = 2_000_000
    x = student_t(n, seed=4)
    assert bitmap_pays(n // 8, n) and not bitmap_pays(n // 8 - 1, n)
    for spec, bitmap in (("topk:0.2+int2", True), ("topk:0.1+int2", False)):
        codec = from_spec(spec)
        env = wire.parse_envelope(codec.encode(x, seed=1), codec.spec, n)
        assert (env.index_bits == BITMAP_INDEX_BITS) is bitmap
        idx = approx_topk_indices(x, codec.stages()[0].k_for(n), seed=1)  # the encoder's
        assert idx.numel() == env.count
        if bitmap:
            rice = rice_encode(idx, rice_bits_for(idx.numel(), n)).numpy().tobytes()
            rice_bytes = min(len(rice), len(zstandard.ZstdCompressor(level=1).compress(rice)))
            assert len(env.sections["indices"]) <= 1.02 * rice_bytes


@pytest.mark.parametrize("spec", ["topk:0.2+int2", "topk:0.3+int4:block=128", "topk:0.25+fp16"])
def test_a_bitmap_payload_is_added_a_piece_at_a_time_as_a_whole_decode_would(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_add_ reads a bitmap's positions chunk by chunk and dequantizes the values chunk
    by chunk (neither held whole): the same bits as adding the whole decoded tensor, across
    chunk boundaries that the positions and the values cross at different places. The
    encoder's selection pass gathers the values and the bitmap: the same bytes as the torch
    path, which gathers them after it."""
    n = 3 * (1 << 20) + 13
    codec = from_spec(spec)
    x = student_t(n, seed=21)
    data = codec.encode(x, seed=2)
    monkeypatch.setattr(bitpack, "FORCE_TORCH", True)
    assert codec.encode(x, seed=2) == data
    monkeypatch.setattr(bitpack, "FORCE_TORCH", False)
    env = wire.parse_envelope(data, codec.spec, n)
    assert env.index_bits == BITMAP_INDEX_BITS
    base = student_t(n, seed=22)
    whole = base.clone().add_(codec.decode(data), alpha=-0.5)
    assert torch.equal(codec.decode_add_(data, base.clone(), alpha=-0.5), whole)
    bitmap = index_section(env)
    pieces = list(bitmap_pieces(bitmap, env.count, n))
    assert len(pieces) == 4
    assert torch.equal(torch.cat(pieces), bitmap_decode(bitmap, env.count, n))


def test_a_bitmap_with_a_position_too_many_is_refused_before_anything_is_added() -> None:
    """The positions are checked in full before the first piece is added: a payload whose
    bitmap holds one position more than it declares, in its last chunk, leaves the target as
    it was (a message that does not decode is left out, not half applied)."""
    n = 3 * (1 << 20) + 13
    codec = from_spec("topk:0.2+int2")
    data = codec.encode(student_t(n, seed=23), seed=2)
    env = wire.parse_envelope(data, codec.spec, n)
    bitmap = index_section(env).clone()
    at = int(np.flatnonzero(bitmap.numpy()[:-1] != 0xFF)[-1])  # in the last chunk
    assert at * 8 >= 3 * (1 << 20)
    byte = int(bitmap[at])
    bitmap[at] = byte | (~byte & (byte + 1))  # its lowest clear bit set
    cpu = torch.device("cpu")
    values = wire.bytes_to_tensor(wire.read_section(env, "values", limit=n), cpu)
    scales = wire.bytes_to_tensor(wire.read_section(env, "scales", limit=4 * n), cpu)
    forged = wire.build_envelope(
        shape=env.shape,
        dtype=env.dtype,
        spec=codec.spec,
        seed=env.seed,
        count=env.count,
        index_bits=BITMAP_INDEX_BITS,
        indices=bitmap,
        values=values,
        scales=scales.view(torch.float32),
    )
    with pytest.raises(DecodeError, match="positions"):
        list(bitmap_pieces(bitmap, env.count, n))
    target = student_t(n, seed=24)
    before = target.clone()
    with pytest.raises(DecodeError, match="positions"):
        codec.decode_add_(forged, target)
    assert torch.equal(target, before)


def index_section(env: wire.Envelope) -> torch.Tensor:
    """A payload's index section as a uint8 tensor."""
    raw = wire.read_section(env, "indices", limit=(env.numel + 7) // 8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
