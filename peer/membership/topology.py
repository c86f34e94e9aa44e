"""Gossip topologies over peers indexed 0..n-1 (their mixing weights: ``weights.py``).

Pure functions of (peer index, swarm size, round): no gRPC, no state that differs between
peers, so every peer computes the same graph from the same sorted list of peer ids. Every graph
here is undirected (j in N(i) <=> i in N(j)), has no self loops, and is connected (for a
time-varying graph: the union over one period of rounds is connected).

Topologies (see docs/topologies.md):

- ``ring``: i-1 and i+1 (mod n).
- ``torus``: a 2-D grid with wrap-around, as square as n allows (prime n: the ring).
- ``full``: everybody.
- ``random-regular``: a random d-regular graph, the same for every peer given (seed, n, d).
- ``exponential``: i +- 2^k (mod n) for 2^k < n, the static exponential graph of Ying et al.,
  "Exponential Graph is Provably Efficient for Decentralized Deep Training", NeurIPS 2021,
  symmetrised.
- ``one-peer-exponential``: one partner per round, i XOR 2^(r mod tau), tau = ceil(log2 n);
  a perfect matching when n is a power of two, otherwise peers whose partner does not exist
  sit the round out.
"""

from __future__ import annotations

import functools
import logging
import math
from abc import ABC, abstractmethod

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_DEGREE = 3
"""Degree of ``random-regular`` when none is given."""


def _check(i: int, n: int) -> None:
    if n < 1:
        raise ValueError(f"swarm size n must be >= 1, got {n}")
    if not 0 <= i < n:
        raise ValueError(f"peer index {i} out of range for n={n} (valid: 0..{n - 1})")


