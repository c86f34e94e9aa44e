"""Who may call the gossip server, and how many calls at once: admission before any work.

Every call is admitted in this order, before a buffer is allocated or the handler runs:

1. swarm token (metadata), if one is configured -> UNAUTHENTICATED;
2. under TLS, a client certificate -> UNAUTHENTICATED;
3. the caller's limits (calls in flight, calls per second; :class:`PeerLimiter`)
   -> RESOURCE_EXHAUSTED, reason ``rate_limited``;
4. for bulk calls (pushes, state downloads), a free bulk slot -> RESOURCE_EXHAUSTED;
5. for state downloads, also a free state slot (``max_state_downloads``) -> RESOURCE_EXHAUSTED,
   reason ``rate_limited``: a donor busy serving joiners says so at once, and the joiner
   moves on to another donor instead of queueing;

   (the request is awaited and parsed here: INVALID_ARGUMENT, ``malformed``, if it does not)

6. under TLS, the claimed sender equals the certificate's common name -> PERMISSION_DENIED.

Under TLS steps 3-5 come before the request is awaited (:meth:`Admission.enter_caller`),
keyed by the certificate, so a member's calls that never send their request count against
its limits from the start. Without TLS the caller is known only by the id its request claims,
so 3-5 follow the parse (:meth:`Admission.enter`).

Heartbeats and bulk calls have separate budgets: their own per-caller limiter each (a caller
may have ``heartbeats_per_peer`` heartbeats in flight), bulk calls take one of
``TransportOptions.max_concurrent_rpcs`` slots, and the server runs heartbeats on
``heartbeat_slots`` threads of their own. A peer in the middle of a burst of resyncs to us
therefore never has its heartbeats refused or queued behind its transfers.
"""

from __future__ import annotations

import dataclasses
import threading

import grpc
from gossipgrad.peer.network.errors import UpdateRejected
from gossipgrad.peer.network.limits import PeerLimiter
from gossipgrad.peer.network.options import TransportOptions
from gossipgrad.peer.security import TransportSecurity, peer_identity


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An admitted call; hand it back to :meth:`Admission.leave` when the call ends."""

    key: str
    bulk: bool
    state: bool = False


class Admission:
    """Authenticates calls and counts them against their caller's and the server's budgets.

    Args:
        options: per-caller limits (``max_streams_per_peer``, ``peer_rate``, ``peer_burst``)
            and the bulk budget (``max_concurrent_rpcs``).
        security: TLS material and/or swarm token (None: anyone may call).
    """

    def __init__(self, options: TransportOptions, security: TransportSecurity | None) -> None:
        o = options
        self.security = security
        #: Per-caller limits of pushes and state downloads.
        self.bulk = PeerLimiter(o.max_streams_per_peer, o.peer_rate, o.peer_burst)
        #: Per-caller limits of heartbeats (a separate budget: see the module docstring).
        self.heartbeats = PeerLimiter(o.heartbeats_per_peer, o.peer_rate, o.peer_burst)
        self._bulk_slots = threading.BoundedSemaphore(o.max_concurrent_rpcs)
        self._slots = o.max_concurrent_rpcs
        self._state_slots = threading.BoundedSemaphore(o.max_state_downloads)
        self._max_state = o.max_state_downloads
        self._state_lock = threading.Lock()
        self._state_in_flight = 0

    def authenticate(self, context: grpc.ServicerContext) -> str | None:
        """Check what needs no request body: the token and, under TLS, a certificate.

        Called before a request is parsed, so a caller without credentials gets
        UNAUTHENTICATED whatever it sends. Returns the certificate identity (None without
        TLS); raises UpdateRejected if refused.
        """
        sec = self.security
        if sec is None:
            return None
        if not sec.token_ok(context.invocation_metadata() or ()):
            raise UpdateRejected(
                grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "missing or wrong swarm token"
            )
        if not sec.tls:
            return None
        identity = peer_identity(context)
        if identity is None:
            raise UpdateRejected(
                grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "no client certificate"
            )
        return identity

    def enter(
        self,
        context: grpc.ServicerContext,
        identity: str | None,
        claimed: str,
        bulk: bool,
        state: bool = False,
    ) -> Ticket:
        """Admit one call from ``identity`` (see :meth:`authenticate`) claiming to be sender
        ``claimed``: the claim must match the certificate, then the call counts against its
        caller's limits and, if ``bulk``, takes a bulk slot, and if ``state`` (a state
        download, always bulk) a state slot too. Raises UpdateRejected if refused.
        """
        self.check_claim(identity, claimed)
        return self._admit(identity or claimed or host_of(context.peer()), bulk, state)

    def enter_caller(self, identity: str | None, bulk: bool, state: bool = False) -> Ticket | None:
        """Admit a call before its request is awaited, by its certificate ``identity``, as
        :meth:`enter` does; None without TLS (no identity: admit it with :meth:`enter` once
        its request names the sender). Raises UpdateRejected if refused."""
        if identity is None:
            return None
        return self._admit(identity, bulk, state)

    @staticmethod
    def check_claim(identity: str | None, claimed: str) -> None:
        """Raise UpdateRejected if the sender a request claims is not its certificate's."""
        if identity is not None and claimed != identity:
            raise UpdateRejected(
                grpc.StatusCode.PERMISSION_DENIED,
                "unauthenticated",
                f"sender {claimed!r} does not match the certificate of {identity!r}",
            )

    def _admit(self, key: str, bulk: bool, state: bool) -> Ticket:
        """Count one call of ``key`` against its limits and the server's slots."""
        limiter = self.bulk if bulk else self.heartbeats
        why = limiter.enter(key)
        if why is not None:
            raise UpdateRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited", why)
        if bulk and not self._bulk_slots.acquire(blocking=False):
            limiter.leave(key)
            raise UpdateRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "rate_limited",
                f"server busy: {self._slots} pushes/downloads in flight",
            )
        if state and not self._state_slots.acquire(blocking=False):
            self._bulk_slots.release()
            limiter.leave(key)
            raise UpdateRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "rate_limited",
                f"donor busy: {self._max_state} state downloads in flight",
            )
        if state:
            with self._state_lock:
                self._state_in_flight += 1
        return Ticket(key, bulk, state)

    @property
    def state_downloads(self) -> int:
        """State downloads admitted and not yet finished."""
        with self._state_lock:
            return self._state_in_flight

    def leave(self, ticket: Ticket) -> None:
        """Release a call admitted by :meth:`enter`."""
        if ticket.state:
            with self._state_lock:
                self._state_in_flight -= 1
            self._state_slots.release()
        if ticket.bulk:
            self._bulk_slots.release()
            self.bulk.leave(ticket.key)
        else:
            self.heartbeats.leave(ticket.key)


def host_of(context_peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4`` (one limiter key per host, not per socket)."""
    return context_peer.rsplit(":", 1)[0] if context_peer.count(":") > 1 else context_peer
