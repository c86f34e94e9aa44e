"""The unseen-task check's task (issue 42): a char GPT whose output layer is its token
embedding, each peer on its own stretch of the text, deterministic from the seed."""

from __future__ import annotations

import pytest
import torch
from gossipgrad.peer.tasks import build_task
from gossipgrad.peer.tasks.base import TaskContext

pytestmark = pytest.mark.timeout(120)

NAME = "gossipgrad.experiment.bench.chargpt:chargpt_task"


def test_tied_deterministic_and_sharded() -> None:
    a0 = build_task(NAME, TaskContext(peer_index=0, num_peers=2, batch_size=4))
    again = build_task(NAME, TaskContext(peer_index=0, num_peers=2, batch_size=4))
    a1 = build_task(NAME, TaskContext(peer_index=1, num_peers=2, batch_size=4))
    model = a0.model
    # Tied: one matrix is both the input embedding and the output projection.
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("head") for n in names)
    x, y = next(a0.batches())
    assert x.shape == y.shape == (4, 96)
    before = model(x)
    with torch.no_grad():
        model.tok.weight[y[0, 0]] += 1.0  # moves the logit of that character everywhere
    assert not torch.equal(model(x)[..., y[0, 0]], before[..., y[0, 0]])
    # The same seed and place: the same model and batches; another peer: other windows.
    for p, q in zip(again.model.parameters(), a1.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(next(again.batches())[0], x)
    assert not torch.equal(next(a1.batches())[0], x)
    stream = again.batches()
    fourth = [next(stream) for _ in range(4)][3][0]
    assert torch.equal(next(again.batches(start=3))[0], fourth)  # a resumed peer's order
    assert a0.metric == "loss" and set(a0.evaluate(model)) == {"loss", "perplexity"}
