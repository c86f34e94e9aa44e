"""A relay's raw tunnel listener (issue 45): tunnels spliced below gRPC.

The hub alone, on 127.0.0.1: a peer attached with ``splice`` gets a ticket for each tunnel
opened to it, the caller another; both ends connect to the listener with their tickets and
the bytes go through both ways, counted; what is not a live ticket is closed; an end whose
partner never comes is closed after the accept timeout and the tunnel is forgotten.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from gossipgrad.peer.network import relay
from gossipgrad.peer.network.relay import (
    SPLICE_MAGIC,
    TICKET_BYTES,
    RelayHub,
    _LocalCall,
    connect_spliced,
)
from gossipgrad.proto import gossip_pb2 as pb
from support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hub() -> Iterator[tuple[RelayHub, list[tuple[str, int]], list[str]]]:
    """A listening hub, the bytes it counted (peer, n) and the tunnels' ways."""
    counted: list[tuple[str, int]] = []
    ways: list[str] = []
    hub = RelayHub(2, on_bytes=lambda peer, n: counted.append((peer, n)), on_tunnel=ways.append)
    hub.listen("127.0.0.1")
    yield hub, counted, ways
    hub.stop_listening()


def attach(hub: RelayHub, peer: str, splice: bool) -> Iterator[pb.AttachEvent]:
    events = hub.attach(pb.AttachRequest(peer=peer, splice=splice), _LocalCall())
    assert next(events).tunnel == 0  # attached
    return events


def read_all(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return got


def test_both_ends_with_their_tickets_are_spliced_both_ways_and_counted(hub) -> None:
    hub, counted, ways = hub
    events = attach(hub, "x", splice=True)
    tunnel = hub.open(pb.RelayOpen(target="x", splice=True), "c", None, _LocalCall())
    named = next(events)
    assert named.tunnel == tunnel.id and named.ticket == tunnel.target_ticket
    assert len(tunnel.caller_ticket) == TICKET_BYTES != 0
    assert tunnel.caller_ticket != tunnel.target_ticket
    at = ("127.0.0.1", hub.port)
    caller = connect_spliced(at, tunnel.caller_ticket)
    target = connect_spliced(at, tunnel.target_ticket)
    request = bytes(range(256)) * 2000  # larger than one read
    caller.sendall(request)
    assert read_all(target, len(request)) == request
    target.sendall(b"reply")
    assert read_all(caller, 5) == b"reply"
    assert ways == ["spliced"]
    # The relay counts a read once it sent it on: the reply may arrive before its count.
    wait_for(lambda: sum(n for _, n in counted) == len(request) + 5, 5, "both ways counted")
    assert {peer for peer, _ in counted} == {"x"}
    assert hub.tunnels() == {"c": 1}
    caller.close()  # one end closes: the other sees the end, the tunnel is forgotten
    assert target.recv(1) == b""
    target.close()
    wait_for(lambda: hub.tunnels() == {}, 5, "the tunnel to be forgotten")
    # A ticket is single-use.
    again = connect_spliced(at, tunnel.caller_ticket)
    assert again.recv(1) == b""
    again.close()


def test_what_is_not_a_live_ticket_is_closed(hub) -> None:
    hub, counted, _ = hub
    at = ("127.0.0.1", hub.port)
    for first in (b"GET / HTTP/1.1\r\n\r\n", SPLICE_MAGIC + bytes(TICKET_BYTES)):
        sock = socket.create_connection(at, timeout=10)
        sock.sendall(first)
        assert sock.recv(1) == b""
        sock.close()
    assert counted == []


def test_a_target_that_did_not_reach_the_listener_gets_a_tunnel_in_calls(hub) -> None:
    hub, _, ways = hub
    events = attach(hub, "y", splice=False)
    tunnel = hub.open(pb.RelayOpen(target="y", splice=True), "c", None, _LocalCall())
    assert tunnel.tickets is None and tunnel.caller_ticket == b""
    named = next(events)
    assert (named.tunnel, named.ticket) == (tunnel.id, b"")
    assert ways == ["calls"]
    hub.close(tunnel)
    assert hub.tunnels() == {}


def test_an_end_whose_partner_never_connects_is_closed_and_the_tunnel_forgotten(
    hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "ACCEPT_TIMEOUT_S", 0.5)
    hub, counted, _ = hub
    events = attach(hub, "x", splice=True)  # kept: a dropped stream detaches x
    tunnel = hub.open(pb.RelayOpen(target="x", splice=True), "c", None, _LocalCall())
    caller = connect_spliced(("127.0.0.1", hub.port), tunnel.caller_ticket)
    caller.settimeout(10)
    assert caller.recv(1) == b""
    caller.close()
    wait_for(lambda: hub.tunnels() == {}, 5, "the tunnel to be forgotten")
    late = connect_spliced(("127.0.0.1", hub.port), tunnel.target_ticket)
    assert late.recv(1) == b""
    late.close()
    assert counted == []
    assert next(events).tunnel == tunnel.id


def test_a_relay_that_stops_ends_its_spliced_tunnels(hub) -> None:
    hub, _, _ = hub
    events = attach(hub, "x", splice=True)
    tunnel = hub.open(pb.RelayOpen(target="x", splice=True), "c", None, _LocalCall())
    assert next(events).ticket == tunnel.target_ticket
    at = ("127.0.0.1", hub.port)
    caller = connect_spliced(at, tunnel.caller_ticket)
    target = connect_spliced(at, tunnel.target_ticket)
    caller.sendall(b"ping")
    assert read_all(target, 4) == b"ping"
    hub.stop_listening()
    for end in (caller, target):
        end.settimeout(10)
        assert end.recv(1) == b""
        end.close()
    wait_for(lambda: hub.tunnels() == {}, 5, "the tunnel to be forgotten")
    with pytest.raises(OSError):
        socket.create_connection(at, timeout=2).close()
