"""Codec behaviour: spec grammar, round trips, per-codec error bounds, decode_add_ semantics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gossipgrad.compression import (
    FP16,
    QSGD,
    REGISTRY,
    Codec,
    DecodeError,
    Identity,
    Int4,
    Int8,
    RandomK,
    Sign,
    TopK,
    from_spec,
)
from gossipgrad.compression.envelope_pb2 import TensorEnvelope
from gossipgrad.compression.sparsifiers import randomk_indices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)

ALL_SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:sr",
    "int4",
    "int4:sr:block=128",
    "qsgd:4",
    "qsgd:127:block=64",
    "sign",
    "sign:block=1024",
    "topk:0.01",
    "topk:0.05:exact",
    "topk:0.01+int8",
    "topk:0.001+int8",
    "topk:0.1+qsgd:8",
    "topk:0.1+sign",
    "randomk:0.01+fp16",
    "randomk:0.25",
    "randomk:0.1+int4:sr",
    "int2",
    "int2:sr:block=256",
    "topk:0.01+int2",
    "topk:0.2+int2",
    "topk:0.3",
    "chunktopk:0.01",
    "chunktopk:0.05:block=256+int8",
    "chunktopk:0.01+int2:sr",
]

FLOATS = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def student_t(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(n, 3, generator=g, dtype=torch.float64).pow(2).sum(1)
    return (normal / (chi2 / 3).sqrt()).to(dtype)


# ----------------------------------------------------------------------------- spec grammar


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_is_canonical_and_round_trips(spec: str) -> None:
    codec = from_spec(spec)
    assert codec.spec == spec
    assert from_spec(codec.spec) == codec
    assert hash(from_spec(spec)) == hash(codec)


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        (" topk : 0.010 + int8 ", "topk:0.01+int8"),
        ("topk:1e-3+int8:block=256", "topk:0.001+int8"),
        ("topk:0.01+none", "topk:0.01"),
        ("int8:block=256:sr", "int8:sr"),
        ("qsgd:16:block=512", "qsgd:16"),
    ],
)
def test_spec_normalises(written: str, canonical: str) -> None:
    assert from_spec(written).spec == canonical


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "empty stage"),
        ("topk", "1 positional"),
        ("topk:0", "ratio must be in (0, 1]"),
        ("topk:1.5", "ratio must be in (0, 1]"),
        ("topk:nan", "ratio must be in (0, 1]"),
        ("topk:abc1", "takes 1 positional"),
        ("topk:1/2", "not a number"),
        ("topk:0.01:fast", "unknown flag 'fast'"),
        ("int8+topk:0.01", "nothing can follow the quantizer"),
        ("fp16+int8", "nothing can follow the quantizer"),
        ("topk:0.01+randomk:0.5", "two sparsifiers"),
        ("topk:0.01+int8+fp16", "at most one sparsifier"),
        ("zip", "unknown codec 'zip'"),
        ("int8:block=100", "power of two"),
        ("int8:block=x", "not an integer"),
        ("qsgd:0", "1..127"),
        ("qsgd:300", "1..127"),
        ("qsgd", "1 positional"),
        ("sign:sr", "unknown flag 'sr'"),
        ("topk:0.01++int8", "empty stage"),
        ("none:3", "0 positional"),
    ],
)
def test_bad_spec_names_problem_and_valid_forms(spec: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        from_spec(spec)
    msg = str(info.value)
    assert problem in msg
    assert "Valid forms" in msg and "topk:RATIO" in msg and "int8" in msg


def test_non_string_spec_rejected() -> None:
    with pytest.raises(ValueError, match="must be a str"):
        from_spec(0.01)  # type: ignore[arg-type]


def test_composition_operator_matches_spec() -> None:
    assert TopK(0.01) >> Int8() == from_spec("topk:0.01+int8")
    assert (RandomK(0.01) >> FP16()).spec == "randomk:0.01+fp16"
    assert TopK(0.01) >> Identity() == TopK(0.01)
    with pytest.raises(ValueError, match="nothing can follow"):
        Int8() >> TopK(0.1)
    with pytest.raises(ValueError, match="at most one sparsifier"):
        (TopK(0.1) >> Int8()) >> Sign()
    with pytest.raises(ValueError, match="two sparsifiers"):
        TopK(0.1) >> RandomK(0.5)


def test_registry_is_the_single_list_of_codecs() -> None:
    assert set(REGISTRY) == {
        "none", "fp16", "bf16", "int8", "int4", "int2", "qsgd", "sign", "topk", "chunktopk",
        "randomk",
    }  # fmt: skip
    for name, cls in REGISTRY.items():
        assert cls.name == name and cls.grammar.startswith(name)
        assert issubclass(cls, Codec)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 3), (3000, 17)])
def test_decode_shape_dtype_and_decode_add_agree(spec: str, shape: tuple[int, ...]) -> None:
    codec = from_spec(spec)
    x = student_t(math.prod(shape), seed=3).reshape(shape)
    data = codec.encode(x, seed=11)
    y = codec.decode(data)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "cpu"
    assert torch.isfinite(y).all()
    base = student_t(math.prod(shape), seed=4).reshape(shape)
    out = base.clone()
    assert codec.decode_add_(data, out) is out
    # decode_add_ of sparse codecs touches only kept entries; the sum equals dense addition.
    assert torch.equal(out, base + y)
    again = base.clone()
    codec.decode_add_(data, again)
    assert torch.equal(again, out)  # deterministic, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_none_is_lossless_for_every_dtype(dtype: torch.dtype) -> None:
    x = student_t(10_001, seed=5, dtype=dtype).reshape(73, 137)
    codec = from_spec("none")
    y = codec.decode(codec.encode(x))
    assert y.dtype == dtype and torch.equal(x, y)


@given(st.lists(FLOATS, min_size=0, max_size=300))
@SETTINGS
def test_none_round_trip_law(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codec = from_spec("none")
    assert torch.equal(codec.decode(codec.encode(x)), x)


@given(st.lists(st.floats(width=16, allow_nan=False, allow_infinity=False), max_size=300))
@SETTINGS
def test_fp16_lossless_on_fp16_representable_input(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float16).float()
    codec = from_spec("fp16")
    assert torch.equal(codec.decode(codec.encode(x)), x)


# ----------------------------------------------------------------------------- error bounds


def _blocks_of(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    return list(x.reshape(-1).split(block))


VECTORS = st.lists(FLOATS, min_size=1, max_size=700).map(lambda v: torch.tensor(v))


@given(VECTORS, st.integers(0, 2**32))
@SETTINGS
def test_fp16_bf16_relative_error(x: torch.Tensor, seed: int) -> None:
    for spec, rel, tiny in (("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 2.0**-133)):
        codec = from_spec(spec)
        d = codec.decode(codec.encode(x, seed=seed))
        bound = torch.clamp(x.abs() * rel, min=tiny)
        assert bool(((x - d).abs() <= bound).all()), spec


@pytest.mark.parametrize(
    ("spec", "qmax", "factor"),
    [("int8", 127, 0.5), ("int8:sr", 127, 1.0), ("int4", 7, 0.5), ("int4:sr:block=128", 7, 1.0)],
)
@given(x=VECTORS, seed=st.integers(0, 2**32))
@SETTINGS
def test_blockwise_int_error_bound(spec: str, qmax: int, factor: float, x, seed: int) -> None:
    codec = from_spec(spec)
    _, q = codec.stages()
    d = codec.decode(codec.encode(x, seed=seed))
    for xb, db in zip(_blocks_of(x, q.block), _blocks_of(d, q.block), strict=True):
        scale = float(xb.abs().max()) / qmax
        err = float((xb - db).abs().max())
        assert err <= factor * scale * (1 + 1e-5) + 1e-30, (spec, err, scale)


@pytest.mark.parametrize("levels", [1, 4, 127])
@given(x=VECTORS, seed=st.integers(0, 2**32))
@SETTINGS
def test_qsgd_error_below_one_level(levels: int, x, seed: int) -> None:
    codec = QSGD(levels, block=64)
    d = codec.decode(codec.encode(x, seed=seed))
    for xb, db in zip(_blocks_of(x, 64), _blocks_of(d, 64), strict=True):
        step = float(xb.double().norm()) / levels
        assert float((xb - db).abs().max()) <= step * (1 + 1e-5) + 1e-30


@given(x=VECTORS, seed=st.integers(0, 2**32))
@SETTINGS
def test_sign_is_contractive_per_block(x: torch.Tensor, seed: int) -> None:
    codec = Sign(block=32)
    d = codec.decode(codec.encode(x, seed=seed))
    for xb, db in zip(_blocks_of(x, 32), _blocks_of(d, 32), strict=True):
        xb64, db64 = xb.double(), db.double()
        assert float((xb64 - db64).pow(2).sum()) <= float(xb64.pow(2).sum()) * (1 + 1e-5) + 1e-30
        assert float((xb64 - db64).abs().max()) <= float(xb64.abs().max()) * (1 + 1e-5)
        assert bool(((db >= 0) == (xb >= 0)).all())


def test_qsgd_and_int8_sr_are_unbiased() -> None:
    x = student_t(512, seed=7)
    for codec in (QSGD(2), Int8(sr=True, block=512), Int4(sr=True, block=512)):
        mean = torch.stack([codec.decode(codec.encode(x, seed=s)) for s in range(400)]).mean(0)
        _, q = codec.stages()
        step = float(x.norm()) / 2 if isinstance(q, QSGD) else float(x.abs().max()) / q.qmax
        # Averaging 400 draws shrinks the error of an unbiased rounding ~20x below one step.
        assert float((mean - x).abs().max()) < 0.25 * step


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
@given(x=VECTORS, seed=st.integers(0, 2**32))
@SETTINGS
def test_sparsifier_bounds(ratio: float, x: torch.Tensor, seed: int) -> None:
    """top-k is a k/n-contraction (Stich et al., NeurIPS 2018): ||x - C(x)||^2 <= (1 - k/n)
    ||x||^2; random-k keeps exact values and zeros the rest; with int8 on top, each kept entry
    is within half a quantization step of its block's scale."""
    n = x.numel()
    k = min(n, max(1, round(ratio * n)))
    x64 = x.double()
    d = from_spec(f"topk:{ratio}").decode(from_spec(f"topk:{ratio}").encode(x, seed=seed))
    assert float((x64 - d.double()).pow(2).sum()) <= (1 - k / n) * float(x64.pow(2).sum()) * (
        1 + 1e-9
    )
    r = from_spec(f"randomk:{ratio}").decode(from_spec(f"randomk:{ratio}").encode(x, seed=seed))
    kept = r != 0
    assert torch.equal(r[kept], x[kept]) and int((r != 0).sum()) <= k
    codec = from_spec(f"topk:{ratio}+int8:block=8")
    q = codec.decode(codec.encode(x, seed=seed))
    idx = TopK(ratio).select(x, seed)  # the selection encode made (int8 blocks follow it)
    vals, qv = x[idx], q[idx]
    for vb, qb in zip(vals.split(8), qv.split(8), strict=True):
        step = float(vb.abs().max()) / 127
        assert float((vb - qb).abs().max()) <= 0.5 * step * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.01:exact", "topk:0.2+int8"])
