"""A state download's deadline follows its size: ``state_timeout`` plus the declared size
over the slowest rate expected (``min_rate_bytes``, or the donors' ``state_rate_bytes``).

Before, a download had ``state_timeout`` whatever its size (120 s by the config's default):
a 100M-parameter diloco peer's state with AdamW's moments (1.6 GB) over a 100 Mbit/s link
needs 128 s and was cut off, every time, from every donor. Real gRPC on 127.0.0.1, the link's
speed set by the donor's own pacing (``state_rate_bytes``).
"""

from __future__ import annotations

import time

import grpc
import pytest
from gossipgrad.peer.config import build_config
from gossipgrad.peer.network import GossipServer, PeerClient, TransportError, TransportOptions
from gossipgrad.peer.runtime.node import transport_options
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(60)

MB = 1_000_000
PAYLOAD = bytes(range(256)) * (3 * MB // 256)  # 3 MB


class Donor:
    """A handler that serves a state of 3 MB."""

    def handle_update(self, header, payload, context_peer):
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def handle_heartbeat(self, request):
        return pb.HeartbeatReply(responder=pb.PeerInfo(id="donor"))

    def handle_state_request(self, request):
        return pb.StateHeader(sender="donor"), PAYLOAD


def test_the_deadline_of_a_state_at_size_leaves_time_for_a_slow_link() -> None:
    """The config's defaults: 1.6 GB at 100 Mbit/s (128 s) and at the 8 Mbit/s floor (1,600 s)
    both fit; a donor pacing slower than the floor sets the rate expected."""
    options = transport_options(build_config({}, {}), 4 * 100_000_000)
    state = 1_600_000_000
    assert options.state_deadline(state) > state / 12.5e6  # 100 Mbit/s
    assert options.state_deadline(state) == pytest.approx(options.state_timeout + 1600.0)
    paced = transport_options(build_config({}, {"transport.state_rate_bytes": 0.5e6}), 400)
    assert paced.state_deadline(state) == pytest.approx(paced.state_timeout + 3200.0)
    assert options.state_deadline(state, fixed=5.0) == pytest.approx(1605.0)


def download(server: GossipServer, **client_options) -> tuple[pb.StateHeader, bytearray]:
    options = TransportOptions(retries=0, **client_options)
    with PeerClient(server.address, options=options) as client:
        return client.download_state(pb.StateRequest(swarm="s", requester="joiner"))


def test_a_download_slower_than_the_fixed_deadline_is_not_cut_off() -> None:
    """3 MB paced at 1.5 MB/s takes about 2 s: past a fixed ``state_timeout`` of 1 s, within
    the 1 s + 3 MB at 1 MB/s (4 s) its size allows."""
    served = TransportOptions(state_rate_bytes=1.5 * MB, chunk_size=256 << 10)
    with GossipServer(Donor(), options=served) as server:
        t0 = time.monotonic()
        header, blob = download(server, state_timeout=1.0, min_rate_bytes=1 * MB)
        took = time.monotonic() - t0
    assert header.payload_size == len(blob) == len(PAYLOAD)
    assert bytes(blob) == PAYLOAD
    assert took > 1.0, took  # it did outlast the fixed part


def test_a_download_slower_than_its_size_allows_is_cut_off_at_that_deadline() -> None:
    """3 MB paced at 0.3 MB/s would take 10 s; its size allows 0.5 s + 3 MB at 1 MB/s."""
    served = TransportOptions(state_rate_bytes=0.3 * MB, chunk_size=64 << 10)
    with GossipServer(Donor(), options=served) as server:
        t0 = time.monotonic()
        with pytest.raises(TransportError) as err:
            download(server, state_timeout=0.5, min_rate_bytes=1 * MB)
        took = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert 3.0 < took < 6.0, took
