"""What a site trains: built-in tasks with real data, per-peer sharding, and user tasks.

    from gossipgrad.peer.tasks import build_task, TaskContext
    task = build_task("digits", TaskContext(peer_index=0, num_peers=4, seed=0))

Built-ins: ``digits``, ``fashion-mnist-mlp``, ``fashion-mnist-cnn``, ``shakespeare``; a user
task is ``"package.module:factory"`` with ``factory(ctx) -> Task`` (see ``Task.from_parts``
and docs/tasks.md).

How a ``[train]`` section trains a task locally, the same for a peer and for the experiment's
baselines: ``training`` (the local optimizer, a shard's ``TaskContext``, the training clock)
and ``schedule`` (the learning-rate schedule).
"""

from gossipgrad.peer.tasks.base import (
    PARTITIONS,
    Task,
    TaskContext,
    classification_eval,
    cross_entropy_loss,
)
from gossipgrad.peer.tasks.data import DataUnavailableError, data_dir
from gossipgrad.peer.tasks.registry import (
    BUILTIN_TASKS,
    build_task,
    resolve_factory,
    train_centralized,
)

__all__ = [
    "BUILTIN_TASKS",
    "PARTITIONS",
    "DataUnavailableError",
    "Task",
    "TaskContext",
    "build_task",
    "classification_eval",
    "cross_entropy_loss",
    "data_dir",
    "resolve_factory",
    "train_centralized",
]
