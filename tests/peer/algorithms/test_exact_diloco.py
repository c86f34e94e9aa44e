"""Algorithm exact-diloco: every peer's compressed pseudo-gradient reaches every peer.

Laws: over ring, exponential and one-peer-exponential graphs the spanning-tree routes deliver
each message to every peer exactly once, n − 1 sends per message (a pure simulation, any
delivery order); error feedback loses nothing (sent + residual == input, bit for bit in the
codec's arithmetic); real gRPC peers on 127.0.0.1 end every phase with bit-identical anchors,
each having received each other peer's message once.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from gossipgrad.compression import ErrorFeedback, from_spec
from gossipgrad.peer.algorithms import ExactDiLoCo
from gossipgrad.peer.algorithms.dissemination import (
    Message,
    Offer,
    PhaseStore,
    spanning_children,
)
from gossipgrad.peer.algorithms.footprint import gossip_state_bytes
from gossipgrad.peer.config import build_config
from gossipgrad.peer.flat import tensor_checksum
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.optimizers import gossip_optimizer, start_optimizers
from support.threads import on_threads

pytestmark = pytest.mark.timeout(120)

GRAPHS = ["ring", "exponential", "one-peer-exponential"]


# ---------------------------------------------------------------------- dissemination


def disseminate(topology: str, n: int, order_seed: int) -> tuple[dict, int]:
    """Every peer's message of one phase, forwarded by each peer's PhaseStore and routes,
    with deliveries taken from the wire in a random order. Returns how often each peer
    received each origin's message, and the sends in all."""
    topo = topology_from_name(topology)
    ids = sorted(f"p{i:03d}" for i in range(n))
    stores = {p: PhaseStore() for p in ids}
    received = {p: {} for p in ids}
    wire: list[tuple[str, str, Message]] = []  # (from, to, message)
    rng = random.Random(order_seed)

    def forward(at: str, message: Message, skip: str = "") -> None:
        for child in spanning_children(topo, ids, message.origin, at):
            if child != skip:
                wire.append((at, child, message))

    for p in ids:
        own = Message(p, 0, p.encode(), 0)
        assert stores[p].offer(own, ids) is Offer.NEW
        forward(p, own)
    sends = 0
    while wire:
        sender, to, message = wire.pop(rng.randrange(len(wire)))
        sends += 1
        counts = received[to]
        counts[message.origin] = counts.get(message.origin, 0) + 1
        if stores[to].offer(message, ids) is Offer.NEW:
            forward(to, message, skip=sender)
    for p in ids:
        assert stores[p].holds(0) == set(ids)
        assert [m.origin for m in stores[p].close(0)] == ids  # one order everywhere
    return received, sends


@settings(max_examples=40, deadline=None)
@given(
    topology=st.sampled_from(GRAPHS),
    n=st.integers(1, 33),
    order_seed=st.integers(0, 2**16),
)
@example(topology="ring", n=70, order_seed=1)
@example(topology="exponential", n=70, order_seed=2)
@example(topology="one-peer-exponential", n=70, order_seed=3)
def test_every_message_reaches_every_peer_exactly_once(topology, n, order_seed) -> None:
    received, sends = disseminate(topology, n, order_seed)
    for p, counts in received.items():
        assert p not in counts  # its own message never comes back
        assert counts == {o: 1 for o in received if o != p}, (p, counts)
    assert sends == n * (n - 1)  # n − 1 sends per message: upload n − 1 per peer on average


