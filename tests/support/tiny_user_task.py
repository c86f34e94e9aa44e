"""A user task for tests/peer/tasks/test_tasks.py, loaded as "support.tiny_user_task:make_task".

Synthetic two-class data from a fixed generator: a linear rule the model can learn quickly.
"""

from __future__ import annotations

import torch
from gossipgrad.peer.tasks import Task, TaskContext, classification_eval
from torch import nn
from torch.utils.data import Dataset


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def make_task(ctx: TaskContext) -> Task:
    """Tensor-tuple training set; the model is built inside the (seeded) factory call."""
    x, y = _data(400, seed=1)
    test_x, test_y = _data(200, seed=2)
    return Task.from_parts(
        ctx,
        model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
        train_dataset=(x, y),
        eval_fn=classification_eval(test_x, test_y),
        name="tiny",
    )


class PairDataset(Dataset):
    """A map-style dataset (no tensor tuple): exercises the collate path."""

    def __init__(self, n: int) -> None:
        self.x, self.y = _data(n, seed=3)
        self.targets = self.y.tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_dataset_task(ctx: TaskContext) -> Task:
    """Map-style dataset, model given as a builder, metric "loss" (lower is better)."""
    test_x, test_y = _data(100, seed=4)
    return Task.from_parts(
        ctx,
        model=lambda: nn.Linear(8, 2),
        train_dataset=PairDataset(300),
        eval_fn=classification_eval(test_x, test_y),
        metric="loss",
    )


def not_a_task(ctx: TaskContext) -> int:
    """A broken factory: returns something that is not a Task."""
    return 42


class DivergesAfter(nn.Module):
    """A classifier whose output turns NaN from its ``after``-th training forward on."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.after = after
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.calls >= self.after else out


def make_diverging_task(ctx: TaskContext) -> Task:
    """The tiny task, except that training diverges (NaN) at step 35."""
    x, y = _data(400, seed=1)
    test_x, test_y = _data(200, seed=2)
    return Task.from_parts(
        ctx,
        model=DivergesAfter(35),
        train_dataset=(x, y),
        eval_fn=classification_eval(test_x, test_y),
        name="diverging",
    )


def make_shard_diverging_task(ctx: TaskContext) -> Task:
    """The tiny task, except that the loss of shard 1 alone turns NaN at its step 15 (one
    rank of a two-rank site: the other's loss is finite at that step)."""
    x, y = _data(400, seed=1)
    test_x, test_y = _data(200, seed=2)
    return Task.from_parts(
        ctx,
        model=DivergesAfter(15 if ctx.peer_index == 1 else 10**9),
        train_dataset=(x, y),
        eval_fn=classification_eval(test_x, test_y),
        name="shard-diverging",
    )
