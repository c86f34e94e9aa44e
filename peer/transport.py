"""Former home of the transport, kept so existing imports work: see ``gossipgrad.peer.network``."""

from gossipgrad.peer.network import (
    GossipHandler,
    GossipServer,
    PeerClient,
    PushResult,
    TransportError,
    TransportOptions,
    UpdateRejected,
    push_wire_bytes,
)

__all__ = [
    "GossipHandler",
    "GossipServer",
    "PeerClient",
    "PushResult",
    "TransportError",
    "TransportOptions",
    "UpdateRejected",
    "push_wire_bytes",
]
