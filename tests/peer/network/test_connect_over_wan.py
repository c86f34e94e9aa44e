"""A fresh TLS connection across a long round trip connects on its first attempt.

gRPC gives a connection attempt at least its *minimum reconnect backoff*
(``grpc.min_reconnect_backoff_ms``, 20 s by default) to complete. Setting it to the short
reconnect pause a restarted peer needs (0.1 s) cut every attempt off before a TLS handshake
over a WAN could finish (TCP and TLS take two round trips and more), so a peer 200 ms away
was reached only after several attempts, each a new handshake thrown away."""

from __future__ import annotations

import time

import pytest
from gossipgrad.experiment.links import LinkEmulator, Stage
from gossipgrad.peer.network import GossipServer, PeerClient, TransportOptions
from gossipgrad.peer.security import TransportSecurity, write_swarm_certs
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(60)

ONE_WAY_S = 0.1  # a 200 ms round trip: two continents


class Answers:
    """A server handler that answers heartbeats as ``b``."""

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        return pb.HeartbeatReply(responder=pb.PeerInfo(id="b", address="here"))


def test_a_tls_connection_two_hundred_ms_away_takes_one_attempt(tmp_path) -> None:
    certs = write_swarm_certs(tmp_path, ["a", "b"])

    def security(pid: str) -> TransportSecurity:
        return TransportSecurity.from_files(certs.ca, certs.certs[pid], certs.keys[pid])

    server = GossipServer(Answers(), security=security("b"))
    server.start()
    emu = LinkEmulator().start()
    try:
        link = emu.add(
            "b", lambda: server.address, [Stage(delay=ONE_WAY_S)], [Stage(delay=ONE_WAY_S)]
        )
        request = pb.HeartbeatRequest(swarm="", sender=pb.PeerInfo(id="a"))
        with PeerClient(link.address, TransportOptions(), security("a"), peer="b") as client:
            t0 = time.monotonic()
            reply = client.heartbeat(request, timeout=10)
            took = time.monotonic() - t0
        assert reply.responder.id == "b"
        assert link.stats()["connections"] == 1, (link.stats(), took)
    finally:
        emu.close()
        server.stop(grace=0)
