"""Mixing weights over a topology: Metropolis-Hastings rows, the dense matrix, its gap.

Each peer computes its own row from the degrees of its neighbours only, so weights follow the
live topology under churn without any coordination.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gossipgrad.peer.membership.topology import Topology


def metropolis_hastings_weights(
    i: int, neighbors_of: Callable[[int], list[int]]
) -> dict[int, float]:
    """Peer i's row of the Metropolis-Hastings mixing matrix.

    w_ij = 1 / (1 + max(deg_i, deg_j)) for j in N(i), w_ii = 1 - sum_j w_ij (Xiao & Boyd,
    "Fast linear iterations for distributed averaging", 2004). Over an undirected graph the
    full matrix is symmetric and doubly stochastic, which is what gossip averaging needs;
    only the degrees of i's neighbours are required, so each peer computes its own row.

    Args:
        i: this peer.
        neighbors_of: neighbour list of any peer (for the round at hand), e.g.
            ``lambda j: topo.neighbors(j, n, r)``; restrict it to peers present to handle churn.

    Returns:
        {j: w_ij} for j in N(i) and for i itself.
    """
    nbrs = neighbors_of(i)
    deg_i = len(nbrs)
    weights = {j: 1.0 / (1.0 + max(deg_i, len(neighbors_of(j)))) for j in nbrs}
    weights[i] = 1.0 - sum(weights.values())
    return weights


def mixing_matrix(topology: Topology, n: int, round: int = 0) -> np.ndarray:
    """The dense n x n Metropolis-Hastings matrix of ``topology`` in ``round`` (for analysis)."""
    w = np.zeros((n, n))
    for i in range(n):
        for j, v in metropolis_hastings_weights(
            i, lambda k: topology.neighbors(k, n, round)
        ).items():
            w[i, j] = v
    return w


def spectral_gap(w: np.ndarray) -> float:
    """1 - |lambda_2| of a symmetric mixing matrix: how fast gossip averaging contracts."""
    eig = np.sort(np.abs(np.linalg.eigvalsh(w)))[::-1]
    return float(1.0 - eig[1]) if len(eig) > 1 else 1.0
