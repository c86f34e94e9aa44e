"""Resolve a task name (built-in or ``"package.module:factory"``) and a centralized baseline."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable

import torch
from gossipgrad.peer.tasks.base import OptimizerFn, Task, TaskContext
from gossipgrad.peer.tasks.charlm import shakespeare_task
from gossipgrad.peer.tasks.vision import (
    digits_task,
    fashion_mnist_cnn_bn_task,
    fashion_mnist_cnn_task,
    fashion_mnist_mlp_task,
)

logger = logging.getLogger(__name__)

TaskFactory = Callable[[TaskContext], Task]

BUILTIN_TASKS: dict[str, TaskFactory] = {
    "digits": digits_task,
    "fashion-mnist-mlp": fashion_mnist_mlp_task,
    "fashion-mnist-cnn": fashion_mnist_cnn_task,
    "fashion-mnist-cnn-bn": fashion_mnist_cnn_bn_task,
    "shakespeare": shakespeare_task,
}


def _bad_name(name: str, why: str) -> ValueError:
    return ValueError(
        f"unknown task {name!r} ({why}); valid: {', '.join(BUILTIN_TASKS)}, or a user task "
        "'package.module:factory' where factory(ctx: TaskContext) -> Task"
    )


def resolve_factory(name: str) -> TaskFactory:
    """The factory behind a task name: a built-in, or ``module:attr`` (attr may be dotted)."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if name.count(":") != 1:
        raise _bad_name(name, "not a built-in task")
    module_name, attr = name.split(":")
    if not module_name or not attr:
        raise _bad_name(name, "empty module or factory in 'module:factory'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise _bad_name(name, f"cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _bad_name(name, f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _bad_name(name, f"{attr!r} is not callable")
    return obj  # type: ignore[return-value]


def build_task(name: str, ctx: TaskContext) -> Task:
    """Build the task ``name`` for this peer.

    The factory runs under ``torch.manual_seed(ctx.seed)`` (the caller's RNG state is left
    untouched), so a model built inside a user factory is identical on every peer.

    Raises:
        ValueError: unknown name (the message lists the built-ins and the user-task form).
        DataUnavailableError: the task's data set is missing (the message says how to fetch it).
        TypeError: a user factory that does not return a ``Task``.
    """
    factory = resolve_factory(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        task = factory(ctx)
    if not isinstance(task, Task):
        raise TypeError(f"task factory {name!r} returned {type(task).__name__}, not a Task")
    logger.info("task %s for peer %s/%s: %r", name, ctx.peer_index, ctx.num_peers, task)
    return task


def train_centralized(
    name: str,
    steps: int,
    ctx: TaskContext,
    *,
    lr: float | None = None,
    optimizer: OptimizerFn | None = None,
) -> dict[str, float]:
    """Centralized baseline: one model on all the data, for the same number of samples.

    A swarm of ``ctx.num_peers`` peers taking ``steps`` steps of ``ctx.batch_size`` each sees
    ``steps * num_peers * batch_size`` samples; the baseline takes ``steps`` steps of
    ``num_peers * batch_size`` samples (mini-batch SGD with the swarm's global batch) with the
    task's recommended optimizer, or ``optimizer(params)`` to match the swarm's (``lr``
    overrides the learning rate either way), then evaluates.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    central = dataclasses.replace(
        ctx, peer_index=0, num_peers=1, batch_size=ctx.batch_size * ctx.num_peers
    )
    task = build_task(name, central)
    model = task.model
    model.train()
    opt = optimizer(list(model.parameters())) if optimizer else task.make_optimizer()
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    batches = task.batches()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            task.loss(model, next(batches)).backward()
            opt.step()
    return task.evaluate(model)
