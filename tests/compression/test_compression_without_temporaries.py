"""The codec calls that let a peer keep model-sized work out of memory: a difference encoded
without materialising it, a message validated without decoding it, an increment added to a
copy of narrower dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gossipgrad.compression import DecodeError, ErrorFeedback, from_spec, native

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "topk:0.2+int2", "sign", "none"])
def test_compress_difference_is_compress_of_the_difference(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same bytes, same residual as ``compress(a − b)``, over several slices (CHUNK = 1000)."""
    monkeypatch.setattr("gossipgrad.compression.error_feedback.CHUNK", 1000)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4321, generator=gen), torch.randn(4321, generator=gen)
    one, other = ErrorFeedback(from_spec(spec)), ErrorFeedback(from_spec(spec))
    for seed in (1, 2, 3):
        assert one.compress_difference("v", a, b, seed=seed) == other.compress("v", a - b, seed)
        assert torch.equal(one.residual("v"), other.residual("v"))
        a.add_(torch.randn(4321, generator=gen), alpha=0.1)


@pytest.mark.parametrize("copy", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ["topk:0.01+int8", "topk:0.02+int2", "topk:0.01"])
def test_a_sparse_difference_selected_a_chunk_at_a_time_is_the_difference_encoded(
    spec: str, copy: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``encode_difference`` of a sparse top-k without the difference as a tensor (each
    chunk of it in a buffer: CHOCO's x − x̂) gives the bytes and the fold of encoding the
    difference built whole, and what stays ||(a − b) − decode(bytes)||; a non-finite
    difference is refused."""
    from gossipgrad.compression import engine, selection, sparsifiers

    monkeypatch.setattr(selection, "CHUNK", 50_000)  # several chunks, one short
    passes = []
    chunked = sparsifiers.approx_topk_of_difference
    monkeypatch.setattr(
        sparsifiers,
        "approx_topk_of_difference",
        lambda *args, **kw: passes.append(chunked(*args, **kw)) or passes[-1],
    )
    gen = torch.Generator().manual_seed(8)
    n = 230_001
    a = torch.randn(n, generator=gen)
    b = (a + 0.1 * torch.randn(n, generator=gen)).to(copy)
    codec = from_spec(spec)
    chunked_copy, whole_copy = b.clone(), b.clone()
    data, _, left = codec.encode_difference(a, chunked_copy, seed=4, fold=True)
    with monkeypatch.context() as whole:
        whole.setattr(engine, "_encode_sparse_difference", lambda *_: None)
        expected, _, _ = codec.encode_difference(a, whole_copy, seed=4, fold=True)
    assert passes and passes[0] is not None  # the chunked pass ran
    assert data == expected and torch.equal(chunked_copy, whole_copy)
    difference = a.double() - b.double()
    reference = float((difference - codec.decode(data).double()).norm())
    assert left == pytest.approx(reference, rel=1e-5)
    a[123_456] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.encode_difference(a, b.clone(), seed=5)


def test_a_bfloat16_copy_takes_the_difference_built_whole() -> None:
    """numpy has no bfloat16: such a copy's difference is built whole, the same bytes."""
    codec = from_spec("topk:0.01+int8")
    a = torch.randn(230_001, generator=torch.Generator().manual_seed(9))
    b = a.to(torch.bfloat16)
    data, _, _ = codec.encode_difference(a, b, seed=2)
    assert data == codec.encode(a - b.float(), seed=2)


def test_a_non_finite_difference_is_refused_and_leaves_the_residual(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gossipgrad.compression.error_feedback.CHUNK", 1000)
    ef = ErrorFeedback(from_spec("topk:0.1+int8"))
    a, b = torch.randn(4321), torch.randn(4321)
    ef.compress_difference("v", a, b, seed=1)
    before = ef.residual("v").clone()
    a[3500] = float("nan")  # in the fourth slice: three were added before it was seen
    with pytest.raises(ValueError, match="NaN or infinite"):
        ef.compress_difference("v", a, b, seed=2)
    torch.testing.assert_close(ef.residual("v"), before)


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "randomk:0.1+int4", "sign", "int8", "none"])
def test_inspect_validates_as_decode_does(spec: str) -> None:
    codec = from_spec(spec)
    data = codec.encode(torch.randn(3, 700), seed=5)
    assert codec.inspect(data) == ((3, 700), torch.float32)
    with pytest.raises(DecodeError):
        codec.inspect(data, max_numel=100)
    corrupted = bytearray(data)
    corrupted[len(data) // 2] ^= 0xFF
    with pytest.raises(DecodeError):
        codec.decode(bytes(corrupted))
    with pytest.raises(DecodeError):
        codec.inspect(bytes(corrupted))
    with pytest.raises(DecodeError):
        codec.receive(bytes(corrupted))


@pytest.mark.parametrize(
    "spec", ["topk:0.2+int2", "topk:0.01+int8", "randomk:0.1+int4", "sign", "int8", "none"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_what_a_receipt_kept_adds_what_the_bytes_decode_to(spec: str, dtype: torch.dtype) -> None:
    """``receive`` keeps the sections it checked: adding them (alone, or among other terms)
    gives the bits of adding the bytes, so a receiver need not decompress a message twice."""
    codec = from_spec(spec)
    gen = torch.Generator().manual_seed(6)
    data = [codec.encode(torch.randn(3, 3001, generator=gen), seed=s) for s in (1, 2)]
    kept = [codec.receive(d) for d in data]
    assert [(k.shape, k.dtype) for k in kept] == [((3, 3001), torch.float32)] * 2
    base = torch.randn(3, 3001, generator=gen).to(dtype)
    by_bytes = codec.decode_add_(data[0], base.clone(), alpha=-0.3, cast=True)
    assert torch.equal(codec.decode_add_(kept[0], base.clone(), alpha=-0.3, cast=True), by_bytes)
    if dtype == torch.float32:
        terms = [(data[0], 0.5), (data[1], -0.25)]
        expected = base.clone()
        assert codec.add_all_(terms, expected) == []
        got = base.clone()
        assert codec.add_all_([(kept[0], 0.5), (kept[1], -0.25)], got) == []
        assert torch.equal(got, expected)


def test_a_receipt_is_added_only_by_its_codec_and_its_indices_are_checked_when_added() -> None:
    codec = from_spec("topk:0.2+int2")
    gen = torch.Generator().manual_seed(7)
    data = [codec.encode(torch.randn(5000, generator=gen), seed=s) for s in (1, 2)]
    kept = [codec.receive(d) for d in data]
    with pytest.raises(DecodeError, match="codec"):
        from_spec("topk:0.2+int4").decode_add_(kept[0], torch.zeros(5000))
    with pytest.raises(DecodeError, match="shape"):
        codec.decode_add_(kept[0], torch.zeros(4999))
    assert kept[0].raw is not None
    no_positions = dataclasses.replace(kept[0], raw=bytes(len(kept[0].raw)))  # count ≠ bits
    out = torch.zeros(5000)
    with pytest.raises(DecodeError):
        codec.decode_add_(no_positions, out)
    assert not out.any()
    failed = codec.add_all_([(no_positions, 1.0), (kept[1], 1.0)], out)
    assert [i for i, _ in failed] == [0]
    assert torch.equal(out, codec.decode(data[1]))


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "int8", "none"])
def test_a_cast_add_rounds_like_adding_then_storing(spec: str) -> None:
    """``decode_add_(cast=True)`` into float16 adds the payload's values rounded to float16,
    the same at every end; without ``cast`` another dtype is refused."""
    codec = from_spec(spec)
    gen = torch.Generator().manual_seed(3)
    data = codec.encode(torch.randn(5000, generator=gen), seed=1)
    copy = torch.randn(5000, generator=gen).half()
    expected = copy + codec.decode(data).half()
    out = codec.decode_add_(data, copy.clone(), cast=True)
    assert out.dtype == torch.float16 and torch.equal(out, expected)
    with pytest.raises(DecodeError, match="dtype"):
        codec.decode_add_(data, copy.clone())


@pytest.mark.parametrize(
    "spec", ["topk:0.1+int8", "topk:0.2+int2", "randomk:0.1+int4", "sign", "int8", "none"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_what_the_encoder_built_adds_what_the_bytes_decode_to(
    spec: str, dtype: torch.dtype
) -> None:
    """``Encoded.add_to_`` (the encoder's own parts, its indices not decoded again) gives the
    bits ``decode_add_`` of the same bytes gives: an error-feedback residual reduced by it
    agrees exactly with what every receiver applies."""
    codec = from_spec(spec)
    gen = torch.Generator().manual_seed(4)
    data, sent = codec.encode_parts(torch.randn(3, 3001, generator=gen), seed=9)
    base = torch.randn(3, 3001, generator=gen).to(dtype)
    by_parts = sent.add_to_(base.clone(), alpha=-0.7)
    by_bytes = codec.decode_add_(data, base.clone(), alpha=-0.7, cast=True)
    assert torch.equal(by_parts, by_bytes)


@pytest.mark.parametrize(
    "spec", ["topk:0.01+int8", "topk:0.2+int2", "randomk:0.1+int4", "sign", "int8", "none"]
)
def test_the_residual_norm_of_what_was_built_is_the_norm_left_after_sending_it(
    spec: str,
) -> None:
    """``Encoded.residual_norm(t)`` is ||t − decode(bytes)||, the norm error feedback keeps,
    without writing ``t``."""
    codec = from_spec(spec)
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(3, 3001, generator=gen) * torch.rand(3, 3001, generator=gen)
    data, sent = codec.encode_parts(t, seed=3)
    before = t.clone()
    left = codec.decode_add_(data, t.clone(), alpha=-1.0)
    expected = float(torch.linalg.vector_norm(left.double()))
    assert sent.residual_norm(t) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert torch.equal(t, before)


@pytest.mark.parametrize(
    "spec",
    ["sign", "int8", "int8:sr", "int2:block=64", "qsgd:4", "fp16", "none", "topk:0.2+int2"],
)
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.float16])
def test_encode_difference_sends_the_bytes_of_the_difference(
    spec: str, b_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``encode_difference(a, b)`` (a dense codec a chunk at a time: CHUNK = 1024, five
    chunks and a part) gives the bytes of ``encode_parts(a − b)``, what it built applies as
    they decode, and the residual is ||(a − b) − decode(bytes)||; with ``fold`` it also adds
    them to ``b``, bit for bit as they decode. (numpy's passes: the fused sign kernel's
    scales sum in another order, test_compression_native.py.)"""
    monkeypatch.setattr("gossipgrad.compression.engine.CHUNK", 1024)
    monkeypatch.setattr(native, "_lib", None)
    codec = from_spec(spec)
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(5500, generator=gen)
    b = (a + torch.randn(5500, generator=gen) * 0.05).to(b_dtype)
    diff = a - b.float()
    for seed in (1, 2):
        data, sent, left = codec.encode_difference(a, b, seed=seed)
        expected, _ = codec.encode_parts(diff, seed=seed)
        assert data == expected
        decoded = codec.decode(data)
        assert left == pytest.approx(float(torch.linalg.vector_norm(diff - decoded)), rel=1e-5)
        assert torch.equal(sent.add_to_(b.clone()), codec.decode_add_(data, b.clone(), cast=True))
        # fold: b += decode(bytes) as it encodes, the same bytes and the same bits.
        folded = b.clone()
        data_f, _, left_f = codec.encode_difference(a, folded, seed=seed, fold=True)
        assert data_f == data and left_f == left
        assert torch.equal(folded, codec.decode_add_(data, b.clone(), cast=True))


@pytest.mark.parametrize("spec", ["sign", "topk:0.2+int2"])
def test_encode_difference_refuses_a_non_finite_difference(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gossipgrad.compression.engine.CHUNK", 1024)
    a, b = torch.randn(5000), torch.randn(5000).half()
    a[4500] = float("inf")  # in the fifth chunk
    with pytest.raises(ValueError, match="NaN or infinite"):
        from_spec(spec).encode_difference(a, b, seed=1)
    with pytest.raises(ValueError, match="shapes differ"):
        from_spec(spec).encode_difference(a, b[:10], seed=1)
    with pytest.raises(ValueError, match="contiguous"):
        from_spec(spec).encode_difference(a[::2], b[::2], seed=1, fold=True)


@pytest.mark.parametrize("spec", ["topk:0.2+int2", "topk:0.05+int2", "topk:0.01", "sign", "none"])
def test_what_the_encoder_built_for_a_difference_adds_what_its_bytes_decode_to(
    spec: str,
) -> None:
    """A sparse codec's ``compress_difference_parts`` gives what it built, which adds the
    bits its bytes decode to, still after the residual moved on (nothing of it is a view of
    the residual); a dense codec, whose values may be one, gives None."""
    codec = from_spec(spec)
    feedback = ErrorFeedback(codec)
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 40_000, generator=gen), torch.randn(3, 40_000, generator=gen)
    data, built = feedback.compress_difference_parts("v", a, b, seed=1)
    if not codec.sparse:
        assert built is None
        return
    feedback.compress_difference_parts("v", b, a, seed=2)  # the residual moves on
    out = torch.randn(3, 40_000, generator=gen)
    expected = codec.decode_add_(data, out.clone(), alpha=-0.25)
    assert torch.equal(built.add_to_(out, alpha=-0.25), expected)