def test_topk_keeps_largest_magnitudes(spec: str) -> None:
    x = student_t(200_000, seed=8)
    codec = from_spec(spec)
    d = codec.decode(codec.encode(x, seed=1))
    kept = d.ne(0)
    k = round(codec.stages()[0].ratio * x.numel())
    assert 0.95 * k <= int(kept.sum()) <= k
    # every kept magnitude is at least every dropped one
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())
    if codec.stages()[1].lossless:
        assert torch.equal(d[kept], x[kept])


def test_randomk_sends_no_indices_and_is_reproducible() -> None:
    x = student_t(100_000, seed=9)
    codec = from_spec("randomk:0.01")
    data = codec.encode(x, seed=42)
    env = TensorEnvelope.FromString(data)
    # 1000 fp32 values (maybe zstd-shrunk) plus a small header; no index stream.
    assert env.values.raw_size == 4000 and env.indices.raw_size == 0 and len(data) < 4200
    d = codec.decode(data)
    idx = torch.from_numpy(randomk_indices(x.numel(), 1000, 42))
    assert torch.equal(d.nonzero().reshape(-1), idx[x[idx] != 0])
    assert torch.equal(d[idx], x[idx])
    assert codec.encode(x, seed=42) == data
    assert not torch.equal(codec.decode(codec.encode(x, seed=43)).ne(0), d.ne(0))


