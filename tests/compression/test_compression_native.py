"""The fused bitmap kernels (compression/kernels.c through compression/native.py) give
numpy's bits: the same selection, the same adds, the same bytes on the wire, so peers with
and without them agree."""

from __future__ import annotations

import contextlib
import ctypes
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gossipgrad.compression import DecodeError, ErrorFeedback, native, wire
from gossipgrad.compression.bitpack import BITMAP_INDEX_BITS, Bitmap, checked_rice, rice_encode
from gossipgrad.compression.quantizers import Int2, Int4
from gossipgrad.compression.selection import _candidates_numpy, _put_back, approx_topk
from gossipgrad.compression.spec import from_spec
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def _cpu_has_avx2() -> bool:
    flags = Path("/proc/cpuinfo")
    return flags.is_file() and " avx2" in flags.read_text()


needs_kernels = pytest.mark.skipif(not native.available(), reason=native.status())


@contextlib.contextmanager
def without_kernels() -> Iterator[None]:
    """numpy's passes within, as on a peer without the kernels."""
    lib = native._lib
    native._lib = None
    try:
        yield
    finally:
        native._lib = lib


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not _cpu_has_avx2(), reason="the kernels need x86-64 AVX2"
)
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the install skips them")
def test_the_kernels_are_built_and_loaded_where_the_cpu_runs_them() -> None:
    """An install on x86-64 with AVX2 and a C compiler (CI's: scripts/setup.sh --test brings
    one) has them: a build that lost its compile step would otherwise go on silently at
    numpy's speed."""
    assert native.status() == "avx2"


