"""Robust merging: with gossip.robust_clip a malicious neighbour moves a peer by a bounded
amount per round, whatever model it advertises; without it, it drags the peer along.

Two real peers over gRPC; p1 plays the attacker by setting its model to huge values (its
public copies follow, as CHOCO prescribes). What must hold with clipping: p0's model moves at
most gamma * w * clip per round (w = 1/2 on a two-peer ring) and stays finite.
"""

from __future__ import annotations

import threading

import pytest
import torch
from gossipgrad.peer.runtime.node import Peer
from support.peers import start_peers

pytestmark = pytest.mark.timeout(90)

GAMMA = 0.5
ROUNDS = 8


def _pair(clip: float) -> tuple[Peer, Peer]:
    overrides = {"gossip.codec": "fp16", "gossip.gamma": GAMMA, "gossip.robust_clip": clip}
    p0, p1 = start_peers(2, overrides, seed=10, widths=(12, 8, 3))
    return p0, p1


def _attack(clip: float) -> list[float]:
    """p0's per-round displacement while p1 advertises a model of 1e4s."""
    p0, p1 = _pair(clip)
    try:
        with torch.no_grad():
            p1.flat.data.fill_(1e4)
        moves: list[float] = []
        errors: list[BaseException] = []

        def attacker() -> None:
            try:
                for _ in range(ROUNDS):
                    p1.algorithm.step_round()
                    with torch.no_grad():
                        p1.flat.data.fill_(1e4)  # ignore the consensus pull: stay hostile
            except BaseException as err:
                errors.append(err)

        t = threading.Thread(target=attacker)
        t.start()
        for _ in range(ROUNDS):
            before = p0.flat.data.clone()
            p0.algorithm.step_round()
            moves.append(float((p0.flat.data - before).norm()))
        t.join(60)
        assert not errors, errors
        assert torch.isfinite(p0.flat.data).all()
        return moves
    finally:
        p1.close()
        p0.close()


def test_clipping_bounds_a_malicious_neighbours_pull() -> None:
    clip = 0.5
    bound = GAMMA * 0.5 * clip * (1 + 1e-4)
    clipped = _attack(clip)
    assert max(clipped) <= bound, (clipped, bound)
    assert max(clipped) > 0, "the neighbour was never mixed in"
    # The same attack without clipping moves p0 by orders of magnitude more: the test can fail.
    plain = _attack(0.0)
    assert max(plain) > 100 * bound, plain
