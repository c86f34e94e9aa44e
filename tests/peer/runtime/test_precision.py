"""Mixed precision and gradient clipping: ``train.precision`` / ``train.grad_clip`` in task
mode (``LocalStep``), and torch's own ``GradScaler`` driving a ``GossipOptimizer`` in a user's
loop. What must hold: autocast changes the forward pass only (parameters, gradients and what is
gossiped stay fp32); an fp16 step whose gradients overflow is skipped (no optimizer step, no
gossip) and the scale backs off; clipping bounds the global gradient norm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gossipgrad.peer import GossipOptimizer
from gossipgrad.peer.config import TrainSection, build_config
from gossipgrad.peer.tasks.training import LocalStep
from torch import nn

pytestmark = pytest.mark.timeout(120)


class Regression:
    """A task-shaped object: squared error of a linear model, scaled by ``scale``."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.dtypes: list[torch.dtype] = []

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = model(x)
        self.dtypes.append(out.dtype)
        return self.scale * (out.float() - y).pow(2).mean()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)


def model_and_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def fp32_grads() -> list[torch.Tensor]:
    model, _ = model_and_sgd()
    Regression().loss(model, batch()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_changes_the_forward_only(precision: str, dtype: torch.dtype) -> None:
    model, opt = model_and_sgd()
    task = Regression()
    local = LocalStep(TrainSection(precision=precision), torch.device("cpu"))
    loss, ok = local.backward(task, model, batch(), opt)
    assert ok and task.dtypes == [dtype]
    assert loss.dtype == torch.float32
    for p, ref in zip(model.parameters(), fp32_grads(), strict=True):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        # Half-precision forward, unscaled gradients close to the fp32 ones.
        assert torch.allclose(p.grad, ref, rtol=0.05, atol=0.02), (p.grad, ref)
    local.done()


def test_fp32_is_the_plain_step() -> None:
    model, opt = model_and_sgd()
    task = Regression()
    _, ok = LocalStep(TrainSection(), torch.device("cpu")).backward(task, model, batch(), opt)
    assert ok and task.dtypes == [torch.float32]
    for p, ref in zip(model.parameters(), fp32_grads(), strict=True):
        assert torch.equal(p.grad, ref)


def test_an_fp16_overflow_is_reported_and_the_scale_backs_off() -> None:
    model, opt = model_and_sgd()
    local = LocalStep(TrainSection(precision="fp16"), torch.device("cpu"))
    scale = local.scaler.get_scale()
    _, ok = local.backward(Regression(scale=1e30), model, batch(), opt)
    assert not ok
    local.done()
    assert local.scaler.get_scale() < scale
    opt.zero_grad()
    _, ok = local.backward(Regression(), model, batch(), opt)
    assert ok


def test_clipping_bounds_the_global_norm_and_keeps_small_gradients() -> None:
    ref = torch.cat([g.reshape(-1) for g in fp32_grads()])
    for clip, expected in [(0.05, 0.05), (1e6, float(ref.norm()))]:
        model, opt = model_and_sgd()
        LocalStep(TrainSection(grad_clip=clip), torch.device("cpu")).backward(
            Regression(), model, batch(), opt
        )
        norm = float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())
        assert norm == pytest.approx(expected, rel=1e-5), (clip, norm)


def test_torch_grad_scaler_drives_a_gossip_optimizer() -> None:
    """The own-loop recipe of docs/api.md: ``scaler.step(gopt)`` takes the step (and its
    gossip) only when the gradients are finite."""
    model, opt = model_and_sgd()
    cfg = build_config({}, {"peer.id": "solo", "metrics.enabled": False})
    scaler = torch.amp.GradScaler("cpu")
    with GossipOptimizer(model, opt, cfg) as gopt:
        before = gopt.flat.data.clone()
        for scale, taken in [(1e30, 0), (1.0, 1)]:
            gopt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = Regression(scale).loss(model, batch())
            scaler.scale(loss).backward()
            scaler.unscale_(gopt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(gopt)
            scaler.update()
            assert gopt.local_step == taken
        assert gopt.flat.data.dtype == torch.float32
        assert not torch.equal(gopt.flat.data, before)


def test_the_daemon_trains_digits_in_bf16_with_clipping(tmp_path: Path) -> None:
    """As a user runs it: ``gossipgrad-peer --set train.precision=bf16 --set
    train.grad_clip=1`` (one peer)."""
    run = subprocess.run(
        [sys.executable, "-m", "gossipgrad.peer", "--set", "train.precision=bf16",
         "--set", "train.grad_clip=1.0", "--set", "train.steps=150", "--set",
         "train.eval_every=0", "--set", "train.threads=1", "--set", "metrics.enabled=false",
         "--set", f"peer.run_dir={tmp_path}", "--set", "peer.listen=127.0.0.1:0"],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "local steps: bf16 autocast, gradients clipped to norm 1.0" in run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 150
    assert summary["final"]["accuracy"] > 0.8, summary["final"]
