"""What a site trains: ``TaskContext`` (who am I in the swarm) and ``Task`` (model + data).

A ``Task`` bundles a model, an infinite iterator of this peer's training batches, a loss, and
a quick held-out evaluation. The peer daemon only uses that interface, so built-in tasks and
user tasks (``"package.module:factory"``) look the same to it.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gossipgrad.peer.tasks.sharding import dirichlet_partition, iid_partition
from torch import nn
from torch.utils.data import Dataset, default_collate

logger = logging.getLogger(__name__)

PARTITIONS = ("iid", "dirichlet")
_PARTITION_ALIASES = {"iid": "iid", "dirichlet": "dirichlet", "non-iid": "dirichlet"}

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
EvalFn = Callable[[nn.Module], Mapping[str, float]]
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class TaskContext:
    """This peer's place in the swarm and the knobs that decide its data shard."""

    peer_index: int = 0
    """Index of this peer among the sorted peer ids, 0..num_peers-1."""
    num_peers: int = 1
    """Number of peers the training set is split between."""
    seed: int = 0
    """Seeds the model init (same on every peer), the split and the batch order."""
    partition: str = "iid"
    """``"iid"`` (shuffled equal split) or ``"dirichlet"`` (alias ``"non-iid"``: label skew)."""
    alpha: float = 0.5
    """Dirichlet concentration for ``partition="dirichlet"``; smaller is more skewed."""
    batch_size: int = 64
    """Training batch size per peer (sequences per batch for language models)."""
    device: torch.device = torch.device("cpu")  # noqa: RUF009 -- immutable in practice
    """Where the model lives and batches are sent."""
    eval_samples: int | None = None
    """Cap on held-out samples used by ``evaluate`` (None: the task's default)."""
    data_dir: Path | None = None
    """Data cache directory (None: ``$GOSSIPGRAD_DATA`` or ``~/.cache/gossipgrad``)."""

    def __post_init__(self) -> None:
        if self.num_peers < 1:
            raise ValueError(f"num_peers must be >= 1, got {self.num_peers}")
        if not 0 <= self.peer_index < self.num_peers:
            raise ValueError(
                f"peer_index {self.peer_index} out of range for num_peers={self.num_peers}"
            )
        if self.partition not in _PARTITION_ALIASES:
            raise ValueError(
                f"unknown partition {self.partition!r}; valid: iid, dirichlet (or non-iid)"
            )
        object.__setattr__(self, "partition", _PARTITION_ALIASES[self.partition])
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1 or None, got {self.eval_samples}")
        object.__setattr__(self, "device", torch.device(self.device))

    def stream_seed(self, stream: int) -> int:
        """A 63-bit seed for one of this peer's random streams (batch order, ...)."""
        state = np.random.SeedSequence([self.seed, self.peer_index, self.num_peers, stream])
        return int(state.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def seeded_model(ctx: TaskContext, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a model under ``torch.manual_seed(ctx.seed)`` so every peer starts identical.

    The caller's global RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        model = build()
    return model.to(ctx.device)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move tensors inside (nested tuples/lists/dicts of) a batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def index_batches(
    num_items: int, batch_size: int, seed: int, start: int = 0
) -> Iterator[torch.Tensor]:
    """Infinite stream of index batches: a fresh permutation each epoch, wrapping across
    epochs so every batch has exactly ``batch_size`` indices (even for tiny shards); from
    batch ``start`` of that stream on (the ones before are drawn, not yielded)."""
    if num_items < 1:
        raise ValueError("cannot draw batches from an empty shard")
    gen = torch.Generator().manual_seed(seed)
    buf = torch.empty(0, dtype=torch.int64)
    drawn = 0
    while True:
        while len(buf) < batch_size:
            buf = torch.cat([buf, torch.randperm(num_items, generator=gen)])
        out, buf = buf[:batch_size], buf[batch_size:]
        drawn += 1
        if drawn > start:
            yield out


def cross_entropy_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Default classification loss: batch is ``(inputs, labels)``."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def classification_eval(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int = 1000,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> EvalFn:
    """An ``eval_fn`` returning ``{"accuracy", "loss"}`` over a fixed held-out set.

    ``transform`` (e.g. uint8 -> normalised float) is applied per chunk, so the held-out set
    can stay compact in memory.
    """

    def evaluate(model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        correct, total_loss = 0, 0.0
        for start in range(0, len(labels), batch_size):
            x = inputs[start : start + batch_size]
            x = transform(x) if transform is not None else x
            y = labels[start : start + batch_size].to(device)
            logits = model(x.to(device))
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=-1) == y).sum())
        n = len(labels)
        return {"accuracy": correct / n, "loss": total_loss / n}

    return evaluate


