"""Training helpers shared by the peer daemon and the experiment's baseline workers.

One place for what must be the same on both sides of a comparison: the local optimizer a
``[train]`` section names, how one local step turns a batch into gradients (autocast, loss
scaling, clipping), the task's view of a shard, the training clock (evaluation time left out)
and the atomic JSON write progress files rely on (``gossipgrad.peer.records``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.records import write_json_atomic
from gossipgrad.peer.tasks.base import TaskContext

__all__ = ["LocalStep", "TrainClock", "make_optimizer", "task_context", "write_json_atomic"]

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(params: Iterable[Any], cfg: TrainSection) -> torch.optim.Optimizer:
    """The local optimizer named in the config."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class LocalStep:
    """The gradients of one local step, as ``train.precision`` and ``train.grad_clip`` say.

    The forward pass and loss run under ``torch.autocast`` (bf16 or fp16); the parameters
    keep their dtype (fp32), so the optimizer state and every gossiped tensor do too. fp16
    scales the loss (``torch.amp.GradScaler``, Micikevicius et al. 2018, "Mixed Precision
    Training") and unscales the gradients before they are clipped, sent or applied; a step
    whose gradients overflow is reported not ``ok`` and must be skipped (the scaler then
    lowers its scale in :meth:`done`).

    Args:
        cfg: the ``[train]`` section.
        device: the device the model is on (selects autocast's device type).
    """

    def __init__(self, cfg: TrainSection, device: torch.device) -> None:
        self.dtype = AUTOCAST_DTYPES.get(cfg.precision)
        self.device_type = device.type
        self.clip = cfg.grad_clip
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
        if self.dtype is not None or self.clip:
            log.info(
                "local steps: %s autocast%s, gradients clipped to norm %s",
                cfg.precision,
                " with loss scaling" if self.scaler is not None else "",
                self.clip or "(off)",
            )

    def backward(
        self, task: Any, model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.Tensor, bool]:
        """Loss of ``batch`` and its (unscaled, clipped) gradients in ``.grad``: ``(loss, ok)``,
        ``ok`` False when fp16 gradients overflowed (skip the optimizer step)."""
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = task.loss(model, batch)
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        ok = self.scaler is None or all(bool(torch.isfinite(g).all()) for g in grads)
        if ok and self.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        return loss.float(), ok

    def done(self) -> None:
        """After the step (taken or skipped): let the loss scaler adapt its scale."""
        if self.scaler is not None:
            self.scaler.update()


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
        eval_samples=cfg.eval_samples or None,
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