def test_randomk_indices_are_stratified_and_pure() -> None:
    idx = randomk_indices(1_000_003, 1000, seed=5)
    assert idx.shape == (1000,) and np.all(np.diff(idx) > 0)
    assert idx[0] >= 0 and idx[-1] < 1_000_003
    strata = (np.arange(1001) * 1_000_003) // 1000
    assert np.all((idx >= strata[:-1]) & (idx < strata[1:]))
    assert np.array_equal(idx, randomk_indices(1_000_003, 1000, seed=5))
    assert randomk_indices(10, 10, seed=1).tolist() == list(range(10))


def test_seed_none_uses_torch_default_generator() -> None:
    x = student_t(4096, seed=10)
    codec = from_spec("randomk:0.1+int8:sr")
    torch.manual_seed(123)
    a = codec.encode(x)
    torch.manual_seed(123)
    assert codec.encode(x) == a


# ----------------------------------------------------------------------------- wire size


@pytest.mark.parametrize(("spec", "limit"), [("topk:0.01+int8", 0.024), ("topk:0.001+int8", 0.003)])
def test_wire_bytes_per_element_targets(spec: str, limit: float) -> None:
    x = student_t(2_000_000, seed=12)
    data = from_spec(spec).encode(x, seed=1)
    assert len(data) / x.numel() <= limit


