"""One gRPC client per peer address, opened on first use and closed when the peer leaves."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from gossipgrad.peer.network.client import PeerClient
from gossipgrad.peer.network.options import TransportOptions
from gossipgrad.peer.security import TransportSecurity


class ClientPool:
    """One PeerClient per address, created on first use."""

    def __init__(
        self,
        options: TransportOptions,
        security: TransportSecurity | None = None,
        dial: Callable[[str], str] = str,
    ) -> None:
        self._options = options
        self._security = security
        self._dial = dial  # peer address -> address to connect to (transport.dial_via)
        self._clients: dict[str, PeerClient] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> PeerClient:
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = PeerClient(
                    self._dial(address), options=self._options, security=self._security
                )
            return c

    @contextlib.contextmanager
    def transient(self, address: str) -> Iterator[PeerClient]:
        """The pool's client for ``address`` if it has one, else a client closed on exit.

        For a call to an address the pool should not keep (a probe of a peer held dead): a
        gRPC channel left open to an address where nothing listens keeps reconnecting in the
        background, several times a second at first, until it is closed.
        """
        with self._lock:
            kept = self._clients.get(address)
        if kept is not None:
            yield kept
            return
        client = PeerClient(self._dial(address), options=self._options, security=self._security)
        try:
            yield client
        finally:
            client.close()

    def drop(self, address: str) -> None:
        with self._lock:
            c = self._clients.pop(address, None)
        if c is not None:
            c.close()

    def addresses(self) -> set[str]:
        """The addresses a client is open to."""
        with self._lock:
            return set(self._clients)

    def prune(self, keep: set[str]) -> None:
        """Close the clients of every address not in ``keep`` (peers that left)."""
        for address in self.addresses() - keep:
            self.drop(address)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
