"""Chunk framing laws (fast path == protobuf encoding, send/reassemble round trip, wire-byte
count, checks before allocation) and the receive buffer pool."""

from __future__ import annotations

import random

import numpy as np
import pytest
from gossipgrad.compression.varint import encode_varint as varint
from gossipgrad.peer.network.buffers import BufferPool
from gossipgrad.peer.network.framing import (
    ChunkCodec,
    FrameError,
    Malformed,
    WireTally,
    data_chunk_wire_bytes,
    frames,
    read_header,
    receive_payload,
    stream_wire_bytes,
)
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


def _over_the_wire(codec: ChunkCodec, items) -> list:
    """What a receiver's iterator yields for ``items``: each encoded, then decoded."""
    return [codec.decode(codec.encode(item)) for item in items]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(CODECS))
@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.binary(max_size=5000), chunk=st.integers(1, 700))
def test_frames_reassemble_to_the_payload_and_count_their_wire_bytes(kind, data, chunk):
    codec, _, header_cls = CODECS[kind]
    header = header_cls(payload_size=len(data))
    head = codec.header_bytes(header)
    tally = WireTally()
    sent = list(frames(head, memoryview(data), chunk, tally))
    assert len(sent) == 1 + -(-len(data) // chunk)
    # The tally is exactly what goes on the wire: serialized chunks plus 5 bytes of framing.
    assert tally.bytes == sum(len(codec.encode(item)) + 5 for item in sent)
    assert tally.bytes == stream_wire_bytes(len(head), len(data), chunk)
    chunks = iter(_over_the_wire(codec, sent))
    assert read_header(chunks, codec) == header
    buf, wire = receive_payload(chunks, len(data), limit=len(data))
    assert bytes(buf) == data
    assert wire + len(head) + 5 == tally.bytes


def test_declared_size_over_the_cap_is_refused_before_allocating():
    allocated: list[int] = []

    def allocate(n: int) -> bytearray:
        allocated.append(n)
        return bytearray(n)

    with pytest.raises(FrameError) as info:
        receive_payload(iter([]), 1 << 60, limit=1 << 20, allocate=allocate, what="state")
    assert info.value.reason == "too_large" and "state of" in info.value.why
    assert allocated == []


@pytest.mark.parametrize(
    ("parts", "why"),
    [
        ([b"abc"], "3 bytes"),
        ([b"abcdef", b"gh"], "longer"),
        ([b"abc", pb.UpdateHeader()], "second header"),
        ([Malformed("bad chunk")], "bad chunk"),
    ],
    ids=["short", "long", "second-header", "undecodable"],
)
def test_streams_that_do_not_add_up_are_malformed_and_the_buffer_goes_back(parts, why):
    released: list[bytearray] = []
    items = [memoryview(p) if isinstance(p, bytes) else p for p in parts]
    with pytest.raises(FrameError) as info:
        receive_payload(iter(items), 6, limit=100, release=released.append)
    assert info.value.reason == "malformed" and why in info.value.why
    assert len(released) == 1 and len(released[0]) == 6


@pytest.mark.parametrize(
    ("first", "why"),
    [
        (None, "empty stream"),
        (memoryview(b"x"), "not an UpdateHeader"),
        (Malformed("undecodable chunk"), "undecodable"),
        (pb.StateHeader(), "not an UpdateHeader"),
    ],
)
def test_a_stream_must_start_with_its_header(first, why):
    codec = CODECS["update"][0]
    with pytest.raises(FrameError) as info:
        read_header(iter([] if first is None else [first]), codec)
    assert info.value.reason == "malformed" and why in info.value.why


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


@pytest.mark.timeout(60)
def test_a_declared_size_alone_pins_no_big_buffer():
    """Issue 40: a header declaring a size under the cap got a zeroed buffer of that size
    before any byte came (a hostile pusher, or a donor, could pin 1 GiB per call). The
    buffer now starts at EAGER_BYTES and grows with the bytes that arrive."""
    from gossipgrad.peer.network.framing import EAGER_BYTES

    allocated: list[int] = []

    def allocate(n: int) -> bytearray:
        allocated.append(n)
        return bytearray(min(n, 2 * EAGER_BYTES))  # never really 1 GiB, even on old code

    with pytest.raises(FrameError) as info:
        receive_payload(iter([memoryview(b"ab")]), 1 << 30, limit=1 << 31, allocate=allocate)
    assert info.value.reason == "malformed"
    assert max(allocated) <= EAGER_BYTES, allocated


@pytest.mark.timeout(60)
def test_a_buffer_grown_as_bytes_arrive_holds_them_all_and_hands_back_the_outgrown_ones():
    rng = random.Random(40)
    data = bytes(rng.randrange(256) for _ in range(1000))
    parts = [memoryview(data[i : i + 70]) for i in range(0, len(data), 70)]
    released: list[int] = []
    buf, wire = receive_payload(
        iter(parts), len(data), limit=len(data), release=lambda b: released.append(len(b)),
        eager=16,
    )  # fmt: skip
    assert bytes(buf) == data and len(buf) == len(data)
    assert released == [16, 70, 140, 280, 560]  # each outgrown buffer, none kept twice
    assert wire == sum(data_chunk_wire_bytes(p.nbytes) for p in parts)
