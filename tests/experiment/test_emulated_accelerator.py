"""The emulated-accelerator task (``gossipgrad.experiment.bench.emulated_accelerator``): the
same loss as the built-in task it wraps, a wait per step, and clear errors for bad settings."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from gossipgrad.experiment.bench.emulated_accelerator import BASE_TASK_ENV, TASK_NAME, WAIT_ENV
from gossipgrad.peer.tasks import build_task
from gossipgrad.peer.tasks.base import TaskContext
from support import ROOT

pytestmark = pytest.mark.timeout(120)


def test_the_emulated_task_is_the_built_in_one_with_a_wait_per_loss(monkeypatch) -> None:
    monkeypatch.setenv(BASE_TASK_ENV, "digits")
    monkeypatch.setenv(WAIT_ENV, "60")
    ctx = TaskContext(num_peers=2, peer_index=1, seed=3, batch_size=16)
    emulated, plain = build_task(TASK_NAME, ctx), build_task("digits", ctx)
    assert "60 ms per step" in emulated.name
    # Same seeded model, shard and batches: the same loss, computed once per call.
    batch = next(emulated.batches())
    assert torch.equal(batch[0], next(plain.batches())[0])
    t0 = time.monotonic()
    loss = emulated.loss(emulated.model, batch)
    waited = time.monotonic() - t0
    assert torch.equal(loss, plain.loss(plain.model, batch))
    assert waited >= 0.06
    assert emulated.evaluate(emulated.model) == plain.evaluate(plain.model)
    assert (emulated.metric, emulated.num_train_samples) == (plain.metric, plain.num_train_samples)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({WAIT_ENV: "fast"}, "GOSSIPGRAD_ACCELERATOR_MS must be milliseconds"),
        ({WAIT_ENV: "-5"}, "GOSSIPGRAD_ACCELERATOR_MS must be >= 0"),
        ({WAIT_ENV: "nan"}, "GOSSIPGRAD_ACCELERATOR_MS must be >= 0"),
        ({BASE_TASK_ENV: "mnist"}, "GOSSIPGRAD_EMULATED_TASK='mnist' is not a built-in task"),
        ({BASE_TASK_ENV: "sized:huge"}, "a model size such as 100M, got 'huge'"),
        ({BASE_TASK_ENV: "sized:1000"}, "a sized model needs at least 262144 parameters"),
    ],
)
def test_bad_settings_are_named_in_the_error(monkeypatch, env, message) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        build_task(TASK_NAME, TaskContext())


def test_a_sized_task_has_the_parameters_asked_for_and_sgd_lowers_its_loss(monkeypatch) -> None:
    """``sized:SIZE``: a model of SIZE parameters (to a multiple of its tensors), the same on
    every peer, whose steps train: the evaluation's loss falls."""
    monkeypatch.setenv(BASE_TASK_ENV, "sized:2M")
    monkeypatch.setenv(WAIT_ENV, "0")
    peers = [build_task(TASK_NAME, TaskContext(num_peers=2, peer_index=i, seed=1)) for i in (0, 1)]
    task = peers[0]
    assert sum(p.numel() for p in task.model.parameters()) == 2_000_000
    assert torch.equal(task.model.target, peers[1].model.target)
    assert next(task.batches()) != next(peers[1].batches())  # each peer its own windows
    before = task.evaluate(task.model)["loss"]
    opt = task.make_optimizer(task.model.parameters())
    batches = task.batches()
    for _ in range(200):
        opt.zero_grad()
        task.loss(task.model, next(batches)).backward()
        opt.step()
    assert task.evaluate(task.model)["loss"] < 0.9 * before


def test_bench_churn_refuses_an_emulated_accelerator_under_a_user_task(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts" / "bench_churn.py"), "--accelerator-ms", "50",
            "--set", "train.task=mypkg.tasks:make", "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--accelerator-ms runs a built-in task, not train.task='mypkg.tasks:make'" in proc.stderr
    assert not (tmp_path / "churn.json").exists()