def _lower_is_better(metric: str) -> bool:
    return any(word in metric.lower() for word in ("loss", "perplexity", "error", "bpc"))


class Task:
    """A model, this peer's training batches, a loss and a quick held-out evaluation.

    Build one with ``Task.from_parts`` (model + dataset + eval function) or, for full
    control over batching, with the constructor.

    Args:
        model: the model (already on its device; every peer must build it identically).
        batches: called by ``batches()``; returns an infinite iterator of training batches.
            If it takes a ``start`` argument, it begins at batch ``start`` of that order
            (a resumed peer's next batch) without building the ones before; otherwise those
            are drawn and dropped.
        loss_fn: ``loss_fn(model, batch)`` -> scalar tensor.
        eval_fn: ``eval_fn(model)`` -> metrics on held-out data; called under ``no_grad`` in
            eval mode. Keep it quick (it runs every few rounds on every peer).
        metric: the headline key of ``eval_fn``'s result.
        higher_is_better: direction of ``metric`` (default: False for loss/perplexity/error).
        num_train_samples: size of this peer's shard.
        optimizer: ``optimizer(params)`` -> the recommended optimizer (default SGD 0.05,
            momentum 0.9).
        name: for logs.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        batches: Callable[[], Iterator[Batch]],
        loss_fn: LossFn,
        eval_fn: EvalFn,
        metric: str,
        num_train_samples: int,
        higher_is_better: bool | None = None,
        optimizer: OptimizerFn | None = None,
        name: str = "custom",
    ) -> None:
        self.model = model
        self._batches = batches
        self._loss_fn = loss_fn
        self._eval_fn = eval_fn
        self.metric = metric
        self.higher_is_better = (
            not _lower_is_better(metric) if higher_is_better is None else higher_is_better
        )
        self.num_train_samples = int(num_train_samples)
        self._optimizer = optimizer
        self.name = name

    def batches(self, start: int = 0) -> Iterator[Batch]:
        """An infinite iterator of this peer's training batches (on the task's device), from
        batch ``start`` of its order on: a peer resumed after ``start`` batches goes on where
        it stopped instead of training again on the batches it saw."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if "start" in inspect.signature(self._batches).parameters:
            return self._batches(start=start)
        return itertools.islice(self._batches(), start, None)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar training loss of ``model`` on ``batch``."""
        return self._loss_fn(model, batch)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics (deterministic); includes ``self.metric``. Restores train mode."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                metrics = {k: float(v) for k, v in self._eval_fn(model).items()}
        finally:
            model.train(was_training)
        if self.metric not in metrics:
            raise KeyError(f"task {self.name!r}: eval_fn returned no {self.metric!r} key")
        return metrics

    def make_optimizer(self, params: Iterable[nn.Parameter] | None = None) -> torch.optim.Optimizer:
        """The task's recommended optimizer over ``params`` (default: the model's)."""
        params = list(self.model.parameters() if params is None else params)
        if self._optimizer is not None:
            return self._optimizer(params)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def __repr__(self) -> str:
        n_params = sum(p.numel() for p in self.model.parameters())
        return (
            f"Task({self.name!r}, params={n_params}, shard={self.num_train_samples}, "
            f"metric={self.metric!r})"
        )

    @classmethod
    def from_parts(
        cls,
        ctx: TaskContext,
        *,
        model: nn.Module | Callable[[], nn.Module],
        train_dataset: Dataset | Sequence[torch.Tensor],
        eval_fn: EvalFn,
        loss_fn: LossFn | None = None,
        labels: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        metric: str = "accuracy",
        higher_is_better: bool | None = None,
        optimizer: OptimizerFn | None = None,
        batch_transform: Callable[[Batch], Batch] | None = None,
        name: str = "custom",
    ) -> Task:
        """Build a task from a model, a training set and an evaluation function.

        The training set is sharded for ``ctx`` (IID, or Dirichlet over ``labels``) and
        batched with a per-peer seeded shuffle.

        Args:
            ctx: this peer's context.
            model: a module, or a zero-argument callable building one; a callable is built
                under ``torch.manual_seed(ctx.seed)``, so every peer starts identical.
            train_dataset: a tuple of tensors with equal first dimension (e.g. ``(x, y)``,
                indexed directly: fast) or any map-style ``torch.utils.data.Dataset``
                (items collated with ``default_collate``).
            eval_fn: ``eval_fn(model) -> {"accuracy": ..., ...}`` on held-out data.
            loss_fn: ``loss_fn(model, batch)``; default cross-entropy on ``(x, y)``.
            labels: integer labels for ``partition="dirichlet"``; default: the last tensor of
                a tensor tuple, else ``train_dataset.targets``.
            batch_transform: applied to each batch before it moves to the device (e.g.
                uint8 images -> normalised floats, so the shard stays small in memory).
            metric, higher_is_better, optimizer, name: as in ``Task``.
        """
        if not isinstance(model, nn.Module):
            model = seeded_model(ctx, model)
        else:
            model = model.to(ctx.device)
        tensors = _as_tensor_tuple(train_dataset)
        mine = _shard_indices(ctx, train_dataset, tensors, labels)
        batches = _batch_source(ctx, train_dataset, tensors, mine, batch_transform)
        return cls(
            model=model,
            batches=batches,
            loss_fn=loss_fn or cross_entropy_loss,
            eval_fn=eval_fn,
            metric=metric,
            higher_is_better=higher_is_better,
            num_train_samples=len(mine),
            optimizer=optimizer,
            name=name,
        )


def _shard_indices(
    ctx: TaskContext, dataset: Any, tensors: tuple[torch.Tensor, ...] | None, labels: Any
) -> torch.Tensor:
    """Indices of this peer's training samples (IID, or Dirichlet over the labels)."""
    num_items = len(tensors[0]) if tensors is not None else len(dataset)
    if ctx.partition == "iid":
        shards = iid_partition(num_items, ctx.num_peers, ctx.seed)
    else:
        y = _find_labels(dataset, tensors, labels)
        if len(y) != num_items:
            raise ValueError(f"{len(y)} labels for {num_items} training samples")
        shards = dirichlet_partition(y, ctx.num_peers, ctx.alpha, ctx.seed)
    mine = torch.from_numpy(shards[ctx.peer_index])
    if len(mine) == 0:
        raise ValueError(
            f"peer {ctx.peer_index} got no training samples: {num_items} samples cannot "
            f"be split between {ctx.num_peers} peers (use fewer peers or more data)"
        )
    return mine


