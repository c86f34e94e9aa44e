"""Learning-rate schedules: warm-up, constant and cosine decay, as the optimizer sees them."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.tasks.schedule import lr_factor, make_scheduler

pytestmark = pytest.mark.timeout(30)


def lrs(cfg: TrainSection) -> list[float]:
    """The learning rate of every step of a run, read from a real optimizer."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    out = []
    for _ in range(cfg.steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_is_the_default() -> None:
    assert TrainSection().schedule == "cosine"


def test_constant_after_a_linear_warmup() -> None:
    cfg = TrainSection(steps=10, lr=0.1, warmup_steps=4, schedule="constant")
    assert lrs(cfg) == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])


def test_cosine_decays_from_lr_to_the_floor() -> None:
    cfg = TrainSection(steps=101, lr=0.2, schedule="cosine", min_lr_ratio=0.1)
    seen = lrs(cfg)
    assert seen[0] == pytest.approx(0.2)
    assert seen[50] == pytest.approx(0.2 * (0.1 + 0.9 * 0.5))  # half way: the midpoint
    assert seen[100] == pytest.approx(0.02)
    assert all(a >= b for a, b in itertools.pairwise(seen))


def test_cosine_starts_after_warmup_and_stays_at_floor_past_the_end() -> None:
    cfg = TrainSection(steps=21, lr=1.0, warmup_steps=10, schedule="cosine")
    assert lr_factor(4, cfg) == pytest.approx(0.5)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(13, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))
    assert lr_factor(20, cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(500, cfg) == pytest.approx(0.0, abs=1e-12)  # resumed past the end


@pytest.mark.parametrize("bad", [{"schedule": "linear"}, {"min_lr_ratio": 1.5}])
def test_bad_schedule_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        TrainSection(**bad)


def test_a_schedule_started_at_a_resumed_step_goes_on_from_there_without_warnings() -> None:
    """A resumed or joined peer's schedule starts at its step: the same learning rates as a
    run that got there step by step, and no torch warning about stepping it too early."""
    cfg = TrainSection(steps=30, lr=0.3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = make_scheduler(opt, cfg, start_step=12)
        resumed = []
        for _ in range(cfg.steps - 12):
            resumed.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert sched.last_epoch == cfg.steps
    assert resumed == pytest.approx(lrs(cfg)[12:], rel=1e-12)
