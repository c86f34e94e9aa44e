"""A neighbour saying hello, or sending updates that fail their checks, in a loop cannot keep
restarting its edge.

A hello (an update of session 0) naming a session its sender dropped made the leader open a
new session, every time: a member sending one hello after another restarted the edge at each,
forcing a dense resync built under the training lock and breaking every exchange in flight.
An update failing a check (a gap in the sequence, a bad checksum, a new session's opening
missed) did the same at either end of the edge. Now the neighbour's word ends at most one
session per ``HELLO_RESTART_INTERVAL`` per edge; a bad update within it is refused
(``rate_limited``, counted). Real peers and gRPC on 127.0.0.1.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from gossipgrad.peer.algorithms.edges import HELLO_RESTART_INTERVAL, REFUSED_RETRY_S, Edge
from gossipgrad.peer.flat import tensor_checksum
from gossipgrad.peer.network import PeerClient, TransportOptions
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import quiesce, rejected, run_rounds, start_peers

pytestmark = pytest.mark.timeout(90)


def test_hellos_in_a_loop_restart_an_edge_at_most_once_per_interval() -> None:
    p0, p1 = start_peers(2, widths=(8, 4, 2))  # p0 leads the edge (the smaller id)
    run_rounds([p0, p1], 2, timeout=60, end=False)
    edge = p0.algorithm.edges["p1"]
    before = edge.restarts
    hello = pb.UpdateHeader(
        swarm=p0.cfg.peer.swarm,
        sender="p1",  # plaintext: the claimed sender is p1 (under TLS, p1's certificate)
        receiver="p0",
        kind=pb.INIT,
        edge_epoch=0,
        dropped_epoch=2**63,  # "I dropped your session", whatever it is
        model_fingerprint=p0.flat.fingerprint,
    )
    sent = 0
    with PeerClient(p0.address, TransportOptions(retries=0)) as liar:
        end = time.monotonic() + min(3.0, HELLO_RESTART_INTERVAL / 2)
        while time.monotonic() < end:
            liar.push(hello, b"", timeout=5)
            sent += 1
            time.sleep(0.02)
    assert sent > 50
    assert edge.restarts - before <= 1, (sent, edge.restarts - before)
    # The edge still mixes: a few rounds after the hellos, both ends mixed an exchange.
    stats = run_rounds([p0, p1], 4, timeout=60, end=False)
    assert {"p0", "p1"} <= {pid for s in stats for pid in s.mixed}, stats


def bad_update(victim: Peer, liar: str, edge: Edge, bad: str) -> tuple[pb.UpdateHeader, bytes]:
    """An update from ``liar`` that fails one of the victim edge's checks as it stands now."""
    copies = victim.algorithm.copies
    header = pb.UpdateHeader(
        swarm=victim.cfg.peer.swarm,
        sender=liar,  # plaintext: the claimed sender (under TLS, its certificate)
        receiver=victim.id,
        model_fingerprint=victim.flat.fingerprint,
        weight=0.5,
    )
    with edge.lock:
        epoch, received = edge.epoch, edge.received
    if bad == "gap" or (bad == "checksum" and received > 0):
        # this session's update two ahead of the next (in "checksum", only to end a session
        # under way, whose next update may be one exchange early: held, not checked yet)
        header.MergeFrom(pb.UpdateHeader(kind=pb.DELTA, edge_epoch=epoch, seq=received + 2))
        return header, b""
    if bad == "missed_opening":  # a newer session of the leader, its opening never seen
        header.MergeFrom(pb.UpdateHeader(kind=pb.DELTA, edge_epoch=time.time_ns(), seq=2))
        return header, b""
    # "checksum": the session's opening, decoding cleanly, with the checksum of another copy
    zeros = torch.zeros_like(edge.mirror)
    header.MergeFrom(
        pb.UpdateHeader(
            kind=pb.RESYNC, edge_epoch=epoch, seq=1, checksum=tensor_checksum(zeros + 1)
        )
    )
    return header, copies.dense.encode(zeros)


@pytest.mark.parametrize(
    ("victim_id", "bad"),
    [("p0", "gap"), ("p0", "checksum"), ("p1", "missed_opening")],
    ids=["leader-gap", "leader-checksum", "follower-missed-opening"],
)
def test_bad_updates_in_a_loop_restart_an_edge_at_most_once_per_interval(
    victim_id: str, bad: str
) -> None:
    """A neighbour sending updates that fail their checks, one after another: each ended the
    session (a new one, a dense resync from the training thread, every exchange in flight
    broken). Now the first ends it, the others within ``HELLO_RESTART_INTERVAL`` are refused
    (``rate_limited``) and the session ends once, after the interval; then the edge mixes."""
    peers = start_peers(2, widths=(8, 4, 2))  # p0 leads the edge (the smaller id)
    run_rounds(peers, 2, timeout=60, end=False)
    quiesce(peers)
    victim = peers[int(victim_id[1])]
    liar = "p1" if victim_id == "p0" else "p0"
    edge = victim.algorithm.edges[liar]
    before, limited_before = edge.restarts, rejected(victim, "rate_limited")
    sent = limited = 0
    with PeerClient(victim.address, TransportOptions(retries=0)) as client:
        end = time.monotonic() + min(3.0, HELLO_RESTART_INTERVAL / 2)
        while time.monotonic() < end:
            try:
                client.push(*bad_update(victim, liar, edge, bad), timeout=5)
            except grpc.RpcError as err:
                assert err.code() in (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,  # refused for now: rate_limited
                    grpc.StatusCode.INVALID_ARGUMENT,
                ), err
                limited += err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            sent += 1
            time.sleep(0.02)
    restarts = edge.restarts - before
    assert sent >= 20
    assert restarts <= 1, (sent, restarts)
    assert limited >= sent - 2, (sent, limited)
    assert rejected(victim, "rate_limited") - limited_before >= limited
    # The edge still mixes: once the interval has passed the session ends (once) and both
    # ends mix exchanges of the new one.
    epoch = edge.epoch
    deadline = time.monotonic() + 30
    mixed: set[str] = set()
    while not {"p0", "p1"} <= mixed:
        assert time.monotonic() < deadline, (mixed, edge.describe())
        stats = run_rounds(peers, 1, timeout=60, end=False)
        if edge.epoch != epoch:
            mixed |= {pid for s in stats for pid in s.mixed}
    assert edge.restarts - before <= 2, edge.restarts - before


def test_a_push_refused_for_now_waits_before_it_goes_again() -> None:
    """p1's session with p0 is due to end (a check failed within the interval): p0's updates
    are refused for now (``rate_limited``) until the interval has passed. p0 pushes the same
    update again every REFUSED_RETRY_S, not at every round or wake-up (before: some 2,000
    refused pushes, and as many warnings, in one interval on a loaded host)."""
    peers = start_peers(2, {"gossip.round_timeout": 1.0}, widths=(8, 4, 2))
    run_rounds(peers, 2, timeout=60, end=False)
    quiesce(peers)
    p0, p1 = peers
    edge = p1.algorithm.edges["p0"]
    with edge.lock:
        edge.restarted_at["check"] = time.monotonic()  # a failed check ended a session now
        edge.restart_due = True  # and another: this one ends once the interval has passed
    before = rejected(p1, "rate_limited")
    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # p0's rounds, as fast as they come
        p0.algorithm.step_round()
    took = time.monotonic() - started
    refused = rejected(p1, "rate_limited") - before
    assert took < HELLO_RESTART_INTERVAL  # all within the interval: nothing was accepted
    assert 1 <= refused <= took / REFUSED_RETRY_S + 2, (refused, took)
