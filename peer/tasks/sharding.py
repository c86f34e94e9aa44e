"""Split a training set between peers: IID equal shards or label-skewed Dirichlet shards.

Every function here is a pure function of (data, num_peers, seed): each peer computes the same
global split and keeps its own part, so no coordination is needed and shards are disjoint and
cover the data.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

_IID_STREAM = 0x11D
_DIRICHLET_STREAM = 0xD1C


def _rng(seed: int, num_peers: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, num_peers, stream])


def iid_partition(num_items: int, num_peers: int, seed: int) -> list[np.ndarray]:
    """Shuffle 0..num_items-1 and cut it into num_peers shards whose sizes differ by <= 1.

    Returns one sorted int64 index array per peer.
    """
    _check_peers(num_peers)
    perm = _rng(seed, num_peers, _IID_STREAM).permutation(num_items)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_peers)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray,
    num_peers: int,
    alpha: float,
    seed: int,
    min_size: int | None = None,
) -> list[np.ndarray]:
    """Label-skewed non-IID split: for each class, peer shares drawn from Dirichlet(alpha).

    The recipe of Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data
    Distribution for Federated Visual Classification" (2019), in its disjoint form: for every
    class c, p_c ~ Dir(alpha * 1_n) and class c's (shuffled) samples are cut in proportions
    p_c. Small alpha gives each peer few classes; alpha -> inf approaches IID.

    Peers may end up nearly empty for small alpha, so a draw is repeated (same seed stream)
    until every shard holds at least ``min_size`` samples (default: 10% of a fair share, at
    least 1); after 100 draws the smallest shards are topped up with random samples taken from
    the largest ones. Shards stay disjoint and cover every sample.

    Returns one sorted int64 index array per peer.
    """
    _check_peers(num_peers)
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    n_items = len(y)
    if min_size is None:
        min_size = max(1, n_items // (10 * num_peers))
    min_size = min(min_size, n_items // num_peers)
    rng = _rng(seed, num_peers, _DIRICHLET_STREAM)
    classes = np.unique(y)
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in classes]
    for _draw in range(100):
        shards = _draw_dirichlet(by_class, num_peers, alpha, rng)
        if min(len(s) for s in shards) >= min_size:
            break
    else:
        logger.info("dirichlet alpha=%s: topping up shards to %s samples", alpha, min_size)
        shards = _top_up(shards, min_size, rng)
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


def _draw_dirichlet(
    by_class: list[np.ndarray], num_peers: int, alpha: float, rng: np.random.Generator
) -> list[list[int]]:
    shards: list[list[int]] = [[] for _ in range(num_peers)]
    for idx in by_class:
        p = rng.dirichlet(np.full(num_peers, alpha))
        cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
        for peer, part in enumerate(np.split(idx, cuts)):
            shards[peer].extend(part.tolist())
    return shards


def _top_up(shards: list[list[int]], min_size: int, rng: np.random.Generator) -> list[list[int]]:
    shards = [list(s) for s in shards]
    while True:
        sizes = [len(s) for s in shards]
        small, big = int(np.argmin(sizes)), int(np.argmax(sizes))
        if sizes[small] >= min_size:
            return shards
        take = min(min_size - sizes[small], sizes[big] - min_size)
        picked = set(rng.choice(sizes[big], size=take, replace=False).tolist())
        shards[small].extend(v for k, v in enumerate(shards[big]) if k in picked)
        shards[big] = [v for k, v in enumerate(shards[big]) if k not in picked]


def balanced_groups(sizes: Sequence[int], num_peers: int, seed: int) -> list[list[int]]:
    """Assign whole groups (e.g. plays) to peers, balancing total size (largest first).

    Greedy longest-processing-time assignment; ties between equal sizes are broken by a
    seeded shuffle. Returns, per peer, the sorted group indices it owns. Needs at least as
    many groups as peers.
    """
    _check_peers(num_peers)
    if len(sizes) < num_peers:
        raise ValueError(f"{len(sizes)} groups cannot be split between {num_peers} peers")
    order = _rng(seed, num_peers, _IID_STREAM + 1).permutation(len(sizes))
    order = sorted(order.tolist(), key=lambda g: -sizes[g])
    load = [0] * num_peers
    groups: list[list[int]] = [[] for _ in range(num_peers)]
    for g in order:
        peer = min(range(num_peers), key=lambda p: (load[p], p))
        groups[peer].append(g)
        load[peer] += sizes[g]
    return [sorted(g) for g in groups]


def _check_peers(num_peers: int) -> None:
    if num_peers < 1:
        raise ValueError(f"num_peers must be >= 1, got {num_peers}")
