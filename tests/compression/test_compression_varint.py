"""The one varint codec of gossipgrad.compression agrees with protobuf's and rejects bad input."""

from __future__ import annotations

import pytest
from google.protobuf.internal.encoder import _VarintBytes
from gossipgrad.compression import DecodeError
from gossipgrad.compression.varint import MAX_VARINT_BYTES, encode_varint, read_varint
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(60)

U64 = st.integers(0, (1 << 64) - 1)


@given(n=U64, prefix=st.binary(max_size=5), suffix=st.binary(max_size=5))
@settings(max_examples=300, deadline=None, derandomize=True)
def test_round_trip_matches_protobuf(n: int, prefix: bytes, suffix: bytes) -> None:
    enc = encode_varint(n)
    assert enc == _VarintBytes(n)
    buf = prefix + enc + suffix
    assert read_varint(buf, len(prefix), len(buf)) == (n, len(prefix) + len(enc))


@given(n=st.integers(1 << 7, (1 << 64) - 1))
@settings(max_examples=100, deadline=None, derandomize=True)
def test_truncated_varint_is_rejected(n: int) -> None:
    enc = encode_varint(n)
    with pytest.raises(DecodeError, match="truncated"):
        read_varint(enc, 0, len(enc) - 1)  # the end bound is honoured even with bytes beyond


def test_overlong_varint_is_rejected() -> None:
    buf = b"\x80" * MAX_VARINT_BYTES + b"\x00"
    with pytest.raises(DecodeError, match="longer than 10"):
        read_varint(buf, 0, len(buf))
    assert read_varint(b"\xff" * 9 + b"\x01", 0, 10) == ((1 << 64) - 1, 10)


@pytest.mark.parametrize("n", [-1, 1 << 64])
def test_out_of_range_values_are_refused(n: int) -> None:
    with pytest.raises(ValueError, match="2\\*\\*64"):
        encode_varint(n)