def test_zstd_spent_where_it_pays() -> None:
    env = TensorEnvelope.FromString(from_spec("int8").encode(torch.zeros(100_000)))
    # a constant small payload compresses to almost nothing
    assert env.values.storage == TensorEnvelope.ZSTD and len(env.values.data) < 200


# ----------------------------------------------------------------------------- decode_add_


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "int8", "none"])
def test_decode_add_rejects_shape_and_dtype_mismatch(spec: str) -> None:
    codec = from_spec(spec)
    data = codec.encode(student_t(600, seed=13).reshape(20, 30))
    before = torch.ones(30, 20)
    with pytest.raises(DecodeError, match="shape"):
        codec.decode_add_(data, before)
    assert torch.equal(before, torch.ones(30, 20))
    with pytest.raises(DecodeError, match="dtype"):
        codec.decode_add_(data, torch.zeros(20, 30, dtype=torch.float64))
    with pytest.raises(DecodeError, match="written by codec"):
        from_spec("fp16").decode_add_(data, torch.zeros(20, 30))


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "int4"])
def test_decode_add_non_contiguous_out_and_alpha(spec: str) -> None:
    codec = from_spec(spec)
    x = student_t(600, seed=14).reshape(20, 30)
    data = codec.encode(x)
    d = codec.decode(data)
    out = torch.zeros(30, 20).t()
    codec.decode_add_(data, out)
    assert torch.equal(out, d)
    codec.decode_add_(data, out, alpha=-1.0)
    assert torch.equal(out, torch.zeros(20, 30))


def test_decode_add_matches_sender_and_receiver_over_many_rounds() -> None:
    # CHOCO-SGD's invariant: two copies updated with the same bytes stay bit-identical.
    codec = from_spec("topk:0.05+int8")
    x = student_t(50_000, seed=15)
    sender = torch.zeros_like(x)
    receiver = torch.zeros_like(x)
    for r in range(20):
        data = codec.encode(x - sender, seed=r)
        codec.decode_add_(data, sender)
        codec.decode_add_(bytes(bytearray(data)), receiver)
    assert torch.equal(sender, receiver)
    assert float((x - sender).norm()) < 0.5 * float(x.norm())


