"""iter_chunks / join_chunks: the transport's view of a payload."""

from __future__ import annotations

import pytest
from gossipgrad.compression import DecodeError, iter_chunks, join_chunks
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(60)


@given(data=st.binary(max_size=5000), size=st.integers(1, 700))
@settings(max_examples=80, deadline=None, derandomize=True)
def test_chunks_round_trip(data: bytes, size: int) -> None:
    chunks = list(iter_chunks(data, size))
    assert all(isinstance(c, memoryview) and 0 < len(c) <= size for c in chunks)
    assert join_chunks(chunks, max_bytes=len(data)) == data


def test_join_stops_before_buffering_past_the_cap() -> None:
    pulled = []

    def stream():
        for i in range(1000):
            pulled.append(i)
            yield b"x" * 100

    with pytest.raises(DecodeError, match="exceeds 250 bytes"):
        join_chunks(stream(), max_bytes=250)
    assert len(pulled) == 3  # stopped at the first chunk over the cap, not at the end


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        list(iter_chunks(b"abc", 0))
    with pytest.raises(ValueError):
        join_chunks([], -1)
    assert join_chunks([], 0) == b""
    assert list(iter_chunks(b"")) == []
