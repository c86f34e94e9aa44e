"""Tied parameters (an embedding shared with the output layer, as GPT-2 does) under every
algorithm. What must hold: the tied weight is one tensor with one slot in the flat vector (not
two copies that gossip would pull apart), it stays one tensor through training and gossip, and
each algorithm's exactness law holds for a tied model as for any other.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from support.optimizers import start_optimizers, train_concurrently
from support.peers import assert_mirrors_exact
from torch import nn

pytestmark = pytest.mark.timeout(120)

VOCAB, WIDTH = 12, 8


class TiedLM(nn.Module):
    """Embedding -> linear -> output layer whose weight *is* the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start, size = flat.data_ptr(), flat.numel() * flat.element_size()
    return start <= t.data_ptr() < start + size


def assert_one_tied_tensor(model: TiedLM, flat: torch.Tensor) -> None:
    assert model.head.weight is model.emb.weight
    assert inside(model.emb.weight, flat), "the tied weight is not a view of the flat buffer"


def test_a_tied_weight_has_one_slot_and_gossip_writes_reach_both_uses() -> None:
    model = TiedLM()
    flat = FlatParameters(model)
    assert flat.numel == VOCAB * WIDTH + WIDTH * WIDTH + WIDTH
    assert flat.names.count("emb.weight") == 1 and "head.weight" not in flat.names
    assert_one_tied_tensor(model, flat.data)
    with torch.no_grad():
        flat.data.zero_()  # what a mixing step does: write the flat vector in place
    tokens = torch.arange(VOCAB)
    assert torch.count_nonzero(model.emb(tokens)) == 0
    assert torch.count_nonzero(model.head.weight) == 0


def next_token_loss(i: int, model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    x = torch.randint(VOCAB, (32,), generator=gen)
    return nn.functional.cross_entropy(model(x), (x + 1) % VOCAB)


def settle(edges) -> None:
    deadline = time.monotonic() + 10
    while any(e.busy for e in edges):
        assert time.monotonic() < deadline, "pushes still in flight"
        time.sleep(0.02)


def assert_edges_exact(opts: list[GossipOptimizer], edges_of) -> None:
    """Every edge: one session at both ends, the mirror bit-identical to the public copy."""
    by_id = {o.peer.id: o for o in opts}
    settle([e for o in opts for e in edges_of(o).values()])
    for o in opts:
        for peer, edge in edges_of(o).items():
            other = edges_of(by_id[peer])[o.peer.id]
            assert edge.epoch == other.epoch != 0
            assert other.received == edge.sent > 0
            assert torch.equal(other.mirror, edge.public), f"{o.peer.id}->{peer} diverged"


@pytest.mark.parametrize(
    "algorithm,gossip",
    [
        ("choco", {"local_steps": 1, "codec": "topk:0.2+int8"}),
        ("ef-gradient", {"codec": "none"}),
        ("diloco", {"local_steps": 3, "codec": "topk:0.2+int8"}),
    ],
)
def test_a_tied_model_trains_and_keeps_each_algorithm_exact(algorithm: str, gossip) -> None:
    opts = start_optimizers(
        3, algorithm=algorithm, lr=0.1, model_fn=TiedLM, topology="full", **gossip
    )
    try:
        losses = train_concurrently(opts, next_token_loss, steps=12)
        assert all(math.isfinite(v) and v < 10 for v in losses), losses
        for o in opts:
            assert_one_tied_tensor(o.model, o.flat.data)
            assert o.round > 0, f"{algorithm}: {o.peer.id} ran no gossip"
        if algorithm == "choco":
            assert assert_mirrors_exact([o.peer for o in opts]) == 6
        elif algorithm == "diloco":
            assert_edges_exact(opts, lambda o: o.algorithm.anchors.edges)
        else:
            # Exact averaging of the same gradients, summed in one order at every peer: the
            # peers, seeded alike, stay bit-identical.
            for o in opts[1:]:
                assert torch.equal(o.flat.data, opts[0].flat.data)
    finally:
        for o in opts:
            o.close()
