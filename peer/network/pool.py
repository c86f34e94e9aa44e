"""One gRPC client per (address, peer), opened on first use and closed when the peer leaves.

A client is pinned to the peer it dials (under TLS the server must hold that peer's
certificate), so a pool keeps one per address and peer id: a peer id that someone else claims
at an honest peer's address gets a client of its own, whose failures leave the honest
peer's channels alone. An address dialled without knowing its peer (a bootstrap) gets any
pinned client open there, else an unpinned one, closed once a pinned one opens there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from gossipgrad.peer.network.client import PeerClient
from gossipgrad.peer.network.options import TransportOptions
from gossipgrad.peer.security import TransportSecurity

#: (address, peer id), the id "" for a client dialled without knowing its peer.
Key = tuple[str, str]


class ClientPool:
    """One PeerClient per (address, peer id), created on first use.

    Args:
        options / security: what every client is built with.
        dial: ``dial(address, peer id or None)`` -> address to connect to
            (``transport.dial_via``; a peer behind a relay: a local relay endpoint).
        on_wrong_server: passed to every client (see :class:`PeerClient`).
    """

    def __init__(
        self,
        options: TransportOptions,
        security: TransportSecurity | None = None,
        dial: Callable[[str, str | None], str] = lambda address, peer: address,
        on_wrong_server: Callable[[str, str], None] | None = None,
    ) -> None:
        self._options = options
        self._security = security
        self._dial = dial
        self._on_wrong_server = on_wrong_server
        self._clients: dict[Key, PeerClient] = {}
        self._lock = threading.Lock()

    def _new(self, address: str, peer: str | None, direct: bool = False) -> PeerClient:
        return PeerClient(
            self._dial(address, None if direct else peer),
            options=self._options,
            security=self._security,
            peer=peer,
            on_wrong_server=self._on_wrong_server,
        )

    def _kept(self, address: str, peer: str | None) -> PeerClient | None:
        """The kept client for ``(address, peer)``; for ``peer`` None, any at ``address``."""
        if peer:
            return self._clients.get((address, peer))
        return next((c for (a, _), c in self._clients.items() if a == address), None)

    def get(self, address: str, peer: str | None = None) -> PeerClient:
        """The client for ``peer`` at ``address`` (any member there if ``peer`` is None)."""
        unpinned = None
        with self._lock:
            c = self._kept(address, peer)
            if c is None:
                c = self._clients[(address, peer or "")] = self._new(address, peer)
                if peer:  # the bootstrap's client, if any, is not needed beside it
                    unpinned = self._clients.pop((address, ""), None)
        if unpinned is not None:
            unpinned.close()
        return c

    @contextlib.contextmanager
    def transient(self, address: str, peer: str | None = None) -> Iterator[PeerClient]:
        """The pool's client for ``(address, peer)`` if it has one, else a client closed on
        exit.

        For a call to an address the pool should not keep (a probe of a peer held dead): a
        gRPC channel left open to an address where nothing listens keeps reconnecting in the
        background, several times a second at first, until it is closed.
        """
        with self._lock:
            kept = self._kept(address, peer)
        if kept is not None:
            yield kept
            return
        client = self._new(address, peer)
        try:
            yield client
        finally:
            client.close()

    @contextlib.contextmanager
    def fresh(self, address: str, peer: str) -> Iterator[PeerClient]:
        """A new client for ``peer`` at ``address``, on connections of its own, closed on exit:
        for a call whose point is to open a connection (a reachability dial-back), which a
        kept channel, connected or backing off, would not test. Dialled at ``address``
        itself, even for a peer called through a relay."""
        client = self._new(address, peer, direct=True)
        try:
            yield client
        finally:
            client.close()

    def drop(self, address: str) -> None:
        """Close every client at ``address``."""
        with self._lock:
            gone = [k for k in self._clients if k[0] == address]
            clients = [self._clients.pop(k) for k in gone]
        for c in clients:
            c.close()

    def addresses(self) -> set[str]:
        """The addresses a client is open to."""
        with self._lock:
            return {a for a, _ in self._clients}

    def keys(self) -> set[Key]:
        """The (address, peer id) pairs a client is open for."""
        with self._lock:
            return set(self._clients)

    def prune(self, keep: set[Key]) -> None:
        """Close the clients of every (address, peer id) not in ``keep`` (peers that left or
        moved; ``(address, "")`` keeps a bootstrap's unpinned client)."""
        with self._lock:
            gone = [k for k in self._clients if k not in keep]
            clients = [self._clients.pop(k) for k in gone]
        for c in clients:
            c.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
