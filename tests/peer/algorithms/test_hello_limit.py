"""A neighbour saying hello in a loop cannot keep restarting its edge.

A hello (an update of session 0) naming a session its sender dropped made the leader open a
new session, every time: a member sending one hello after another restarted the edge at each,
forcing a dense resync built under the training lock and breaking every exchange in flight.
Now a hello opens at most one session per ``HELLO_RESTART_INTERVAL`` per edge. Real peers and
gRPC on 127.0.0.1.
"""

from __future__ import annotations

import time

import pytest
from gossipgrad.peer.algorithms.edges import HELLO_RESTART_INTERVAL
from gossipgrad.peer.network import PeerClient, TransportOptions
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import run_rounds, start_peers

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
