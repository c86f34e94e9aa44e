"""A user task that records what each training step drew: the batch, and one draw of torch's
global generator (the draws dropout and the like would take). Run in-process by the resume
tests; ``SEEN`` holds the records of every loss computed since it was last cleared."""

from __future__ import annotations

import torch
from gossipgrad.peer.tasks import Task, TaskContext, classification_eval
from torch import nn

SEEN: list[tuple[torch.Tensor, float]] = []


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = (x[:, 0] - x[:, 2] > 0).long()
    return x, y


def _recorded_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    SEEN.append((x.clone(), float(torch.rand(()))))
    return nn.functional.cross_entropy(model(x), y)


def make_task(ctx: TaskContext) -> Task:
    """A small classifier with dropout and BatchNorm (so buffers.pt is written) over 96
    samples: with batch size 8, an epoch is 12 batches."""
    x, y = _data(96, seed=5)
    test_x, test_y = _data(64, seed=6)
    return Task.from_parts(
        ctx,
        model=lambda: nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)
        ),
        train_dataset=(x, y),
        eval_fn=classification_eval(test_x, test_y),
        loss_fn=_recorded_loss,
        name="recording",
    )


class Overflows(nn.Module):
    """A classifier whose training loss is scaled by 1e30 from its ``after``-th training
    forward on: the loss stays finite (about 1e30), its gradients' squares overflow, so
    Adam's second moment turns infinite while the parameters stay finite (the step Adam
    takes with an infinite second moment is 0)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.after = after
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        out = self.net(x)
        return out * 1e30 if self.training and self.calls >= self.after else out


def make_overflowing_task(ctx: TaskContext) -> Task:
    """The recording task's data on a model whose optimizer state overflows at step 15."""
    x, y = _data(96, seed=5)
    test_x, test_y = _data(64, seed=6)
    return Task.from_parts(
        ctx,
        model=Overflows(15),
        train_dataset=(x, y),
        eval_fn=classification_eval(test_x, test_y),
        name="overflowing",
    )
