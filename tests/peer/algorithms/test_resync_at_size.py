"""A dense resync is decoded straight into the receiver's mirror, at a real model's size.

The receiver of a RESYNC held the payload, a decoded copy of the whole model beside it, and
the mirror the copy went into: one model more than needed, for as long as the decode ran.
Now the payload is checked (shape, dtype, envelope) and decoded into the mirror. On the real
edges of one session (no gRPC): the mirror comes out bit for bit the leader's public copy
(the checksum holds), and applying the resync adds no resident memory of the model's size.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from gossipgrad.compression import DecodeError, from_spec
from gossipgrad.peer.algorithms.edges import Copies, Edge, Incoming, Kind, Verdict
from gossipgrad.peer.flat import SpilledTensor, tensor_checksum

pytestmark = pytest.mark.timeout(120)

NUMEL = 24_000_000


def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def resync(numel: int, dtype: torch.dtype = torch.float32) -> tuple[Edge, Edge, Incoming, Copies]:
    """A leader's dense opening of a session (past the rounds that open with INIT)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    c = Copies(from_spec("topk:0.01+int8"), from_spec("none"), SpilledTensor(torch.zeros(1)))
    leader = Edge(public=torch.zeros(numel), mirror=torch.zeros(numel), leader=True)
    follower = Edge(public=torch.zeros(numel), mirror=torch.zeros(numel, dtype=dtype), leader=False)
    follower.mirror.fill_(1.0)  # its pages resident, as a live edge's are
    kind, payload = leader.encode_next(x, c, early=False, seed=1)
    assert kind is Kind.RESYNC
    update = Incoming(
        epoch=leader.epoch,
        seq=1,
        kind=kind,
        checksum=tensor_checksum(leader.public),
        weight=0.5,
        payload=payload,
    )
    leader.record_sent(update, 0.5, 1)
    return leader, follower, update, c


def test_a_resync_goes_into_the_mirror_bit_for_bit_without_a_decoded_copy() -> None:
    leader, follower, update, c = resync(NUMEL)
    assert follower.admit(update) is None
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    before = memory_kib("VmRSS")
    assert follower.apply(update, c) is Verdict.ACCEPTED
    added = (memory_kib("VmHWM") - before) * 1024
    assert torch.equal(follower.mirror, leader.public)
    model_bytes = 4 * NUMEL
    assert added < 0.1 * model_bytes, added / model_bytes  # was a whole model (1.0)


def test_a_resync_of_another_size_or_dtype_is_refused_and_leaves_the_mirror_alone() -> None:
    _, _, update, c = resync(1000)
    small = Edge(public=torch.zeros(999), mirror=torch.full((999,), 7.0), leader=False)
    assert small.admit(update) is None
    with pytest.raises(DecodeError, match="1000"):
        small.apply(update, c)
    assert torch.equal(small.mirror, torch.full((999,), 7.0))
    half = Edge(public=torch.zeros(1000), mirror=torch.full((1000,), 7.0).half(), leader=False)
    assert half.admit(update) is None
    with pytest.raises(DecodeError, match="copy_dtype must be the same"):
        half.apply(update, c)
    assert torch.equal(half.mirror, torch.full((1000,), 7.0).half())