class Topology(ABC):
    """A (possibly time-varying) undirected communication graph over peers 0..n-1."""

    name: str = ""
    time_varying: bool = False

    @abstractmethod
    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        """Peer i's neighbours in round ``round``: sorted, symmetric, never i itself."""

    def period(self, n: int) -> int:
        """Number of rounds after which the graph repeats (1 for static graphs)."""
        return 1

    def all_neighbors(self, i: int, n: int) -> list[int]:
        """Every peer that i ever talks to: the union of ``neighbors`` over one period."""
        _check(i, n)
        out: set[int] = set()
        for r in range(self.period(n)):
            out.update(self.neighbors(i, n, r))
        return sorted(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Ring(Topology):
    """Each peer talks to its two ring neighbours i-1 and i+1 (mod n)."""

    name = "ring"

    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        _check(i, n)
        return sorted({(i - 1) % n, (i + 1) % n} - {i})


class Full(Topology):
    """Complete graph: every peer talks to every other peer (dense; small swarms only)."""

    name = "full"

    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        _check(i, n)
        return [j for j in range(n) if j != i]


class Torus(Topology):
    """2-D torus: peers on a rows x cols grid with wrap-around, four neighbours each.

    rows is the largest divisor of n not above sqrt(n), so the grid is as square as n allows;
    a prime n gives a 1 x n grid, which is the ring. Sides of length 2 give fewer distinct
    neighbours (up and down coincide); MH weights handle the uneven degrees.
    """

    name = "torus"

    @staticmethod
    def shape(n: int) -> tuple[int, int]:
        """(rows, cols) of the grid used for n peers."""
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        return rows, n // rows

    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        _check(i, n)
        rows, cols = self.shape(n)
        r, c = divmod(i, cols)
        out = {
            ((r - 1) % rows) * cols + c,
            ((r + 1) % rows) * cols + c,
            r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols,
        }
        out.discard(i)
        return sorted(out)


class Exponential(Topology):
    """Static exponential graph (Ying et al. 2021): neighbours at i +- 2^k for 2^k < n.

    The original graph is directed (i -> i + 2^k); here it is symmetrised so that mixing
    weights can be symmetric and doubly stochastic. Degree is at most 2*ceil(log2 n).
    """

    name = "exponential"

    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        _check(i, n)
        out: set[int] = set()
        hop = 1
        while hop < n:
            out.add((i + hop) % n)
            out.add((i - hop) % n)
            hop *= 2
        out.discard(i)
        return sorted(out)


class OnePeerExponential(Topology):
    """Time-varying one-peer exponential graph: a single partner per round.

    With tau = ceil(log2 n), peer i's partner in round r is ``i XOR 2^(r mod tau)``: the
    hypercube's dimension ``r mod tau``. The relation is an involution, so it is symmetric in
    every round, and for n a power of two each round is a perfect matching (Ying et al. 2021,
    section on one-peer exponential graphs, use the same hop cycle with +2^k; XOR keeps it
    symmetric). For other n, a partner index >= n does not exist and peer i sits the round out
    (empty neighbour list). The union over tau rounds is the hypercube restricted to 0..n-1,
    which is connected: clearing the highest set bit of i walks to 0 through indices < i.
    """

    name = "one-peer-exponential"
    time_varying = True

    def period(self, n: int) -> int:
        return max(1, (n - 1).bit_length())

    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        _check(i, n)
        if n == 1:
            return []
        partner = i ^ (1 << (round % self.period(n)))
        return [partner] if partner < n else []


class RandomRegular(Topology):
    """A random d-regular graph, identical on every peer for the same (seed, n, d).

    The degree is clipped to n-1 (a full graph); when n*d is odd no d-regular graph exists
    and d+1 is used instead. Graphs are drawn by randomized stub pairing that only accepts
    simple edges, redrawn until connected, so every peer gets the same connected graph.
    """

    name = "random-regular"

    def __init__(self, degree: int = DEFAULT_DEGREE, seed: int = 0) -> None:
        if degree < 2:
            raise ValueError(
                f"random-regular needs degree >= 2 (degree 1 is a disconnected matching), "
                f"got {degree}"
            )
        self.degree = degree
        self.seed = seed

    def effective_degree(self, n: int) -> int:
        """The degree actually used for a swarm of n peers (see the class docstring)."""
        d = min(self.degree, n - 1)
        if (n * d) % 2 == 1:
            d += 1
        return d

    def neighbors(self, i: int, n: int, round: int = 0) -> list[int]:
        _check(i, n)
        return list(_random_regular_graph(n, self.effective_degree(n), self.seed)[i])

    def __repr__(self) -> str:
        return f"RandomRegular(degree={self.degree}, seed={self.seed})"


@functools.lru_cache(maxsize=64)
def _random_regular_graph(n: int, d: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Adjacency lists of a connected simple d-regular graph on n nodes (n*d even, d < n)."""
    if d >= n - 1:
        return tuple(tuple(j for j in range(n) if j != i) for i in range(n))
    rng = np.random.default_rng([seed, n, d])
    for _attempt in range(10_000):
        adj = _try_pair_stubs(n, d, rng)
        if adj is not None and _is_connected([sorted(a) for a in adj]):
            return tuple(tuple(sorted(a)) for a in adj)
    raise RuntimeError(f"could not draw a connected {d}-regular graph on {n} nodes")


def _try_pair_stubs(n: int, d: int, rng: np.random.Generator) -> list[set[int]] | None:
    """One attempt at pairing n*d stubs into simple edges; None when it gets stuck."""
    stubs = [v for v in range(n) for _ in range(d)]
    rng.shuffle(stubs)
    adj: list[set[int]] = [set() for _ in range(n)]
    while stubs:
        u = stubs.pop()
        ok = [k for k, v in enumerate(stubs) if v != u and v not in adj[u]]
        if not ok:
            return None
        v = stubs.pop(ok[int(rng.integers(len(ok)))])
        adj[u].add(v)
        adj[v].add(u)
    return adj


def _is_connected(adj: list[list[int]]) -> bool:
    if not adj:
        return True
    seen = {0}
    stack = [0]
    while stack:
        for v in adj[stack.pop()]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return len(seen) == len(adj)


TOPOLOGIES: tuple[str, ...] = (
    "ring",
    "torus",
    "full",
    "random-regular",
    "exponential",
    "one-peer-exponential",
)


def topology_from_name(name: str, seed: int = 0, degree: int | None = None) -> Topology:
    """Build a topology by name (``_`` and ``-`` are interchangeable).

    Args:
        name: one of ``TOPOLOGIES``.
        seed: seed of ``random-regular`` (all peers must pass the same one).
        degree: degree of ``random-regular`` (default ``DEFAULT_DEGREE``); the other
            topologies have a fixed shape and reject it.

    Raises:
        ValueError: unknown name, or a degree given to a topology without one.
    """
    key = name.strip().lower().replace("_", "-")
    if key not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; valid: {', '.join(TOPOLOGIES)}")
    if key == "random-regular":
        return RandomRegular(DEFAULT_DEGREE if degree is None else degree, seed)
    if degree is not None:
        raise ValueError(
            f"topology {key!r} has a fixed shape and takes no degree (got degree={degree}); "
            "drop the degree or use 'random-regular'"
        )
    return {
        "ring": Ring,
        "torus": Torus,
        "full": Full,
        "exponential": Exponential,
        "one-peer-exponential": OnePeerExponential,
    }[key]()