def _batch_source(
    ctx: TaskContext,
    dataset: Any,
    tensors: tuple[torch.Tensor, ...] | None,
    mine: torch.Tensor,
    batch_transform: Callable[[Batch], Batch] | None,
) -> Callable[[], Iterator[Batch]]:
    """A factory of infinite batch iterators over the shard ``mine``, shuffled per peer."""
    if tensors is not None:
        shard = tuple(t[mine] for t in tensors)

        def fetch(idx: torch.Tensor) -> Batch:
            return tuple(t[idx] for t in shard)

    else:

        def fetch(idx: torch.Tensor) -> Batch:
            return default_collate([dataset[int(i)] for i in mine[idx]])

    seed = ctx.stream_seed(1)

    def batches(start: int = 0) -> Iterator[Batch]:
        for idx in index_batches(len(mine), ctx.batch_size, seed, start):
            batch = fetch(idx)
            if batch_transform is not None:
                batch = batch_transform(batch)
            yield to_device(batch, ctx.device)

    return batches


def _as_tensor_tuple(data: Any) -> tuple[torch.Tensor, ...] | None:
    if isinstance(data, Sequence) and data and all(isinstance(t, torch.Tensor) for t in data):
        lengths = {len(t) for t in data}
        if len(lengths) != 1:
            raise ValueError(f"tensors in train_dataset differ in length: {sorted(lengths)}")
        return tuple(data)
    return None


def _find_labels(dataset: Any, tensors: tuple[torch.Tensor, ...] | None, labels: Any) -> np.ndarray:
    if labels is None and tensors is not None and tensors[-1].ndim == 1:
        labels = tensors[-1]
    if labels is None:
        labels = getattr(dataset, "targets", None)
    if labels is None:
        raise ValueError(
            "partition='dirichlet' needs integer labels: pass labels=... to Task.from_parts"
        )
    if isinstance(labels, torch.Tensor):
        labels = labels.cpu().numpy()
    return np.asarray(labels)


__all__ = [
    "PARTITIONS",
    "Task",
    "TaskContext",
    "classification_eval",
    "cross_entropy_loss",
    "index_batches",
    "seeded_model",
    "to_device",
]
