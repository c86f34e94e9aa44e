"""Telling a server that holds another member's certificate from one that is down.

A client dialling peer X asks the TLS handshake for X's name (``security.peer_tls_name``), so
a member holding only its own certificate fails the handshake where X's address now leads to
it. gRPC reports that as UNAVAILABLE, the status of any failed connection; what failed is
found out by connecting twice more, on fresh connections: one asking for X's name, one asking
for any member's. Where the first fails and the second succeeds, the server is a swarm member
that is not X (:func:`serves_another_member`). The two handshakes cost a few milliseconds and
run only after a call failed to connect.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
from gossipgrad.peer.network.options import TransportOptions, client_channel_args
from gossipgrad.peer.security import TransportSecurity

_SETTLED = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE)


def connects(
    address: str,
    security: TransportSecurity,
    options: TransportOptions,
    peer_id: str | None,
    timeout: float,
) -> bool | None:
    """Whether a fresh TLS connection to ``address`` asking for ``peer_id``'s name (any
    member's if None) completes its handshake (True), fails (False), or neither within
    ``timeout`` seconds (None)."""
    args: list[tuple[str, Any]] = [
        *client_channel_args(options),
        *security.channel_args(peer_id),
    ]
    channel = grpc.secure_channel(address, security.channel_credentials(), options=args)
    settled: list[grpc.ChannelConnectivity] = []
    done = threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in _SETTLED and not done.is_set():
            settled.append(state)
            done.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        done.wait(timeout)
    finally:
        channel.unsubscribe(watch)
        channel.close()
    if not settled:
        return None
    return settled[0] == grpc.ChannelConnectivity.READY


def serves_another_member(
    address: str,
    security: TransportSecurity,
    options: TransportOptions,
    peer_id: str,
    timeout: float,
) -> bool:
    """Whether the server at ``address`` holds a swarm certificate that is not ``peer_id``'s:
    a handshake asking for ``peer_id``'s name fails while one asking for any member's
    completes. False when both complete (the failure that sent us here has passed), both
    fail (not a member, or nothing there) or either takes longer than ``timeout`` seconds."""
    if connects(address, security, options, peer_id, timeout) is not False:
        return False
    return connects(address, security, options, None, timeout) is True