@needs_kernels
@given(
    n=st.integers(1, 3000),
    ratio=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
@SETTINGS
def test_the_selection_kernel_gives_numpys_bitmap_and_values(
    n: int, ratio: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.1] = 0.0  # zeros and ties at the threshold
    threshold = float(x.abs().quantile(1.0 - ratio)) if n else 0.0
    k = n + 1
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    values = np.empty(k + 8, dtype=np.float32)
    held = native.select(x.numpy(), threshold, bits, values)
    mask = x.abs().numpy() >= np.float32(threshold)
    assert held == int(mask.sum())
    assert np.array_equal(bits, np.packbits(mask))
    assert np.array_equal(values[:held], x.numpy()[mask])


@needs_kernels
def test_the_selection_kernel_gives_way_on_an_overshoot() -> None:
    x = np.arange(1, 101, dtype=np.float32)
    bits, values = np.empty(13, dtype=np.uint8), np.empty(10 + 8, dtype=np.float32)
    assert native.select(x, 50.0, bits, values) == -1  # 51 kept, room for 10
    assert native.select(x, 91.0, bits, values) == 10


@needs_kernels
@given(n=st.integers(1, 3000), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
@SETTINGS
def test_the_add_kernel_is_index_add_bit_for_bit(n: int, density: float, seed: int) -> None:
    """t + v * alpha rounded twice, as index_add_ does; the other positions untouched, -0.0
    included (an add of 0 would make it +0.0)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, generator=g) * 1e3
    target[::7] = -0.0
    mask = torch.rand(n, generator=g) < density
    values = torch.randn(int(mask.sum()), generator=g)
    bits = np.packbits(mask.numpy())
    alpha = float(torch.randn(1, generator=g))
    want = target.clone().index_add_(0, torch.nonzero(mask).reshape(-1), values, alpha=alpha)
    native.bitmap_add(bits, values, target, alpha)
    assert torch.equal(target.view(torch.int32), want.view(torch.int32))
    gathered = native.bitmap_gather(bits, want, values.numel())
    assert torch.equal(gathered, want[mask])


@needs_kernels
@given(
    n=st.integers(1, 5000),
    densities=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
@SETTINGS
def test_several_messages_added_in_one_pass_are_added_one_after_another(
    n: int, densities: list[float], seed: int
) -> None:
    """bitmap_add_many: each entry gets the bits of the terms' adds in their order, eight
    groups at a time and one at a time near the end of a term's values."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, generator=g) * 1e3
    target[::5] = -0.0
    parts, alphas = [], []
    for density in densities:
        mask = torch.rand(n, generator=g) < density
        parts.append((np.packbits(mask.numpy()), torch.randn(int(mask.sum()), generator=g)))
        alphas.append(float(torch.randn(1, generator=g)))
    want = target.clone()
    for (bits, values), alpha in zip(parts, alphas, strict=True):
        native.bitmap_add(bits, values, want, alpha)
    native.bitmap_add_many(parts, alphas, target)
    assert torch.equal(target.view(torch.int32), want.view(torch.int32))


@needs_kernels
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**16))
@SETTINGS
def test_adding_a_difference_in_one_pass_is_torchs_sub_then_add(n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, a, b = (torch.randn(n, generator=g) * 10.0 ** float(i) for i in range(3))
    want = x + torch.sub(a, b)
    native.add_difference(x, a, b)
    assert torch.equal(x.view(torch.int32), want.view(torch.int32))


@needs_kernels
def test_a_bitmap_holding_other_than_its_count_is_refused() -> None:
    mask = np.zeros(40, dtype=np.bool_)
    mask[[1, 9, 30]] = True
    bits, target = np.packbits(mask), torch.zeros(40)
    with pytest.raises(ValueError, match="positions"):
        native.bitmap_add(bits, torch.ones(2), target, 1.0)
    with pytest.raises(ValueError, match="positions"):
        native.bitmap_gather(bits, target, 4)


@needs_kernels
@pytest.mark.parametrize(
    "spec", ["topk:0.2+int2", "topk:0.3+int4:block=128", "topk:0.25+fp16", "topk:0.1+int2"]
)
def test_a_message_encoded_and_applied_with_the_kernels_is_numpys_bit_for_bit(spec: str) -> None:
    """Encode with error feedback, decode into a tensor and apply what the encoder built,
    with and without the kernels, over chunks the positions and the values cross at
    different places: the same bytes, the same residual, the same target."""
    n = 3 * (1 << 20) + 13
    g = torch.Generator().manual_seed(5)
    anchor, theta = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run() -> tuple[bytes, torch.Tensor, torch.Tensor, float]:
        feedback = ErrorFeedback(from_spec(spec))
        data, built = feedback.compress_difference_parts("v", anchor, theta, seed=3)
        target = theta.clone()
        feedback.codec.decode_add_(data, target, alpha=-0.5)
        assert built is not None
        built.add_to_(target, alpha=0.25)
        return data, feedback.residual("v"), target, built.residual_norm(anchor - theta)

    fused = run()
    env = wire.parse_envelope(fused[0], spec, n)
    assert (env.index_bits == BITMAP_INDEX_BITS) is (spec != "topk:0.1+int2")  # else Rice
    with without_kernels():
        plain = run()
    assert fused[0] == plain[0]
    assert torch.equal(fused[1], plain[1]) and torch.equal(fused[2], plain[2])
    assert fused[3] == pytest.approx(plain[3], rel=1e-5)


@needs_kernels
def test_the_fused_selection_holds_no_indices_and_numpys_does() -> None:
    """The kernel's selection is its bitmap and values (the positions: 1 bit each where an
    index array takes 64); numpy's pass keeps its indices."""
    n = 1 << 22  # the threshold is aimed below k from 4M entries on at top-20 %
    x = torch.randn(n, generator=torch.Generator().manual_seed(9))
    fused = approx_topk(x, n // 5, seed=1, gather=True)
    assert fused.idx is None and fused.bitmap is not None and fused.values is not None
    threshold = float(fused.values.abs().min())
    plain = _candidates_numpy(x, threshold, n // 5, gather=True, bitmap=False)
    assert plain.idx is not None and plain.count == fused.count
    positions = torch.cat(list(Bitmap(fused.bitmap, n, fused.count).pieces()))
    assert torch.equal(positions, plain.idx)


@without_kernels()
def test_without_the_kernels_a_bitmap_is_applied_by_numpys_pieces() -> None:
    n = (1 << 20) + 5
    codec = from_spec("topk:0.2+int2")
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    data = codec.encode(x, seed=1)
    assert wire.parse_envelope(data, codec.spec, n).index_bits == BITMAP_INDEX_BITS
    target = torch.zeros(n)
    codec.decode_add_(data, target)
    assert torch.equal(target, codec.decode(data))
    half = torch.zeros(n, dtype=torch.float16)  # a float16 target never takes the kernels
    codec.decode_add_(data, half, cast=True)
    assert torch.equal(half, codec.decode(data).half())


@needs_kernels
@given(
    n=st.integers(1, 2000),
    block=st.sampled_from([8, 64, 256]),
    seed=st.integers(0, 2**16),
    spread=st.sampled_from([1e-3, 1.0, 3e4]),
)
@SETTINGS
def test_the_fused_sign_encode_folds_what_a_peer_without_kernels_decodes(
    n: int, block: int, seed: int, spread: float
) -> None:
    """A float32 anchor against its float16 copy (diloco's anchors): the kernel's signs are
    numpy's, its scales the blocks' mean magnitudes (their own summation order), and the
    copy it folds equals the old copy plus its bytes decoded -- by the kernel, and by numpy's
    passes on a peer without it -- bit for bit, float16 overflow to infinity included."""
    g = torch.Generator().manual_seed(seed)
    codec = from_spec(f"sign:block={block}" if block != 256 else "sign")
    copy = (torch.randn(n, generator=g) * spread).clamp(-65000, 65000).half()
    anchor = copy.float() + torch.randn(n, generator=g) * spread * 0.1
    anchor[::5] = copy[::5].float()  # zero differences: the sign of 0 is +
    folded = copy.clone()
    data, _, left = codec.encode_difference(anchor, folded, 1, fold=True)
    mirror = copy.clone()
    codec.decode_add_(data, mirror, cast=True)
    assert torch.equal(mirror.view(torch.int16), folded.view(torch.int16))
    decoded = codec.decode(data)
    assert left == pytest.approx(float((anchor - copy.float() - decoded).norm()), rel=1e-4)
    with without_kernels():
        plain_data, _, _ = codec.encode_difference(anchor, copy.clone(), 1, fold=True)
    env, plain_env = (
        wire.parse_envelope(data, codec.spec, n),
        wire.parse_envelope(plain_data, codec.spec, n),
    )

    def section(e: wire.Envelope, name: str) -> bytes:
        return bytes(wire.read_section(e, name, limit=4 * n))

    assert section(env, "values") == section(plain_env, "values")
    scales = np.frombuffer(section(env, "scales"), np.float32)
    plain_scales = np.frombuffer(section(plain_env, "scales"), np.float32)
    assert np.allclose(scales, plain_scales, rtol=1e-5, atol=0)
    mirror = copy.clone()
    with without_kernels():
        codec.decode_add_(data, mirror, cast=True)  # numpy's decode of the kernel's bytes
    assert torch.equal(mirror.view(torch.int16), folded.view(torch.int16))


@needs_kernels
def test_a_non_finite_difference_is_refused_by_the_fused_sign_encode() -> None:
    codec = from_spec("sign")
    anchor, copy = torch.zeros(4096), torch.zeros(4096, dtype=torch.float16)
    anchor[3000] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.encode_difference(anchor, copy, 1, fold=True)
    assert not copy[2048:].any()  # the blocks from the bad one on are left alone


@needs_kernels
def test_error_feedback_accumulates_and_selects_in_one_pass_as_numpy_does() -> None:
    """``compress_difference`` with a dense top-k of float32 on CPU adds a − b into the
    residual and selects in one fused pass (no indices held): the bytes and the residual of
    numpy's passes, over three rounds; a non-finite difference is refused and the residual
    restored."""
    n = 3 * (1 << 20) + 5
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    fused, plain = (
        ErrorFeedback(from_spec("topk:0.2+int2")),
        ErrorFeedback(from_spec("topk:0.2+int2")),
    )
    for seed in (1, 2, 3):
        data, sent = fused.compress_difference_parts("v", a, b, seed)
        assert sent is not None and isinstance(sent.idx, Bitmap)
        with without_kernels():
            assert plain.compress_difference("v", a, b, seed) == data
        assert torch.equal(fused.residual("v"), plain.residual("v"))
        a.add_(torch.randn(n, generator=g), alpha=0.1)
    before = fused.residual("v").clone()
    a[n // 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        fused.compress_difference("v", a, b, 4)
    torch.testing.assert_close(fused.residual("v"), before)


def _int2_step_by_numpy(
    e: torch.Tensor, a: torch.Tensor, b: torch.Tensor, threshold: float, block: int
) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error feedback's step by numpy's passes: e + (a - b), the kept ones' bitmap, their
    Int2 codes and scales, and the sum with their dequantized values added at alpha -1."""
    total = e + (a - b)
    mask = total.abs() >= threshold
    q = Int2(block=block)
    codes, scales = q.quantize(total[mask], None)
    held = int(mask.sum())
    residual = total.clone()
    if held:
        deq = q.dequantize(codes, scales, held, torch.float32)
        positions = torch.from_numpy(np.flatnonzero(mask.numpy()))
        residual.index_add_(0, positions, deq, alpha=-1.0)
    return np.packbits(mask.numpy()), codes, scales, residual


@needs_kernels
@given(
    n=st.integers(1, 20_000),  # up to five tiles of 512 groups of eight
    density=st.floats(0.01, 1.0),
    block=st.sampled_from([8, 64, 1024]),
    seed=st.integers(0, 2**16),
)
@SETTINGS
def test_the_int2_selection_quantizes_and_takes_out_as_numpy_does(
    n: int, density: float, block: int, seed: int
) -> None:
    """One pass: e += a - b, the kept values' bitmap, their Int2 codes and scales, and e less
    what they decode to at their positions: numpy's bits for each, across tiles, blocks that
    end anywhere and a tail shorter than eight; and ||e|| after, summed as it was written."""
    g = torch.Generator().manual_seed(seed)
    e, a, b = (torch.randn(n, generator=g) for _ in range(3))
    a[torch.rand(n, generator=g) < 0.05] = 0.0
    threshold = max(float((e + (a - b)).abs().quantile(1.0 - density)), 1e-6)
    bits_ref, codes_ref, scales_ref, residual = _int2_step_by_numpy(e, a, b, threshold, block)
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    values = np.empty(n + 8, dtype=np.float32)
    codes = np.empty((n + 3) // 4, dtype=np.uint8)
    scales = np.empty(-(-n // block), dtype=np.float32)
    held, written, bad, left = native.accumulate_select_int2(
        e, a, b, threshold, bits, values, codes, scales, block
    )
    assert bad == 0 and held == written == int(np.unpackbits(bits_ref).sum())
    assert np.array_equal(bits, bits_ref)
    assert np.array_equal(codes[: (held + 3) // 4], codes_ref.numpy())
    assert np.array_equal(scales[: -(-held // block)], scales_ref.numpy())
    assert torch.equal(e, residual)
    assert left == pytest.approx(float(residual.double().norm()), rel=1e-5, abs=1e-9)


@needs_kernels
@given(rbits=st.integers(1, 40), count=st.integers(0, 3000), seed=st.integers(0, 2**16))
@SETTINGS
def test_a_rice_streams_remainders_sum_as_numpy_sums_them(
    rbits: int, count: int, seed: int
) -> None:
    """``field_sum`` (a Rice stream's check of its last position) is the sum of the fields,
    whatever their width, however many: a word at a time by popcounts up to 8 bits, a field
    at a time above."""
    fields = np.random.default_rng(seed).integers(0, 1 << rbits, count, dtype=np.uint64)
    big_endian = fields.astype(">u8").view(np.uint8).reshape(-1, 8)
    bits = np.unpackbits(big_endian, axis=1)[:, 64 - rbits :].reshape(-1)
    padded = np.concatenate([np.packbits(bits), np.zeros(native.PAD, dtype=np.uint8)])
    assert native.field_sum(padded, rbits, count) == int(fields.sum())


@needs_kernels
def test_error_feedbacks_int2_step_measures_the_residual_it_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``residual_norm`` after the fused int2 step is ||residual||, summed by the pass as it
    wrote the residual: the metric reads the model-sized residual no more (a read of it
    fails here), round after round."""
    n = 3 * (1 << 20) + 13  # a threshold aimed from a sample: the fused pass
    g = torch.Generator().manual_seed(9)
    feedback = ErrorFeedback(from_spec("topk:0.2+int2"))
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    for seed in (1, 2, 3):
        feedback.compress_difference("v", a, b, seed)
        expected = float(feedback.residual("v").double().norm())
        with monkeypatch.context() as patched:
            patched.setattr(torch.linalg, "vector_norm", lambda *_: pytest.fail("a read"))
            assert feedback.residual_norm("v") == pytest.approx(expected, rel=1e-5)
        a.add_(torch.randn(n, generator=g), alpha=0.3)


@needs_kernels
@given(
    count=st.integers(0, 3000),
    block=st.sampled_from([8, 64, 256]),
    zero_at=st.one_of(st.none(), st.integers(0, 2999)),
    seed=st.integers(0, 2**16),
)
@SETTINGS
def test_int2_codes_are_checked_and_dequantized_as_numpy_does(
    count: int, block: int, zero_at: int | None, seed: int
) -> None:
    """The first code 0 (never written) is found wherever it is; codes dequantize to
    numpy's level times scale, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q = Int2(block=block)
    codes, scales = q.quantize(torch.randn(count, generator=g), None)
    with without_kernels():
        want = q.dequantize(codes, scales, count, torch.float32)
    assert torch.equal(native.dequantize_codes(2, codes, scales, block, count), want)
    assert native.int2_first_zero(codes, count) == -1
    if zero_at is not None and zero_at < count:
        broken = codes.clone()
        broken[zero_at // 4] &= ~(3 << (6 - 2 * (zero_at % 4))) & 0xFF
        assert native.int2_first_zero(broken, count) == zero_at
        with pytest.raises(DecodeError, match="code 0"):
            q.check(broken, scales, count, torch.float32)


@needs_kernels
@given(
    count=st.integers(0, 3000),
    block=st.sampled_from([8, 64, 256]),
    seed=st.integers(0, 2**16),
    every_code=st.booleans(),
)
@SETTINGS
def test_int4_codes_are_dequantized_as_numpy_does(
    count: int, block: int, seed: int, every_code: bool
) -> None:
    """Int4's codes (two a byte, high bits first) dequantize to numpy's level times scale,
    bit for bit, for every code a byte may hold (-8 too, which Int4 never writes), through
    the kernel and through ``Int4.dequantize``."""
    g = torch.Generator().manual_seed(seed)
    q = Int4(block=block)
    codes, scales = q.quantize(torch.randn(count, generator=g), None)
    if every_code:
        codes = torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8)
    with without_kernels():
        want = q.dequantize(codes, scales, count, torch.float32)
    assert torch.equal(native.dequantize_codes(4, codes, scales, block, count), want)
    assert torch.equal(q.dequantize(codes, scales, count, torch.float32), want)
    assert torch.equal(q.dequantize(codes, scales, count, torch.float16), want.to(torch.float16))


@needs_kernels
def test_the_int2_selection_gives_way_on_an_overshoot_and_its_values_go_back() -> None:
    """More kept than room: the rest is only accumulated; the values it had taken out are
    told (``written``) and put back exactly, so a fallback selects from the sums."""
    n, block = 50_000, 64
    g = torch.Generator().manual_seed(3)
    e, a, b = (torch.randn(n, generator=g) for _ in range(3))
    total = e + (a - b)
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    values = np.empty(1000 + 8, dtype=np.float32)
    codes, scales = np.empty(250, dtype=np.uint8), np.empty(16, dtype=np.float32)
    held, written, bad, left = native.accumulate_select_int2(
        e, a, b, 3.0, bits, values, codes, scales, block
    )
    assert (held, bad, left) == (-1, 0, None) and 0 < written <= 1000
    assert not torch.equal(e, total)  # the first tiles' kept values were taken out
    _put_back(e, bits, values, written)
    assert torch.equal(e, total)


@needs_kernels
def test_an_average_of_bitmap_messages_is_added_in_one_pass_as_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``add_all_`` of an encoder's own message (as built), another's bytes and one as its
    receipt kept it, a corrupt one among them: the corrupt one is left out and named, the rest
    added in one pass with the bits of adding them one after another (numpy's passes, one
    ``decode_add_`` each)."""
    n = 3 * (1 << 20) + 13
    g = torch.Generator().manual_seed(8)
    feedback = ErrorFeedback(from_spec("topk:0.2+int2"))
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    _, built = feedback.compress_difference_parts("v", a, b, 1)
    others = [feedback.codec.encode(torch.randn(n, generator=g), seed=s) for s in (2, 3)]
    corrupt = bytearray(others[0])
    corrupt[len(corrupt) // 2] ^= 0xFF
    assert built is not None
    received = feedback.codec.receive(others[1])
    terms = [(built, -0.25), (others[0], -0.25), (bytes(corrupt), 0.5), (received, -0.25)]
    target = torch.randn(n, generator=g)
    expected = target.clone()
    with without_kernels():
        built.add_to_(expected, alpha=-0.25)
        for payload in others:
            feedback.codec.decode_add_(payload, expected, alpha=-0.25)
    passes = []
    one_pass = native.bitmap_add_many
    monkeypatch.setattr(
        native,
        "bitmap_add_many",
        lambda parts, *rest: passes.append(len(parts)) or one_pass(parts, *rest),
    )
    failed = feedback.codec.add_all_(terms, target)
    assert [i for i, _ in failed] == [2]
    assert set(passes) == {3}  # every stretch: the three good terms at once
    assert torch.equal(target.view(torch.int32), expected.view(torch.int32))
    with without_kernels():
        again = torch.randn(n, generator=torch.Generator().manual_seed(8))
        assert [i for i, _ in feedback.codec.add_all_(terms, again)] == [2]


@needs_kernels
@given(numel=st.integers(1, 5000), data=st.data())
@SETTINGS
def test_rice_coding_a_bitmaps_positions_gives_numpys_bytes(
    numel: int, data: st.DataObject
) -> None:
    idx = sorted(data.draw(st.sets(st.integers(0, numel - 1), min_size=1, max_size=600)))
    bits = data.draw(st.integers(0, 12))
    mask = np.zeros(numel, dtype=np.bool_)
    mask[idx] = True
    coded = native.rice_encode_bitmap(np.packbits(mask), numel, len(idx), bits)
    want = rice_encode(torch.tensor(idx, dtype=torch.int64), bits).numpy()
    assert coded is not None and np.array_equal(coded, want)
    stream = checked_rice(torch.from_numpy(coded), bits, len(idx), numel)
    assert stream.indices().tolist() == idx
    target = torch.randn(numel)
    values = torch.randn(len(idx))
    want_target = target.clone().index_add_(0, torch.tensor(idx), values, alpha=0.7)
    state = (ctypes.c_int64 * 3)(0, 0, -1)
    half = len(idx) // 2  # in two calls: the stream's place carries over
    native.rice_add(stream.head, stream.rem, bits, values[:half], 0.7, target, state)
    native.rice_add(stream.head, stream.rem, bits, values[half:], 0.7, target, state)
    assert torch.equal(target, want_target)


@needs_kernels
def test_a_rice_stream_is_refused_as_numpy_refuses_it_before_anything_is_added() -> None:
    idx = torch.tensor([3, 9, 10, 500], dtype=torch.int64)
    enc = rice_encode(idx, 4)
    with pytest.raises(DecodeError, match="out of range"):
        checked_rice(enc, 4, 4, 500)
    with pytest.raises(DecodeError, match="gaps"):
        checked_rice(enc, 4, 3, 1000)
    with pytest.raises(DecodeError, match="trailing"):
        padded = torch.cat([enc[:-2], torch.zeros(1, dtype=torch.uint8), enc[-2:]])
        checked_rice(padded, 4, 4, 1000)
    with pytest.raises(DecodeError):
        checked_rice(enc[:1], 4, 4, 1000)
    with pytest.raises(DecodeError, match="index_bits"):
        checked_rice(enc, 99, 4, 1000)
    odd = rice_encode(idx, 3)  # 12 bits of remainders: 4 of padding
    with pytest.raises(DecodeError, match="padding"):
        checked_rice(
            odd | torch.tensor([0] * (odd.numel() - 1) + [1], dtype=torch.uint8), 3, 4, 999
        )
    # A whole message whose last positions lie past its tensor's end: refused before
    # anything is added.
    n = 1 << 20
    codec = from_spec("topk:0.1+int2")
    wider = torch.cat(
        [torch.randn(n, generator=torch.Generator().manual_seed(3)), torch.full((8,), 100.0)]
    )
    env = wire.parse_envelope(codec.encode(wider, seed=1), codec.spec, n + 8)
    assert env.index_bits != BITMAP_INDEX_BITS

    def section(name: str) -> torch.Tensor:
        return wire.bytes_to_tensor(wire.read_section(env, name, limit=4 * n), torch.device("cpu"))

    forged = wire.build_envelope(
        shape=(n,), dtype=torch.float32, spec=codec.spec, seed=env.seed, count=env.count,
        index_bits=env.index_bits, indices=section("indices"), values=section("values"),
        scales=section("scales").view(torch.float32),
    )  # fmt: skip
    target = torch.randn(n)
    before = target.clone()
    with pytest.raises(DecodeError, match="out of range"):
        codec.decode_add_(forged, target)
    assert torch.equal(target, before)
