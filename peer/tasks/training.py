"""Training helpers shared by the peer daemon and the experiment's baseline workers.

One place for what must be the same on both sides of a comparison: the local optimizer a
``[train]`` section names, the task's view of a shard, the training clock (evaluation time
left out) and the atomic JSON write progress files rely on (``gossipgrad.peer.records``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.records import write_json_atomic
from gossipgrad.peer.tasks.base import TaskContext

__all__ = ["TrainClock", "make_optimizer", "task_context", "write_json_atomic"]


def make_optimizer(params: Iterable[Any], cfg: TrainSection) -> torch.optim.Optimizer:
    """The local optimizer named in the config."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def task_context(
    cfg: TrainSection, shard_index: int, num_shards: int, device: torch.device | None = None
) -> TaskContext:
    """The task's view of a [train] section for one shard (a peer, or a baseline's rank)."""
    return TaskContext(
        peer_index=shard_index,
        num_peers=num_shards,
        seed=cfg.seed,
        partition=cfg.partition,
        alpha=cfg.alpha,
        batch_size=cfg.batch_size,
        device=device if device is not None else torch.device("cpu"),
    )


class TrainClock:
    """Seconds since training started with evaluation time left out, so that a peer's
    evaluation points line up with the DDP baselines' (which evaluate on the same clock)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.excluded = 0.0

    def seconds(self) -> float:
        return time.monotonic() - self.start - self.excluded

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside the block does not count."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.excluded += time.monotonic() - t0
