"""Image classification tasks: ``digits`` (smoke test) and two Fashion-MNIST models.

Models hold parameters only (no BatchNorm or other buffers): peers gossip parameters, so any
state outside ``parameters()`` would silently diverge between peers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from gossipgrad.peer.tasks.base import Task, TaskContext, classification_eval
from gossipgrad.peer.tasks.data import load_digits, load_fashion_mnist
from torch import nn

logger = logging.getLogger(__name__)

DIGITS_TEST_SIZE = 360
"""Held-out digits (20%), fixed for every seed so runs compare on the same test set."""
_DIGITS_SPLIT_SEED = 20191101
_FMNIST_EVAL_SEED = 20170825
FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530
FMNIST_CNN_EVAL_SAMPLES = 2000
"""Default held-out subsample for the CNN (the MLP evaluates on all 10k test images)."""


def digits_mlp() -> nn.Module:
    """64-128-128-10 MLP for the 8x8 digits (26k parameters)."""
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


def fashion_mlp() -> nn.Module:
    """784-512-512-10 MLP (670k parameters)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def fashion_cnn(batchnorm: bool = False) -> nn.Module:
    """Two 3x3 conv layers (16, 32 channels) with max-pooling, then 1568-64-10 (106k params);
    ``batchnorm``: a BatchNorm after each convolution (96 running statistics), the model for
    measuring the buffers' gossip (``gossip.buffers``)."""

    def norm(channels: int) -> list[nn.Module]:
        return [nn.BatchNorm2d(channels)] if batchnorm else []

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        *norm(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        *norm(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def fashion_cnn_bn() -> nn.Module:
    """``fashion_cnn`` with BatchNorm."""
    return fashion_cnn(batchnorm=True)


def _sgd(lr: float):
    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return make


def digits_task(ctx: TaskContext) -> Task:
    """sklearn digits, 1437 training / 360 test images, small MLP: seconds to ~95% accuracy."""
    x, y = load_digits()
    perm = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(y))
    test, train = perm[:DIGITS_TEST_SIZE], perm[DIGITS_TEST_SIZE:]
    x_t = torch.from_numpy(x / 16.0).float()
    y_t = torch.from_numpy(y)
    test_idx = torch.from_numpy(test[: ctx.eval_samples] if ctx.eval_samples else test)
    return Task.from_parts(
        ctx,
        model=digits_mlp,
        train_dataset=(x_t[torch.from_numpy(train)], y_t[torch.from_numpy(train)]),
        eval_fn=classification_eval(x_t[test_idx], y_t[test_idx]),
        metric="accuracy",
        optimizer=_sgd(0.05),
        name="digits",
    )


def _normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 N x 28 x 28 -> float N x 1 x 28 x 28, standardised."""
    return ((images.float() / 255.0 - FMNIST_MEAN) / FMNIST_STD).unsqueeze(1)


def _fashion_task(ctx: TaskContext, *, cnn: bool, batchnorm: bool = False) -> Task:
    images, labels = load_fashion_mnist("train")
    test_images, test_labels = load_fashion_mnist("test")
    n_eval = ctx.eval_samples or (FMNIST_CNN_EVAL_SAMPLES if cnn else len(test_labels))
    pick = np.random.default_rng(_FMNIST_EVAL_SEED).permutation(len(test_labels))[:n_eval]
    pick = torch.from_numpy(np.sort(pick))
    return Task.from_parts(
        ctx,
        model=(fashion_cnn_bn if batchnorm else fashion_cnn) if cnn else fashion_mlp,
        # uint8 images (47 MB) stay compact; batches are normalised when drawn.
        train_dataset=(torch.from_numpy(images), torch.from_numpy(labels)),
        eval_fn=classification_eval(
            torch.from_numpy(test_images)[pick],
            torch.from_numpy(test_labels)[pick],
            transform=_normalize,
        ),
        metric="accuracy",
        batch_transform=lambda batch: (_normalize(batch[0]), batch[1]),
        optimizer=_sgd(0.05 if cnn else 0.02),
        name=("fashion-mnist-cnn-bn" if batchnorm else "fashion-mnist-cnn")
        if cnn
        else "fashion-mnist-mlp",
    )


def fashion_mnist_mlp_task(ctx: TaskContext) -> Task:
    """Fashion-MNIST (60k train / 10k test) with a 784-512-512-10 MLP."""
    return _fashion_task(ctx, cnn=False)


def fashion_mnist_cnn_task(ctx: TaskContext) -> Task:
    """Fashion-MNIST with a small CNN (~106k parameters); evaluates on 2,000 test images."""
    return _fashion_task(ctx, cnn=True)


def fashion_mnist_cnn_bn_task(ctx: TaskContext) -> Task:
    """The Fashion-MNIST CNN with BatchNorm (its buffers are gossiped, see gossip.buffers)."""
    return _fashion_task(ctx, cnn=True, batchnorm=True)


__all__ = [
    "digits_mlp",
    "digits_task",
    "fashion_cnn",
    "fashion_cnn_bn",
    "fashion_mlp",
    "fashion_mnist_cnn_bn_task",
    "fashion_mnist_cnn_task",
    "fashion_mnist_mlp_task",
]
