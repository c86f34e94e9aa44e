"""Server-side deadlines: calls that stall free their threads and slots without the client.

A member with a valid certificate (here: plaintext on 127.0.0.1, the admission is the same)
opens pushes that send a header and then nothing, with no deadline of its own, or starts a
state download and stops reading. Before issue 40 each such call held a worker thread and an
admission slot until the client let go: a few of them made the server answer "busy" to every
honest push and "donor busy" to every joiner.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from gossipgrad.peer.network import GossipServer, PeerClient, TransportOptions
from gossipgrad.peer.network import server as server_module
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(60)

METHOD = "/gossipgrad.v1.Gossip/"
STATE_BYTES = 64 << 20  # far past what HTTP/2 flow control lets go unread


class Plain:
    """A handler that accepts everything and serves a big state."""

    def handle_update(self, header, payload, context_peer):
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def handle_heartbeat(self, request):
        return pb.HeartbeatReply(responder=pb.PeerInfo(id="server"))

    def handle_state_request(self, request):
        return pb.StateHeader(sender="server"), bytes(STATE_BYTES)


def stalled_push(channel: grpc.Channel, release: threading.Event, sender: str):
    """A push that sends its header (declaring 1 MiB) and then nothing, with no deadline."""
    header = pb.UpdateChunk(header=pb.UpdateHeader(swarm="s", sender=sender, payload_size=1 << 20))

    def chunks():
        yield header.SerializeToString()
        release.wait()

    call = channel.stream_unary(
        METHOD + "PushUpdate", request_serializer=None, response_deserializer=None
    )
    return call.future(chunks())


def test_a_push_that_never_sends_its_body_is_cancelled_and_frees_its_slot() -> None:
    options = TransportOptions(max_concurrent_rpcs=2, push_timeout=1.0, retries=0)
    release = threading.Event()
    with GossipServer(Plain(), options=options) as server:
        channel = grpc.insecure_channel(server.address)
        stalled = [stalled_push(channel, release, f"evil-{i}") for i in range(2)]
        try:
            time.sleep(0.3)
            assert server.deadlines.cancelled == 0
            for call in stalled:
                assert call.exception(timeout=5) is not None  # cancelled by the server
                assert call.exception().code() == grpc.StatusCode.CANCELLED
            assert server.deadlines.cancelled == 2
            with PeerClient(server.address, options) as honest:
                header = pb.UpdateHeader(swarm="s", sender="honest")
                result = honest.push_detailed(header, b"x" * 1000)
            assert result.reply.status == pb.PushReply.ACCEPTED
        finally:
            release.set()
            channel.close()


def test_a_download_whose_reader_stops_reading_frees_the_state_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "STATE_STALL_S", 1.0)
    options = TransportOptions(max_state_downloads=1, retries=0, state_timeout=60.0)
    with GossipServer(Plain(), options=options) as server:
        channel = grpc.insecure_channel(server.address)
        call = channel.unary_stream(
            METHOD + "DownloadState", request_serializer=None, response_deserializer=None
        )(pb.StateRequest(swarm="s", requester="slow").SerializeToString())
        try:
            next(call)  # the header: the download is admitted, then nothing more is read
            assert server.admission.state_downloads == 1
            deadline = time.monotonic() + 10
            while server.admission.state_downloads:
                assert time.monotonic() < deadline, "the stalled download kept its slot"
                time.sleep(0.05)
            with PeerClient(server.address, options) as joiner:
                _header, blob = joiner.download_state(pb.StateRequest(swarm="s", requester="j"))
            assert len(blob) == STATE_BYTES
        finally:
            call.cancel()
            channel.close()


def slow_push(channel: grpc.Channel, payload_bytes: int, pieces: int, pause: float):
    """An honest push over a slow link: the header, then the payload in ``pieces`` chunks with
    ``pause`` seconds between them. Returns the reply (raises the call's error)."""
    header = pb.UpdateChunk(
        header=pb.UpdateHeader(swarm="s", sender="slow", payload_size=payload_bytes)
    )
    piece = payload_bytes // pieces

    def chunks():
        yield header.SerializeToString()
        for _ in range(pieces):
            time.sleep(pause)
            yield pb.UpdateChunk(data=bytes(piece)).SerializeToString()

    call = channel.stream_unary(
        METHOD + "PushUpdate",
        request_serializer=None,
        response_deserializer=pb.PushReply.FromString,
    )
    return call(chunks(), timeout=30)


@pytest.mark.parametrize(
    ("min_rate_bytes", "cut_off"), [(0.5e6, False), (1e12, True)], ids=["slow-link", "no-room"]
)
def test_a_push_may_take_as_long_as_its_size_needs(min_rate_bytes: float, cut_off: bool) -> None:
    """A 2 MiB push that takes 2 s over a slow link outlives a 0.5 s push_timeout: its
    deadline is push_timeout plus its size over min_rate_bytes (4.7 s here), so a dense resync
    of a large model is not cancelled and sent again forever. With no room for the size
    (min_rate_bytes huge) the same push is cut off at push_timeout."""
    options = TransportOptions(push_timeout=0.5, min_rate_bytes=min_rate_bytes, retries=0)
    with GossipServer(Plain(), options=options) as server:
        channel = grpc.insecure_channel(server.address)
        try:
            if cut_off:
                with pytest.raises(grpc.RpcError) as err:
                    slow_push(channel, 2 << 20, pieces=4, pause=0.5)
                assert err.value.code() == grpc.StatusCode.CANCELLED
                assert server.deadlines.cancelled == 1
            else:
                reply = slow_push(channel, 2 << 20, pieces=4, pause=0.5)
                assert reply.status == pb.PushReply.ACCEPTED
                assert server.deadlines.cancelled == 0
        finally:
            channel.close()


def test_the_push_deadline_and_the_size_caps_follow_the_model() -> None:
    """At 300M parameters (1.2 GB) an update still fits the default cap (it was a fixed
    1 GiB: every model above 268M parameters was refused), and a 340 MB resync may take what
    8 Mbit/s needs."""
    from gossipgrad.peer.config import build_config
    from gossipgrad.peer.runtime.node import ENVELOPE_BYTES, transport_options

    model_bytes = 4 * 300_000_000
    options = transport_options(build_config({}, {}), model_bytes)
    assert options.max_payload_bytes == model_bytes + ENVELOPE_BYTES
    assert options.max_state_bytes >= 8 * model_bytes
    assert options.push_deadline(340_000_000) == pytest.approx(30.0 + 340.0)
    pinned = transport_options(build_config({}, {"transport.max_payload_bytes": 1 << 20}), 4)
    assert pinned.max_payload_bytes == 1 << 20
