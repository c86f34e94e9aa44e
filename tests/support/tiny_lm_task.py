"""A tiny language-model task for the diloco swarm test, loaded as "support.tiny_lm_task:make_task".

Text from a fixed random Markov chain over 12 symbols (each symbol has a few likely
successors), so a one-layer transformer learns it in a few hundred AdamW steps on one core;
the metric is the held-out next-symbol loss (lower is better).
"""

from __future__ import annotations

import torch
from gossipgrad.peer.tasks import Task, TaskContext
from gossipgrad.peer.tasks.charlm import CharTransformer, lm_loss
from torch import nn

VOCAB = 12
CONTEXT = 16


def _chain(n: int, seed: int) -> torch.Tensor:
    """n symbols of the task's Markov chain (the chain itself is fixed; ``seed`` picks the walk)."""
    rules = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, VOCAB, generator=rules) * 3.0
    probs = torch.softmax(logits, dim=1)
    walk = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dtype=torch.long)
    s = 0
    for i in range(n):
        s = int(torch.multinomial(probs[s], 1, generator=walk))
        out[i] = s
    return out


def _windows(seq: torch.Tensor, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.arange(0, len(seq) - CONTEXT - 1, stride)
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    w = seq[idx]
    return w[:, :-1], w[:, 1:]


def make_task(ctx: TaskContext) -> Task:
    x, y = _windows(_chain(12_000, seed=1), stride=3)
    test_x, test_y = _windows(_chain(2_000, seed=2), stride=CONTEXT)

    def evaluate(model: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {"loss": float(lm_loss(model, (test_x, test_y)))}

    return Task.from_parts(
        ctx,
        model=lambda: CharTransformer(
            vocab=VOCAB, d_model=32, n_layers=1, n_heads=2, context=CONTEXT
        ),
        train_dataset=(x, y),
        eval_fn=evaluate,
        loss_fn=lm_loss,
        metric="loss",
        higher_is_better=False,
        name="tiny-lm",
    )