@pytest.mark.parametrize("topology", GRAPHS)
def test_trees_are_shallow_where_the_graph_is(topology: str) -> None:
    # Hops from the origin to the deepest peer: n / 2 on a ring, log2 n on the hypercube
    # (one-peer-exponential's rounds together), fewer on the symmetrised exponential graph.
    n = 32
    topo = topology_from_name(topology)
    ids = [f"p{i:02d}" for i in range(n)]
    depth, frontier, hops = {ids[5]: 0}, [ids[5]], 0
    while frontier:
        hops += 1
        frontier = [c for p in frontier for c in spanning_children(topo, ids, ids[5], p)]
        depth.update({c: hops for c in frontier})
    assert len(depth) == n
    expected = {"ring": n // 2, "exponential": 3, "one-peer-exponential": 5}[topology]
    assert max(depth.values()) == expected


def test_store_is_bounded_and_takes_no_late_or_unknown_message() -> None:
    store = PhaseStore(max_ahead=2)
    known = {"a", "b"}
    assert store.offer(Message("a", 0, b"x", 1), known) is Offer.NEW
    assert store.offer(Message("a", 0, b"x", 1), known) is Offer.DUPLICATE
    assert store.offer(Message("b", 1, b"y", 1), known) is Offer.NEW
    assert store.offer(Message("b", 2, b"y", 1), known) is Offer.EARLY
    assert store.offer(Message("c", 0, b"z", 1), known) is Offer.UNKNOWN
    assert [m.origin for m in store.close(0)] == ["a"]
    assert store.offer(Message("b", 0, b"y", 1), known) is Offer.LATE
    assert store.offer(Message("b", 2, b"y", 1), known) is Offer.NEW
    assert store.lookup("a", 0) is not None  # closed, kept to answer a peer that asks
    assert store.held() == 3
    store.close(1)
    store.close(2)
    assert store.lookup("a", 0) is None and store.held() == 2  # KEEP_CLOSED phases only


# ---------------------------------------------------------------------- error feedback


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from(["topk:0.05+int2", "topk:0.015+int2", "topk:0.2+int8", "sign"]),
    phases=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_loses_nothing(codec: str, phases: int, seed: int) -> None:
    # What went out (decoded, as every receiver applies it) plus the residual is what was put
    # in, over any number of phases: the residual is reduced by decoding the bytes sent.
    gen = torch.Generator().manual_seed(seed)
    ef = ErrorFeedback(from_spec(codec))
    fed = torch.zeros(300, dtype=torch.float64)
    sent = torch.zeros(300, dtype=torch.float64)
    for _ in range(phases):
        anchor = torch.randn(300, generator=gen)
        theta = anchor - 0.1 * torch.randn(300, generator=gen)
        fed += (anchor - theta).double()
        data = ef.compress_difference("v", anchor, theta)
        out = torch.zeros(300)
        ef.codec.decode_add_(data, out)
        sent += out.double()
    residual = ef.residual("v").double()
    assert torch.allclose(sent + residual, fed, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- real peers


def step_all(opts: list[GossipOptimizer], targets: list[torch.Tensor]) -> None:
    """One inner 'step' per peer on its own thread: θ := target, then the algorithm."""

    def work(o: GossipOptimizer, target: torch.Tensor) -> None:
        with o.state_lock:
            o.flat.data.copy_(target)
            o.local_step += 1
        o.after_local_step()

    on_threads(work, zip(opts, targets, strict=True))


@pytest.mark.parametrize("topology", GRAPHS)
def test_real_peers_end_every_phase_with_identical_anchors(topology: str) -> None:
    n, phases = 5, 4
    opts = start_optimizers(
        n, algorithm="exact-diloco", topology=topology, codec="int8", local_steps=2
    )
    try:
        gen = torch.Generator().manual_seed(3)
        numel = opts[0].flat.numel
        algos = [o.algorithm for o in opts]
        assert all(isinstance(a, ExactDiLoCo) for a in algos)
        start = algos[0].anchor.clone()
        for phase in range(phases):
            for _ in range(2):
                step_all(
                    opts, [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts]
                )
            assert all(a.round == phase + 1 for a in algos)
            for a in algos:  # every peer's message of the phase, applied at every peer
                assert torch.equal(a.anchor, algos[0].anchor), (topology, phase)
                assert a.last_applied == sorted(o.peer.id for o in opts)
            for o in opts:
                assert torch.equal(o.flat.data, o.algorithm.anchor)
        assert not torch.equal(start, algos[0].anchor)
        sums = [a.anchor_checksums() for a in algos]
        assert all(s == sums[0] for s in sums) and len(sums[0]) == phases + 1
        for a in algos:
            assert a.mismatches == 0 and a.resyncs == 0
        # Each peer received each other peer's message of each phase once, and the swarm
        # sent each message n − 1 times (a retried push that had landed is not taken twice).
        assert [a.received for a in algos] == [phases * (n - 1)] * n
        assert sum(a.forwarded for a in algos) == phases * n * (n - 1)
    finally:
        for o in opts:
            o.close()


def test_a_replica_that_differs_takes_the_swarms_anchor_and_reconverges() -> None:
    # One peer's anchor is knocked off (as a phase closed without a message would leave it):
    # the next phase's messages carry the checksums, it sees it holds the minority replica,
    # takes the majority's anchor whole, and within two phases every anchor is the same again.
    n = 4
    opts = start_optimizers(n, algorithm="exact-diloco", topology="exponential", local_steps=1)
    try:
        gen = torch.Generator().manual_seed(5)
        numel = opts[0].flat.numel
        algos = [o.algorithm for o in opts]

        def phase() -> None:
            step_all(opts, [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts])

        phase()
        odd = algos[2]
        with torch.no_grad(), odd.state_lock:
            odd.anchor.add_(0.01)
            odd.flat.data.copy_(odd.anchor)
            odd._checksum = tensor_checksum(odd.anchor)
        phase()  # the mismatch is seen; the odd peer asks for the majority's anchor
        assert odd.mismatches == n - 1 and [a.mismatches for a in algos].count(1) == n - 1
        deadline = time.monotonic() + 10
        while odd._resync is None:  # the anchor on its way
            assert time.monotonic() < deadline, "no anchor came"
            time.sleep(0.02)
        phase()  # taken at the phase's end
        phase()
        assert odd.resyncs == 1
        for a in algos:
            assert torch.equal(a.anchor, algos[0].anchor)
        assert len({a.anchor_checksums()[a.round] for a in algos}) == 1
    finally:
        for o in opts:
            o.close()


def test_footprint_is_anchor_and_residual() -> None:
    g = build_config({}, {"gossip.algorithm": "exact-diloco"}).gossip
    assert gossip_state_bytes(g, degree=6, model_bytes=1000) == 2000  # no copies per edge
    opts = start_optimizers(2, algorithm="exact-diloco", local_steps=1)
    try:
        step_all(opts, [o.flat.data + 0.1 for o in opts])
        a = opts[0].algorithm
        kept = [a.anchor, a.residual]
        assert sum(t.numel() * t.element_size() for t in kept) == 2 * opts[0].flat.nbytes
        assert a.momentum is None
    finally:
        for o in opts:
            o.close()


def test_a_joiner_whose_state_predates_a_phase_end_ends_that_phase_with_the_swarm() -> None:
    # A donor serves a joiner's state from another thread at any moment, also between an
    # optimizer step that ends a phase and that phase's end (which waits for every member's
    # message, the joiner's included). The joiner then starts from the step before: its next
    # step ends the same phase, its message is among the phase's, and the three replicas
    # agree from there on. (Started at the donor's step, it ended its phases one behind the
    # swarm's for the rest of the run, and the donors waited each phase for its message.)
    opts = start_optimizers(2, algorithm="exact-diloco", codec="int8", local_steps=2)
    joiner = gossip_optimizer(
        "p2", [opts[0].peer.address], algorithm="exact-diloco", codec="int8", local_steps=2
    )
    everyone = [*opts, joiner]
    try:
        for o in everyone:
            assert o.wait_for_peers(3, 20)
        gen = torch.Generator().manual_seed(8)
        numel = joiner.flat.numel

        def moved(o: GossipOptimizer) -> torch.Tensor:
            return o.flat.data + 0.05 * torch.randn(numel, generator=gen)

        step_all(opts, [moved(o) for o in opts])  # step 1
        for o, target in zip(opts, [moved(o) for o in opts], strict=True):  # step 2, no round
            with o.state_lock:
                o.flat.data.copy_(target)
                o.local_step += 1
        state = opts[0].state_dict(for_joiner=True)
        assert (state["local_step"], state["gossip"]["phase"]) == (1, 0)
        joiner.load_state_dict(state)
        assert joiner.local_step == 1

        target = moved(joiner)

        def finish_step(o: GossipOptimizer) -> None:
            if o is joiner:  # its step 2, then the phase end all three run together
                with o.state_lock:
                    o.flat.data.copy_(target)
                    o.local_step += 1
            o.after_local_step()

        on_threads(finish_step, [(o,) for o in everyone])
        # Once step 2's phase end is applied, a joiner's state says step 2 (with phase 1).
        later = opts[0].state_dict(for_joiner=True)
        assert (later["local_step"], later["gossip"]["phase"]) == (2, 1)
        algos = [o.algorithm for o in everyone]
        assert [a.round for a in algos] == [1, 1, 1]
        assert all(a.last_applied == ["p0", "p1", "p2"] for a in algos)
        for _ in range(2):  # the next phase, all three in step
            step_all(everyone, [moved(o) for o in everyone])
        assert [a.round for a in algos] == [2, 2, 2]
        for a in algos:
            assert torch.equal(a.anchor, algos[0].anchor)
            assert a.mismatches == 0 and a.resyncs == 0
    finally:
        for o in everyone:
            o.close()
