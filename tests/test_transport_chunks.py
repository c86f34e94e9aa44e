"""Chunk framing laws (fast path == protobuf encoding) and the receive buffer pool."""

from __future__ import annotations

import numpy as np
import pytest
from gossipgrad.peer.network.buffers import BufferPool
from gossipgrad.peer.network.framing import ChunkCodec, Malformed, varint
from gossipgrad.proto import gossip_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

CODECS = {"update": (ChunkCodec(pb.UpdateChunk), pb.UpdateChunk, pb.UpdateHeader)}
CODECS["state"] = (ChunkCodec(pb.StateChunk), pb.StateChunk, pb.StateHeader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(CODECS))
@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.binary(max_size=3000))
def test_data_chunk_encoding_is_the_protobuf_encoding(kind, data):
    codec, chunk_cls, _ = CODECS[kind]
    wire = codec.encode(memoryview(data))
    assert wire == chunk_cls(data=data).SerializeToString()
    back = codec.decode(wire)
    assert isinstance(back, memoryview) and bytes(back) == data


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    sender=st.text(max_size=20),
    seq=st.integers(0, 2**64 - 1),
    size=st.integers(0, 2**64 - 1),
)
def test_header_chunk_round_trip(sender, seq, size):
    codec, _, header_cls = CODECS["update"]
    header = header_cls(sender=sender, seq=seq, payload_size=size)
    back = codec.decode(codec.encode(header))
    assert back == header


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=64))
def test_decode_never_raises_and_agrees_with_protobuf(raw):
    codec, chunk_cls, header_cls = CODECS["update"]
    got = codec.decode(raw)
    try:
        ref = chunk_cls.FromString(raw)
    except Exception:
        assert isinstance(got, Malformed)
        return
    which = ref.WhichOneof("part")
    if which == "data":
        assert isinstance(got, memoryview) and bytes(got) == ref.data
    elif which == "header":
        assert isinstance(got, header_cls) and got == ref.header
    else:
        assert isinstance(got, Malformed)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 2**32, 2**64 - 1])
def test_varint_matches_protobuf(n):
    # A header with only payload_size (field 8) serializes as tag 0x40 + varint(n).
    expected = pb.UpdateHeader(payload_size=n).SerializeToString()
    assert (b"\x40" + varint(n) if n else b"") == expected


def test_pool_reuses_free_buffers_smallest_fit_first():
    pool = BufferPool(max_bytes=64 << 20)
    a = pool.acquire(3 << 20)
    b = pool.acquire(5 << 20)
    assert len(a) == 3 << 20 and len(b) == 5 << 20
    a_id, b_id = id(a), id(b)
    assert pool.release(a) and pool.release(b)
    del a, b
    c = pool.acquire(2 << 20)
    assert id(c) == a_id  # smallest buffer that fits
    d = pool.acquire(4 << 20)
    assert id(d) == b_id
    assert pool.idle_bytes == 0


def test_pool_never_reuses_a_buffer_someone_still_references():
    pool = BufferPool(max_bytes=64 << 20)
    buf = pool.acquire(1 << 20)
    view = memoryview(buf)[:10].toreadonly()
    arr = np.frombuffer(memoryview(buf), dtype=np.uint8)
    assert not pool.release(buf)
    del view
    assert not pool.release(buf)  # the numpy array still shares the memory
    del arr
    assert pool.release(buf)


def test_pool_respects_its_byte_budget():
    pool = BufferPool(max_bytes=3 << 20)
    bufs = [pool.acquire(1 << 20) for _ in range(5)]
    kept = 0
    while bufs:
        buf = bufs.pop()
        kept += pool.release(buf)
    assert kept == 5  # each was free when offered ...
    assert pool.idle_bytes == 3 << 20  # ... but only the budget's worth stays idle
    off = BufferPool(max_bytes=0)
    x = off.acquire(100)
    assert len(x) == 100 and not off.release(x)
