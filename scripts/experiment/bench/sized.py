"""A model of any size whose training step costs the host almost nothing but the passes over
its parameters that every step makes (gradients, the optimizer step).

For what gossip costs at the model sizes people train (100M parameters and more) across an
emulated WAN: the swarm and the baselines train the same parameters over the same links, each
step's compute an emulated accelerator's wait (``emulated_accelerator``, base task
``sized:SIZE``), so compute utilization measures the communication and the gossip's host work,
not this host's cores computing a transformer. The parameters are ``LAYERS`` flat tensors;
each step pulls one window of ``WINDOW`` entries of every tensor towards a fixed random target
(a least-squares loss that falls as training goes on), so the gradients are dense tensors the
size of the model, as DDP and the optimizers see them, and cost one pass to write.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from gossipgrad.experiment.bench.sizes import parse_size
from gossipgrad.peer.tasks.base import Task, TaskContext
from torch import nn

#: Flat parameter tensors the model is split into (DDP buckets and gossip see several).
LAYERS = 4
#: Entries of each tensor one step's loss reads.
WINDOW = 1 << 16
#: Windows the evaluation reads (fixed: the same on every peer and every call).
EVAL_WINDOWS = 8


def sized_params(text: str) -> int:
    """The parameters of ``sized:TEXT`` (``parse_size``; ValueError unless at least
    ``LAYERS * WINDOW``)."""
    n = parse_size(text)
    if n < LAYERS * WINDOW:
        raise ValueError(f"a sized model needs at least {LAYERS * WINDOW} parameters, got {n}")
    return n


class SizedModel(nn.Module):
    """``LAYERS`` flat tensors of ``params`` entries in all, and the fixed target they are
    pulled towards, drawn from ``seed`` (the same on every peer). The target is a plain
    attribute, not a buffer: DDP would broadcast a buffer at every step."""

    def __init__(self, params: int, seed: int = 0, device: torch.device | None = None) -> None:
        super().__init__()
        each = params // LAYERS
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros(each, device=device)) for _ in range(LAYERS)
        )
        gen = torch.Generator().manual_seed(seed)
        self.target = torch.randn(each, generator=gen).to(device)

    def forward(self, offset: int) -> torch.Tensor:
        """Half the squared distance to the target over the window at ``offset``, summed
        over the tensors (SGD at lr 0.2 takes a window a fifth of the way there)."""
        window = self.target[offset : offset + WINDOW]
        return sum(0.5 * ((w[offset : offset + WINDOW] - window) ** 2).sum() for w in self.weights)


def sized_task(ctx: TaskContext, params: int) -> Task:
    """A task of a ``params``-parameter ``SizedModel``: batches are window offsets drawn per
    peer from ``ctx.seed``; the metric is the loss over ``EVAL_WINDOWS`` fixed windows."""
    model = SizedModel(params, ctx.seed, ctx.device)
    span = params // LAYERS - WINDOW

    def batches() -> Iterator[int]:
        gen = torch.Generator().manual_seed(ctx.seed * 1000 + ctx.peer_index)
        while True:
            yield int(torch.randint(0, span + 1, (), generator=gen))

    def loss_fn(m: nn.Module, offset: int) -> torch.Tensor:
        return m(offset)

    def evaluate(m: nn.Module) -> dict[str, float]:
        offsets = [i * span // max(1, EVAL_WINDOWS - 1) for i in range(EVAL_WINDOWS)]
        total = sum(float(m(o)) for o in offsets)
        return {"loss": total / (EVAL_WINDOWS * LAYERS * WINDOW * 0.5)}  # per entry, squared

    return Task(
        model=model,
        batches=batches,
        loss_fn=loss_fn,
        eval_fn=evaluate,
        metric="loss",
        num_train_samples=span + 1,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2),
        name=f"sized model of {params:,} parameters",
    )
