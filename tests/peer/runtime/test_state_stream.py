"""The streamed state format: what a donor writes piece by piece reads back bit for bit,
chunked any way, and a stream that does not add up is refused before a tensor is made."""

from __future__ import annotations

import io
import struct

import pytest
import torch
from gossipgrad.peer.network.framing import rechunk
from gossipgrad.peer.runtime.state_stream import MAGIC, StateReader, StateWriter, host_copy

pytestmark = pytest.mark.timeout(60)


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    params = torch.randn(100_003, generator=g)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(7, 5, generator=g))])
    opt.param_groups[0]["params"][0].grad = torch.ones(7, 5)
    opt.step()
    return {
        "params": params,
        "buffers": {"bn.running_mean": torch.arange(4.0), "empty": torch.empty(0, 3)},
        "optimizer": opt.state_dict(),
        "local_step": 12,
        "round": 3,
        "fingerprint": "abc",
        "gossip": {"anchor": torch.randn(9, generator=g).half(), "phase": 2, "t": (1, "x")},
        "counts": torch.tensor([1, 2, 3], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "bf": torch.randn(3, generator=g).to(torch.bfloat16),
    }


def read(writer: StateWriter, chunk: int) -> dict:
    reader = StateReader(writer.size)
    for part in rechunk(writer.pieces(), chunk, writer.size):
        assert reader.write(memoryview(bytes(part))) is None
    return reader.state()


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_state_reads_back_bit_for_bit_however_it_is_chunked(chunk: int) -> None:
    state = host_copy(sample_state())
    writer = StateWriter(state)
    assert writer.size == sum(p.nbytes for p in writer.pieces())
    assert_same(state, read(writer, chunk))


def test_the_tensors_are_sent_from_the_snapshot_without_a_copy() -> None:
    state = host_copy(sample_state())
    pieces = list(StateWriter(state).pieces())
    params = state["params"]
    assert any(
        p.nbytes == params.nbytes
        and p.obj is not None
        and p.tobytes()[:8] == params.numpy().tobytes()[:8]
        for p in pieces
    )
    # A view of the tensor's memory: a change to it shows in the piece.
    big = next(p for p in pieces if p.nbytes == params.nbytes)
    params[0] = 123.0
    assert big[:4].tobytes() == struct.pack("<f", 123.0)


def test_a_tensor_is_allocated_when_its_first_byte_arrives() -> None:
    writer = StateWriter(host_copy({"a": torch.zeros(1000), "b": torch.ones(2000)}))
    reader = StateReader(writer.size)
    head = next(writer.pieces())
    assert reader.write(head) is None
    assert reader._tensors == []  # the skeleton declared 12 kB: nothing allocated yet
    assert reader.write(memoryview(bytes(4))) is None
    assert [t.numel() for t in reader._tensors] == [1000]


def skeleton_stream(obj, tail: bytes = b"") -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return MAGIC + struct.pack("<Q", buf.tell()) + buf.getvalue() + tail


@pytest.mark.parametrize(
    ("stream", "size_delta", "why"),
    [
        (b"NOTSTATE" + bytes(8), 0, "magic"),
        (MAGIC + struct.pack("<Q", 1 << 40), 0, "too large"),
        (MAGIC + struct.pack("<Q", 0), 0, "empty"),
        (MAGIC + struct.pack("<Q", 5) + b"junk!", 0, "unreadable"),
        (skeleton_stream({"state": [torch.empty(0)], "shapes": []}), 0, "1 tensors and 0"),
        (skeleton_stream({"state": [torch.empty(0)], "shapes": [[-1]]}), 0, "bad shape"),
        # 1 << 40 floats declared in a stream of 4 bytes: refused before any allocation
        (
            skeleton_stream({"state": [torch.empty(0)], "shapes": [[1 << 40]]}, bytes(4)),
            0,
            "add up",
        ),
        (skeleton_stream({"state": [torch.empty(0)], "shapes": [[1]]}, bytes(4)), 4, "add up"),
        (skeleton_stream({"state": [torch.empty(0)], "shapes": [[1]]}, bytes(8)), -4, "longer"),
        (skeleton_stream({"state": 1}), 0, "no shapes"),
    ],
)
def test_a_stream_that_does_not_add_up_is_refused(stream: bytes, size_delta: int, why: str) -> None:
    reader = StateReader(len(stream) + size_delta)
    got = reader.write(memoryview(stream))
    assert got is not None and why in got, got
    if why != "longer":  # refused before any tensor is made
        assert reader._tensors == []
