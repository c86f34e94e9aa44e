"""Learning-rate schedules shared by the peer daemon and the experiment baselines.

A schedule is a factor on ``train.lr`` for each optimizer step: a linear warm-up over
``warmup_steps`` (Goyal et al., 2017), then constant or cosine decay to ``min_lr_ratio`` x lr
at ``steps`` (Loshchilov & Hutter, ICLR 2017: SGDR). Decay matters more for gossip than for
all-reduce: the peers' disagreement at the end of a run grows with the step size
(Koloskova et al., ICML 2020, the consensus term of decentralized SGD), so a schedule that
ends small lets the models meet.
"""

from __future__ import annotations

import math

import torch
from gossipgrad.peer.config import TrainSection


def lr_factor(step: int, cfg: TrainSection) -> float:
    """Multiplier on ``cfg.lr`` for the optimizer step numbered ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps - 1)  # the last step runs at the floor
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainSection, start_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that applies :func:`lr_factor`; call ``step()`` once per optimizer step.

    ``start_step``: the step a resumed or joined run trains from; the schedule starts there
    at once (stepping a fresh one there instead makes torch warn, before any optimizer step,
    that the schedule's first value would be skipped).
    """
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg), last_epoch=start_step - 1
    )
