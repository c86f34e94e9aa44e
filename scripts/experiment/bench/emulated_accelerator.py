"""A built-in task made to wait in every training step, as a host waits on its accelerator.

The peers of a local swarm share this host's CPUs, so whatever one peer does besides training
(a new life's start-up, serving its state to a joiner, a dense resync) comes out of every
other peer's steps: a churn benchmark on one host then measures CPU contention as much as the
protocol. Sites train on accelerators of their own, and a step's device time leaves the host's
CPU free for gossip, membership and the others. ``task`` emulates that: it builds the built-in
task named by ``GOSSIPGRAD_EMULATED_TASK`` (default ``digits``; ``sized:100M``, a model of that
many parameters: ``sized``) and makes each computed loss
wait ``GOSSIPGRAD_ACCELERATOR_MS`` milliseconds before it is returned, in ``time.sleep``, which
gives up the CPU as a thread blocked on its device does. Evaluation does not wait.

Peers take it as a user task (``train.task`` =
``"gossipgrad.experiment.bench.emulated_accelerator:task"``), the environment giving the two
settings; ``scripts/bench_churn.py --accelerator-ms MS`` sets all three.
"""

from __future__ import annotations

import os
import time

import torch
from gossipgrad.experiment.bench.sized import sized_params, sized_task
from gossipgrad.peer.tasks.base import Task, TaskContext
from gossipgrad.peer.tasks.registry import BUILTIN_TASKS

#: ``train.task`` of the emulated task.
TASK_NAME = "gossipgrad.experiment.bench.emulated_accelerator:task"
#: Environment variable: the built-in task that runs on the emulated accelerator.
BASE_TASK_ENV = "GOSSIPGRAD_EMULATED_TASK"
#: A base task of that many parameters (``sized:100M``; ``sized``).
SIZED_PREFIX = "sized:"
#: Environment variable: milliseconds each step waits for the emulated accelerator.
WAIT_ENV = "GOSSIPGRAD_ACCELERATOR_MS"


def accelerator_wait_s() -> float:
    """The wait per step in seconds, from ``GOSSIPGRAD_ACCELERATOR_MS``; ValueError if it is
    not a number >= 0."""
    raw = os.environ.get(WAIT_ENV, "0")
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV} must be milliseconds (a number >= 0), got {raw!r}") from None
    if not ms >= 0:
        raise ValueError(f"{WAIT_ENV} must be >= 0, got {raw!r}")
    return ms / 1000.0


def task(ctx: TaskContext) -> Task:
    """The built-in task ``GOSSIPGRAD_EMULATED_TASK`` with a loss that waits
    ``GOSSIPGRAD_ACCELERATOR_MS`` ms per call (a training step computes it once)."""
    name = os.environ.get(BASE_TASK_ENV, "digits")
    wait = accelerator_wait_s()
    if name.startswith(SIZED_PREFIX):
        base = sized_task(ctx, sized_params(name[len(SIZED_PREFIX) :]))
    elif name in BUILTIN_TASKS:
        base = BUILTIN_TASKS[name](ctx)
    else:
        raise ValueError(
            f"{BASE_TASK_ENV}={name!r} is not a built-in task; valid: "
            f"{', '.join(BUILTIN_TASKS)}, or {SIZED_PREFIX}SIZE (e.g. {SIZED_PREFIX}100M)"
        )

    def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        loss = base.loss(model, batch)
        time.sleep(wait)
        return loss

    return Task(
        model=base.model,
        batches=base.batches,
        loss_fn=loss_fn,
        eval_fn=base.evaluate,
        metric=base.metric,
        num_train_samples=base.num_train_samples,
        higher_is_better=base.higher_is_better,
        optimizer=base.make_optimizer,
        name=f"{base.name}, {wait * 1000:g} ms per step on an emulated accelerator",
    )
