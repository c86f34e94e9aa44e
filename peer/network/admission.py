"""Who may call the gossip server, and how many calls at once: admission before any work.

Every call is admitted in this order, before a buffer is allocated or the handler runs:

1. swarm token (metadata), if one is configured -> UNAUTHENTICATED;
2. under TLS, a client certificate whose common name equals the claimed sender
   -> UNAUTHENTICATED (no certificate) / PERMISSION_DENIED (another name);
3. the caller's limits (calls in flight, calls per second; :class:`PeerLimiter`)
   -> RESOURCE_EXHAUSTED, reason ``rate_limited``;
4. for bulk calls (pushes, state downloads), a free bulk slot -> RESOURCE_EXHAUSTED.

Heartbeats and bulk calls have separate budgets: their own per-caller limiter each, and bulk
calls take one of ``TransportOptions.max_concurrent_rpcs`` slots while the server keeps
``heartbeat_slots`` threads and gRPC call slots beyond those. A peer in the middle of a burst
of resyncs to us therefore never has its heartbeats refused or queued behind its transfers.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

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
        self.heartbeats = PeerLimiter(o.max_streams_per_peer, o.peer_rate, o.peer_burst)
        self._bulk_slots = threading.BoundedSemaphore(o.max_concurrent_rpcs)
        self._slots = o.max_concurrent_rpcs

    def enter(self, context: grpc.ServicerContext, claimed: str, bulk: bool) -> Ticket:
        """Admit one call claiming sender ``claimed``; raises UpdateRejected if refused."""
        key = self._authenticate(context, claimed)
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
        return Ticket(key, bulk)

    def leave(self, ticket: Ticket) -> None:
        """Release a call admitted by :meth:`enter`."""
        if ticket.bulk:
            self._bulk_slots.release()
            self.bulk.leave(ticket.key)
        else:
            self.heartbeats.leave(ticket.key)

    def _authenticate(self, context: grpc.ServicerContext, claimed: str) -> str:
        """The caller's limiter key: certificate identity, else claimed id, else its host."""
        sec = self.security
        identity = None
        if sec is not None:
            if not sec.token_ok(_metadata(context)):
                raise UpdateRejected(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "unauthenticated",
                    "missing or wrong swarm token",
                )
            if sec.tls:
                identity = peer_identity(context)
                if identity is None:
                    raise UpdateRejected(
                        grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "no client certificate"
                    )
                if claimed != identity:
                    raise UpdateRejected(
                        grpc.StatusCode.PERMISSION_DENIED,
                        "unauthenticated",
                        f"sender {claimed!r} does not match the certificate of {identity!r}",
                    )
        return identity or claimed or host_of(context.peer())


def _metadata(context: grpc.ServicerContext) -> Iterable[tuple[str, str | bytes]]:
    return context.invocation_metadata() or ()


def host_of(context_peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4`` (one limiter key per host, not per socket)."""
    return context_peer.rsplit(":", 1)[0] if context_peer.count(":") > 1 else context_peer
