"""Telling a server that holds another member's certificate from one that is down.

A client dialling peer X asks the TLS handshake for X's name (``security.peer_tls_name``), so
a member holding only its own certificate fails the handshake where X's address now leads to
it. gRPC reports that as UNAVAILABLE, the status of any failed connection; what failed is
found out by connecting twice more, on fresh connections: one asking for X's name, one asking
for any member's. Where the first fails and the second succeeds, the server is a swarm member
that is not X (:func:`serves_another_member`). The two handshakes cost a few milliseconds and
run only after a call failed to connect, and a mismatch found is remembered for
:data:`MISMATCH_MEMORY_S` (:data:`REMEMBERED`): a member that lists invented peers at its own
address makes each peer probe them, and each failed probe would otherwise cost three
handshakes instead of one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from gossipgrad.peer.network.options import TransportOptions, client_channel_args
from gossipgrad.peer.security import TransportSecurity

_SETTLED = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE)

#: Seconds a mismatch found at (address, peer) is taken as the reason of the next failed
#: connection there, without handshakes of its own.
MISMATCH_MEMORY_S = 30.0


class MismatchMemory:
    """(address, peer id) pairs where another member's server was found, and when; at most
    ``capacity`` (the oldest go first). Thread-safe. ``hits``: answers given from memory."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._found: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def recalls(self, address: str, peer_id: str) -> bool:
        """Whether a mismatch was found at this pair less than MISMATCH_MEMORY_S ago."""
        with self._lock:
            at = self._found.get((address, peer_id))
            if at is None or time.monotonic() - at > MISMATCH_MEMORY_S:
                return False
            self.hits += 1
            return True

    def remember(self, address: str, peer_id: str) -> None:
        with self._lock:
            self._found.pop((address, peer_id), None)
            while len(self._found) >= self.capacity:
                del self._found[next(iter(self._found))]
            self._found[(address, peer_id)] = time.monotonic()


#: The process's memory of mismatches (every client of a peer shares it).
REMEMBERED = MismatchMemory()


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
    fail (not a member, or nothing there) or either takes longer than ``timeout`` seconds.
    A mismatch found there less than :data:`MISMATCH_MEMORY_S` ago is taken as the answer."""
    if REMEMBERED.recalls(address, peer_id):
        return True
    if connects(address, security, options, peer_id, timeout) is not False:
        return False
    if connects(address, security, options, None, timeout) is not True:
        return False
    REMEMBERED.remember(address, peer_id)
    return True
