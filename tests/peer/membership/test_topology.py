"""Topologies: symmetry, connectivity, MH weights (symmetric, doubly stochastic, gap > 0)."""

from __future__ import annotations

import numpy as np
import pytest
from gossipgrad.peer.membership.topology import (
    TOPOLOGIES,
    OnePeerExponential,
    Topology,
    topology_from_name,
)
from gossipgrad.peer.membership.weights import (
    metropolis_hastings_weights,
    mixing_matrix,
    spectral_gap,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SIZES = range(1, 34)


def _all(seed: int = 0) -> list[Topology]:
    return [topology_from_name(name, seed=seed) for name in TOPOLOGIES]


def _connected(adj: dict[int, list[int]], n: int) -> bool:
    seen, stack = {0}, [0]
    while stack:
        for v in adj[stack.pop()]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return len(seen) == n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_symmetric_sorted_no_self_and_connected(name: str) -> None:
    topo = topology_from_name(name, seed=3)
    for n in SIZES:
        rounds = range(2 * max(1, (n - 1).bit_length()) + 1) if topo.time_varying else [0, 5]
        for r in rounds:
            for i in range(n):
                nb = topo.neighbors(i, n, r)
                assert nb == sorted(set(nb)), (name, n, i, r, nb)
                assert i not in nb
                assert all(0 <= j < n for j in nb)
                for j in nb:
                    assert i in topo.neighbors(j, n, r), (name, n, i, j, r)
        union = {i: topo.all_neighbors(i, n) for i in range(n)}
        assert _connected(union, n), (name, n, union)
        for i in range(n):
            for j in union[i]:
                assert i in union[j]


@pytest.mark.timeout(30)
def test_static_topologies_do_not_vary_with_round() -> None:
    for topo in _all():
        if topo.time_varying:
            continue
        for n in (5, 16, 17):
            for i in range(n):
                static = topo.all_neighbors(i, n)
                assert topo.neighbors(i, n, 0) == topo.neighbors(i, n, 7) == static


@pytest.mark.timeout(30)
def test_shapes_of_known_topologies() -> None:
    ring, full = topology_from_name("ring"), topology_from_name("full")
    assert ring.neighbors(0, 8) == [1, 7]
    assert ring.neighbors(0, 2) == [1]
    assert full.neighbors(2, 4) == [0, 1, 3]
    torus = topology_from_name("torus")
    assert torus.neighbors(0, 16) == [1, 3, 4, 12]  # 4 x 4 grid
    assert torus.neighbors(5, 12) == [1, 4, 6, 9]  # 3 x 4 grid
    assert torus.neighbors(0, 7) == ring.neighbors(0, 7)  # prime n: 1 x 7, the ring
    expo = topology_from_name("exponential")
    assert expo.neighbors(0, 16) == [1, 2, 4, 8, 12, 14, 15]
    assert expo.neighbors(0, 1) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("degree", [2, 3, 4, 5, 8])
def test_random_regular_is_regular_and_seeded(degree: int) -> None:
    for n in range(2, 34):
        topo = topology_from_name("random-regular", seed=11, degree=degree)
        d = topo.effective_degree(n)
        assert d == min(n - 1, degree) or (d == degree + 1 and (n * degree) % 2 == 1)
        assert all(len(topo.neighbors(i, n)) == d for i in range(n))
        again = topology_from_name("random-regular", seed=11, degree=degree)
        assert [again.neighbors(i, n) for i in range(n)] == [topo.neighbors(i, n) for i in range(n)]
    a = topology_from_name("random-regular", seed=1, degree=3)
    b = topology_from_name("random-regular", seed=2, degree=3)
    assert [a.neighbors(i, 30) for i in range(30)] != [b.neighbors(i, 30) for i in range(30)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_one_peer_exponential_is_perfect_matching_for_powers_of_two(n: int) -> None:
    topo = OnePeerExponential()
    tau = n.bit_length() - 1
    partners_per_peer: dict[int, set[int]] = {i: set() for i in range(n)}
    for r in range(2 * tau):
        matched = []
        for i in range(n):
            nb = topo.neighbors(i, n, r)
            assert len(nb) == 1
            assert topo.neighbors(nb[0], n, r) == [i]
            matched.append(nb[0])
            partners_per_peer[i].add(nb[0])
        assert sorted(matched) == list(range(n))
        # the hop cycles through 2^k: round r and r + tau pair the same peers
        assert [topo.neighbors(i, n, r) for i in range(n)] == [
            topo.neighbors(i, n, r + tau) for i in range(n)
        ]
    assert all(len(p) == tau for p in partners_per_peer.values())


@pytest.mark.timeout(30)
def test_one_peer_exponential_other_sizes_idle_at_most_unmatched() -> None:
    topo = OnePeerExponential()
    for n in (3, 5, 6, 7, 9, 12, 33):
        for r in range(topo.period(n)):
            degs = [len(topo.neighbors(i, n, r)) for i in range(n)]
            assert max(degs) <= 1
            assert sum(degs) > 0


@pytest.mark.timeout(30)
def test_bad_names_and_degrees() -> None:
    with pytest.raises(ValueError, match="valid: ring"):
        topology_from_name("torus-of-doom")
    with pytest.raises(ValueError, match="degree"):
        topology_from_name("ring", degree=3)
    with pytest.raises(ValueError, match="degree >= 2"):
        topology_from_name("random-regular", degree=1)
    with pytest.raises(ValueError, match="out of range"):
        topology_from_name("ring").neighbors(5, 4)
    assert topology_from_name("One_Peer_Exponential").time_varying


def _check_mixing(w: np.ndarray) -> None:
    assert np.allclose(w, w.T, atol=1e-12)
    assert np.allclose(w.sum(axis=0), 1.0, atol=1e-12)
    assert np.allclose(w.sum(axis=1), 1.0, atol=1e-12)
    assert (w >= -1e-12).all()


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=33),
    name=st.sampled_from(TOPOLOGIES),
    seed=st.integers(min_value=0, max_value=2**16),
    degree=st.integers(min_value=2, max_value=9),
    rnd=st.integers(min_value=0, max_value=40),
)
def test_mh_matrix_symmetric_doubly_stochastic_with_gap(
    n: int, name: str, seed: int, degree: int, rnd: int
) -> None:
    topo = topology_from_name(name, seed=seed, degree=degree if name == "random-regular" else None)
    w = mixing_matrix(topo, n, rnd)
    _check_mixing(w)
    # Zero entries exactly where there is no edge.
    for i in range(n):
        nb = set(topo.neighbors(i, n, rnd))
        for j in range(n):
            if j != i:
                assert (w[i, j] > 0) == (j in nb)
    if not topo.time_varying and n > 1:
        assert spectral_gap(w) > 1e-9
    if topo.time_varying and n > 1:
        # One round is a matching, not connected; the product over one period contracts.
        prod = np.eye(n)
        for r in range(topo.period(n)):
            prod = mixing_matrix(topo, n, rnd + r) @ prod
        assert np.allclose(prod.sum(axis=0), 1.0) and np.allclose(prod.sum(axis=1), 1.0)
        sv = np.linalg.svd(prod - np.full((n, n), 1.0 / n), compute_uv=False)
        assert sv.max() < 1.0 - 1e-9


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=33),
    seed=st.integers(min_value=0, max_value=1000),
    churn=st.data(),
)
def test_mh_weights_on_present_peers_after_churn(n: int, seed: int, churn: st.DataObject) -> None:
    """Restricting a graph to the peers present still gives a valid mixing matrix."""
    topo = topology_from_name("random-regular", seed=seed, degree=3)
    gone = churn.draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=n - 1))
    present = [i for i in range(n) if i not in gone]

    def nbrs(k: int) -> list[int]:
        return [j for j in topo.neighbors(k, n) if j not in gone]

    m = len(present)
    pos = {p: k for k, p in enumerate(present)}
    w = np.zeros((m, m))
    for i in present:
        for j, v in metropolis_hastings_weights(i, nbrs).items():
            w[pos[i], pos[j]] = v
    _check_mixing(w)


@pytest.mark.timeout(30)
def test_mh_weight_formula() -> None:
    ring = topology_from_name("ring")
    w = metropolis_hastings_weights(0, lambda k: ring.neighbors(k, 5))
    assert w == pytest.approx({1: 1 / 3, 4: 1 / 3, 0: 1 / 3})
    # star: the hub has degree 3, leaves degree 1
    star = {0: [1, 2, 3], 1: [0], 2: [0], 3: [0]}
    assert metropolis_hastings_weights(1, star.__getitem__) == pytest.approx({0: 0.25, 1: 0.75})
    assert metropolis_hastings_weights(0, star.__getitem__) == pytest.approx(
        {1: 0.25, 2: 0.25, 3: 0.25, 0: 0.25}
    )
    gaps = {
        name: spectral_gap(mixing_matrix(topology_from_name(name), 16))
        for name in ("ring", "exponential", "full")
    }
    assert gaps["ring"] < gaps["exponential"] < gaps["full"]