def test_encode_rejects_bad_inputs() -> None:
    codec = from_spec("topk:0.1+int8")
    with pytest.raises(ValueError, match="NaN or infinite"):
        codec.encode(torch.tensor([1.0, float("nan"), 2.0]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        from_spec("none").encode(torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="dtype"):
        codec.encode(torch.arange(10))
    with pytest.raises(ValueError, match="seed"):
        codec.encode(torch.ones(10), seed=-1)


def test_fp16_saturates_instead_of_overflowing() -> None:
    codec = from_spec("fp16")
    d = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 3.0])))
    assert d.tolist() == [65504.0, -65504.0, 3.0]


def test_decode_to_other_device_string() -> None:
    codec = from_spec("int8")
    x = student_t(1000, seed=16)
    assert torch.equal(codec.decode(codec.encode(x), device="cpu"), codec.decode(codec.encode(x)))


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_torch_code_paths_match_numpy_paths(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-CPU devices run torch ops where CPU runs numpy; force them on CPU and compare."""
    from gossipgrad.compression import bitpack

    codec = from_spec(spec)
    x = student_t(300_000, seed=17).reshape(600, 500)
    numpy_bytes = codec.encode(x, seed=3)
    monkeypatch.setattr(bitpack, "FORCE_TORCH", True)
    torch_bytes = codec.encode(x, seed=3)
    assert torch_bytes == numpy_bytes
    y = codec.decode(numpy_bytes)
    out = torch.ones_like(x)
    codec.decode_add_(numpy_bytes, out)
    monkeypatch.setattr(bitpack, "FORCE_TORCH", False)
    assert torch.equal(y, codec.decode(numpy_bytes))
    assert torch.equal(out, codec.decode_add_(numpy_bytes, torch.ones_like(x)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_cuda_round_trip_and_cross_device_decode(spec: str) -> None:
    codec = from_spec(spec)
    x = student_t(300_000, seed=18).reshape(600, 500)
    data = codec.encode(x.cuda(), seed=3)
    y = codec.decode(data, device="cuda")
    assert y.is_cuda and y.shape == x.shape
    # bytes written on the GPU decode identically on the CPU
    assert torch.equal(y.cpu(), codec.decode(data))
    a, b = torch.ones_like(x).cuda(), torch.ones_like(x).cuda()
    codec.decode_add_(data, a)
    codec.decode_add_(data, b)
    assert torch.equal(a, b) and torch.equal(a.cpu(), codec.decode_add_(data, torch.ones_like(x)))
    if not codec.stages()[1].stochastic and spec not in ("sign", "sign:block=1024"):
        assert codec.decode(codec.encode(x, seed=3)).allclose(y.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "int8", "randomk:0.1"])
def test_decode_into_out_overwrites(spec: str) -> None:
    codec = from_spec(spec)
    x = student_t(6000, seed=19).reshape(60, 100)
    data = codec.encode(x, seed=2)
    out = torch.full((60, 100), 7.0)
    assert codec.decode(data, out=out) is out
    assert torch.equal(out, codec.decode(data))
    with pytest.raises(DecodeError, match="!= out"):
        codec.decode(data, out=torch.zeros(100, 60))
    with pytest.raises(DecodeError, match="contiguous"):
        codec.decode(data, out=torch.zeros(100, 60).t())


@pytest.mark.parametrize("spec", ["none", "topk:0.01+int8", "randomk:0.1+fp16", "int4"])
def test_payload_is_a_plain_protobuf_message(spec: str) -> None:
    """encode() frames section payloads after a protobuf-serialized header (one copy instead of
    three); any protobuf implementation reads the same message, and its canonical
    re-serialization decodes to the same tensor."""
    codec = from_spec(spec)
    x = student_t(200_000, seed=20)
    data = codec.encode(x, seed=4)
    env = TensorEnvelope.FromString(data)
    assert env.codec_spec == spec and list(env.shape) == [200_000]
    assert env.values.raw_size == codec.stages()[1].value_bytes(env.count, torch.float32)
    canonical = env.SerializeToString()
    assert torch.equal(codec.decode(canonical), codec.decode(data))
