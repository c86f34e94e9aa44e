"""Stalled calls cannot take the threads heartbeats need.

A member with a valid certificate opens calls and never sends their request (pushes, whole
pushes, state requests, heartbeats), far more than the server has threads. Before, each held
one of gRPC's worker threads and call slots until the client's deadline (none here), and
once they were all taken an honest heartbeat was refused. Now heartbeats run on threads of
their own, a caller is admitted (its certificate, its limits) before its request is awaited,
and a request that does not come is cut off. Real gRPC server and clients on 127.0.0.1 with
real certificates.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from gossipgrad.peer.config import MembershipSection
from gossipgrad.peer.network import GossipServer, PeerClient, TransportOptions, protocol
from gossipgrad.peer.security import TransportSecurity, write_swarm_certs
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(90)

# Four bulk threads and slots, two per caller; heartbeat threads and per-caller heartbeats as
# by default (8 and 2).
OPTIONS = TransportOptions(
    retries=0,
    server_threads=4,
    max_concurrent_rpcs=4,
    max_streams_per_peer=2,
    request_timeout=2.0,
)

#: The deadline a peer gives its heartbeats (membership.heartbeat_timeout, defaults).
HEARTBEAT_TIMEOUT = max(MembershipSection().heartbeat_interval, 1.0)


class Responder:
    """Answers heartbeats, counting them; holds no state to download."""

    def __init__(self) -> None:
        self.heartbeats = 0

    def handle_update(self, header, payload, context_peer):
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def handle_heartbeat(self, request):
        self.heartbeats += 1
        return pb.HeartbeatReply(responder=pb.PeerInfo(id="server"))

    def handle_state_request(self, request):
        return pb.StateHeader(sender="server"), b"\0" * 64


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return write_swarm_certs(tmp_path_factory.mktemp("certs"), ["server", "p1", "evil"])


def sec_of(certs, pid: str) -> TransportSecurity:
    return TransportSecurity.from_files(certs.ca, certs.certs[pid], certs.keys[pid])


class Staller:
    """Calls that send their headers and then nothing, on channels of one member."""

    def __init__(self, address: str, sec: TransportSecurity, channels: int = 4) -> None:
        self.release = threading.Event()
        self.outcomes: list[grpc.StatusCode] = []
        self._lock = threading.Lock()
        self._channels = [
            grpc.secure_channel(
                address, sec.channel_credentials(), options=[*sec.channel_args("server")]
            )
            for _ in range(channels)
        ]
        self._threads: list[threading.Thread] = []

    def _nothing(self):
        self.release.wait(60)
        return
        yield  # a generator that sends no message

    def open(self, method: str, count: int) -> None:
        for i in range(count):
            channel = self._channels[i % len(self._channels)]
            path = protocol.method_path(method)
            if method == protocol.STATE:
                call = channel.stream_stream(path)
            else:
                call = channel.stream_unary(path)
            t = threading.Thread(target=self._run, args=(call, method), daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, call, method: str) -> None:
        try:
            result = call(self._nothing())
            if method == protocol.STATE:
                for _ in result:
                    pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        with self._lock:
            self.outcomes.append(code)

    def close(self) -> None:
        self.release.set()
        for c in self._channels:
            c.close()
        for t in self._threads:
            t.join(10)


def test_stalled_calls_leave_heartbeats_answered_within_the_heartbeat_timeout(certs) -> None:
    responder = Responder()
    rejects: list[str] = []
    server = GossipServer(
        responder,
        options=OPTIONS,
        security=sec_of(certs, "server"),
        on_reject=lambda reason, _peer: rejects.append(reason),
    )
    server.start()
    staller = Staller(server.address, sec_of(certs, "evil"))
    honest = PeerClient(server.address, OPTIONS, sec_of(certs, "p1"), peer="server")
    try:
        # Ten times the server's threads, of every kind of call, none sending its request.
        for method in (protocol.PUSH, protocol.PUSH_WHOLE, protocol.STATE, protocol.HEARTBEAT):
            staller.open(method, 15)
        time.sleep(0.5)  # all opened and waiting
        latencies = []
        end = time.monotonic() + 2 * OPTIONS.request_timeout + 1.0  # past their cut-off
        while time.monotonic() < end:
            started = time.monotonic()
            reply = honest.heartbeat(
                pb.HeartbeatRequest(swarm="s", sender=pb.PeerInfo(id="p1", address="x:1")),
                timeout=HEARTBEAT_TIMEOUT,
            )
            latencies.append(time.monotonic() - started)
            assert reply.responder.id == "server"
            time.sleep(0.1)
            if len(latencies) == 5:  # and the bulk slots evil may not take still serve
                header = pb.UpdateHeader(swarm="s", sender="p1", receiver="server")
                assert honest.push(header, b"x" * 64, timeout=5).status == pb.PushReply.ACCEPTED
        print(f"{len(latencies)} heartbeats, slowest {max(latencies):.3f} s")
        assert len(latencies) >= 20 and max(latencies) < HEARTBEAT_TIMEOUT, latencies
        # The stalled calls were refused (over evil's limits, counted) or cut off at the
        # server's request deadline; none is left holding a thread.
        deadline = time.monotonic() + 15
        while len(staller.outcomes) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(staller.outcomes) == 60, len(staller.outcomes)
        refused = staller.outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert refused > 0 and rejects.count("rate_limited") == refused, (rejects, refused)
        assert set(staller.outcomes) <= {
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.CANCELLED,
        }, staller.outcomes
        assert server.deadlines.cancelled == 60 - refused
    finally:
        staller.close()
        honest.close()
        server.stop(grace=0)
