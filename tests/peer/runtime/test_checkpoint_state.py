"""A checkpoint is written from the live state, held still, not from a copy of it.

``GossipOptimizer.checkpoint_state`` hands the daemon's checkpoint the parameters, the
optimizer's and the algorithm's tensors themselves (a copy would hold the state's size again:
3 models for a diloco peer) while the state lock keeps every other thread off them. Two diloco
peers over real gRPC on 127.0.0.1 (both ends' rounds must run: a phase end waits for its
neighbour).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from gossipgrad.peer.runtime import checkpoint
from gossipgrad.peer.runtime.state_stream import _walk
from support.optimizers import start_optimizers
from support.threads import at_once

pytestmark = pytest.mark.timeout(120)


def tensors(state) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _walk(state, found.append)
    return found


def test_a_checkpoint_is_the_live_state_held_still_and_reads_back_as_state_dict(
    tmp_path: Path,
) -> None:
    peers = start_optimizers(2, algorithm="diloco", lr=0.5, local_steps=2)
    try:
        gen = torch.Generator().manual_seed(0)
        targets = [torch.randn(p.flat.numel, generator=gen) for p in peers]

        def train(i: int) -> None:
            for _ in range(4):  # two phases: an anchor moved, a residual kept
                peers[i].flat.set_grad(peers[i].flat.data - targets[i])
                peers[i].step()

        at_once(lambda: train(0), lambda: train(1))
        p = peers[0]
        alg = p.algorithm
        (name,) = alg.average.feedback.names()
        residual = alg.average.feedback.residual(name)
        with p.checkpoint_state() as live:
            # The tensors themselves, not copies of them.
            assert live["params"].data_ptr() == p.flat.data.data_ptr()
            assert live["gossip"]["anchor"].data_ptr() == alg.anchor.data_ptr()
            got = live["gossip"]["average"]["feedback"]["residuals"][name]
            assert got.data_ptr() == residual.data_ptr()
            # Held still: no other thread takes the state lock until the block ends.
            took: list[bool] = []
            other = threading.Thread(target=lambda: took.append(p.state_lock.acquire(timeout=0.3)))
            other.start()
            other.join()
            assert took == [False]
            checkpoint.save_atomic(tmp_path / "checkpoint.pt", live)
        loaded = checkpoint.load(tmp_path / "checkpoint.pt")
        copied = p.state_dict()
        assert loaded["local_step"] == copied["local_step"] == 4
        pairs = list(zip(tensors(loaded), tensors(copied), strict=True))
        assert len(pairs) >= 3 and all(torch.equal(a, b) for a, b in pairs)
        # state_dict() stays a copy: training on does not change it.
        p.flat.data.add_(1.0)
        assert not torch.equal(copied["params"], p.flat.data)
    finally:
        for o in peers:
            o.close()
