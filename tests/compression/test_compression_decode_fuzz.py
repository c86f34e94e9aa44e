"""The decoder never trusts its input: mutated real payloads raise DecodeError or decode to
exactly the original tensor -- never a crash, a huge allocation or a silently wrong tensor."""

from __future__ import annotations

import struct

import pytest
import torch
from gossipgrad.compression import DecodeError, from_spec
from gossipgrad.compression.envelope_pb2 import TensorEnvelope
from gossipgrad.compression.wire import _header_crc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(240)

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int4:sr",
    "qsgd:5",
    "sign",
    "topk:0.05",
    "topk:0.02+int8",
    "topk:0.1+qsgd:3",
    "randomk:0.1+fp16",
    "int2",
    "topk:0.05+int2",
    "topk:0.2+int2",
    "chunktopk:0.05:block=64",
    "chunktopk:0.1:block=256+int2:sr",
]
SHAPE = (37, 29)
MAX_NUMEL = 10_000


def _payloads() -> dict[str, tuple[bytes, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g) * 3
    x[0, :5] = torch.tensor([0.0, 1e-3, -7.0, 1e3, -2e3])
    out = {}
    for spec in SPECS:
        codec = from_spec(spec)
        data = codec.encode(x, seed=5)
        out[spec] = (data, codec.decode(data))
    return out


PAYLOADS = _payloads()
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _check(spec: str, mutated: bytes) -> None:
    """Decode must raise DecodeError or give back exactly the original tensor."""
    codec = from_spec(spec)
    _, original = PAYLOADS[spec]
    try:
        got = codec.decode(mutated, max_numel=MAX_NUMEL)
    except DecodeError:
        pass
    else:
        assert got.shape == original.shape and torch.equal(got, original)
    out = torch.full(SHAPE, 0.5)
    try:
        codec.decode_add_(mutated, out)
    except DecodeError:
        assert torch.equal(out, torch.full(SHAPE, 0.5))  # untouched on error
    else:
        assert torch.equal(out, torch.full(SHAPE, 0.5) + original)


@pytest.mark.parametrize("spec", SPECS)
@given(data=st.data())
@FUZZ
def test_bit_flips(spec: str, data: st.DataObject) -> None:
    raw = bytearray(PAYLOADS[spec][0])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    _check(spec, bytes(raw))


@pytest.mark.parametrize("spec", SPECS)
@given(data=st.data())
@FUZZ
def test_truncation_and_extension(spec: str, data: st.DataObject) -> None:
    raw = PAYLOADS[spec][0]
    cut = data.draw(st.integers(0, len(raw) - 1))
    _check(spec, raw[:cut])
    tail = data.draw(st.binary(min_size=1, max_size=64))
    _check(spec, raw + tail)
    pos = data.draw(st.integers(0, len(raw)))
    _check(spec, raw[:pos] + tail + raw[pos:])


@pytest.mark.parametrize("spec", SPECS)
@given(garbage=st.binary(max_size=2000))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_garbage(spec: str, garbage: bytes) -> None:
    _check(spec, garbage)


# ----------------------------------------------------------------------------- field edits

FIELDS = ["shape", "dtype", "count", "index_bits", "seed", "format_version", "codec_spec"]
SECTION_FIELDS = ["storage", "raw_size", "data"]


def _resign(env: TensorEnvelope) -> bytes:
    env.crc32 = _header_crc(env)
    return env.SerializeToString()


@pytest.mark.parametrize("spec", SPECS)
@given(data=st.data(), resign=st.booleans())
@FUZZ
def test_field_edits(spec: str, data: st.DataObject, resign: bool) -> None:
    """Edit one header field. Unsigned edits must fail the CRC; re-signed ones (what a buggy
    or hostile encoder could send) must still raise DecodeError or yield a finite tensor of the
    declared shape, within the limits -- never crash."""
    env = TensorEnvelope.FromString(PAYLOADS[spec][0])
    field = data.draw(st.sampled_from(FIELDS + [f"sec.{f}" for f in SECTION_FIELDS]))
    big = st.integers(0, 2**64 - 1)
    small = st.integers(0, 3000)
    if field == "shape":
        dims = data.draw(st.lists(st.one_of(small, big), max_size=4))
        del env.shape[:]
        env.shape.extend(dims)
    elif field == "dtype":
        env.dtype = data.draw(st.integers(0, 9))
    elif field in ("count", "seed"):
        setattr(env, field, data.draw(st.one_of(small, big)))
    elif field in ("index_bits", "format_version"):
        setattr(env, field, data.draw(st.integers(0, 2**32 - 1)))
    elif field == "codec_spec":
        env.codec_spec = data.draw(st.sampled_from([*SPECS, "", "topk:0.05:exact", "int8:sr"]))
    else:
        sec = getattr(env, data.draw(st.sampled_from(["indices", "values", "scales"])))
        name = field.split(".")[1]
        if name == "storage":
            sec.storage = data.draw(st.integers(0, 5))
        elif name == "raw_size":
            sec.raw_size = data.draw(st.one_of(small, big))
        else:
            blob = bytearray(sec.data)
            if blob:
                pos = data.draw(st.integers(0, len(blob) - 1))
                blob[pos] = data.draw(st.integers(0, 255))
            else:
                blob = bytearray(data.draw(st.binary(min_size=1, max_size=16)))
            sec.data = bytes(blob)
    mutated = _resign(env) if resign else env.SerializeToString()
    if not resign:
        _check(spec, mutated)
        return
    codec = from_spec(spec)
    try:
        got = codec.decode(mutated, max_numel=MAX_NUMEL)
    except DecodeError:
        return
    assert got.numel() <= MAX_NUMEL and torch.isfinite(got).all()
    assert tuple(got.shape) == tuple(env.shape)


# ----------------------------------------------------------------------------- targeted


def _edit(spec: str, fn) -> bytes:
    env = TensorEnvelope.FromString(PAYLOADS[spec][0])
    fn(env)
    return _resign(env)


def _raises(spec: str, data: bytes, match: str, max_numel: int | None = MAX_NUMEL) -> None:
    with pytest.raises(DecodeError, match=match):
        from_spec(spec).decode(data, max_numel=max_numel)


def test_huge_declared_shape_is_rejected_before_allocating() -> None:
    def grow(env: TensorEnvelope) -> None:
        del env.shape[:]
        env.shape.extend([1 << 40, 1 << 20])

    data = _edit("topk:0.05", grow)
    _raises("topk:0.05", data, "over the limit")
    _raises("topk:0.05", data, "over the limit", max_numel=None)


def test_section_size_lies_are_rejected() -> None:
    def lie(env: TensorEnvelope) -> None:
        env.values.raw_size += 1

    _raises("int8", _edit("int8", lie), "the codec needs")

    def bomb(env: TensorEnvelope) -> None:
        env.indices.raw_size = 1 << 40

    _raises("topk:0.05", _edit("topk:0.05", bomb), "at most")


def test_out_of_range_index_is_rejected() -> None:
    # Re-encode the index stream of a valid payload for a smaller tensor.
    def shrink(env: TensorEnvelope) -> None:
        del env.shape[:]
        env.shape.extend([37, 28])

    _raises("topk:0.05", _edit("topk:0.05", shrink), "out of range|keeps")


def test_non_finite_values_and_scales_are_rejected() -> None:
    def nan_value(env: TensorEnvelope) -> None:
        env.values.storage = TensorEnvelope.RAW
        raw = bytearray(torch.zeros(37 * 29, dtype=torch.float16).view(torch.uint8).numpy())
        raw[0:2] = struct.pack("<e", float("inf"))
        env.values.data = bytes(raw)
        env.values.raw_size = len(raw)

    _raises("fp16", _edit("fp16", nan_value), "non-finite")

    def bad_scale(env: TensorEnvelope) -> None:
        nscales = env.scales.raw_size // 4
        env.scales.storage = TensorEnvelope.RAW
        env.scales.data = struct.pack("<f", float("nan")) + bytes(4 * (nscales - 1))

    _raises("int8", _edit("int8", bad_scale), "scales")

    def negative_scale(env: TensorEnvelope) -> None:
        nscales = env.scales.raw_size // 4
        env.scales.storage = TensorEnvelope.RAW
        env.scales.data = struct.pack("<f", -1.0) + bytes(4 * (nscales - 1))

    _raises("int8", _edit("int8", negative_scale), "scales")


def test_wrong_dtype_and_codec_are_rejected() -> None:
    data = PAYLOADS["int8"][0]
    _raises("fp16", data, "written by codec")

    def wrong_dtype(env: TensorEnvelope) -> None:
        env.dtype = 17

    _raises("int8", _edit("int8", wrong_dtype), "dtype")
    with pytest.raises(DecodeError, match="expected bytes"):
        from_spec("int8").decode("not bytes")  # type: ignore[arg-type]


def test_many_tiny_fields_are_rejected_early() -> None:
    # 3 MB of valid 2-byte unknown varint fields (field 15): the scan stops after a few hundred
    # fields instead of walking millions in Python.
    data = PAYLOADS["int8"][0] + bytes([15 << 3, 1]) * 1_500_000
    _raises("int8", data, "more than 256 fields")
