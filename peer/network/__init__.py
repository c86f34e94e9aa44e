"""The gRPC transport between peers, one job per module.

- :mod:`.errors`: reject reasons, :class:`TransportError` / :class:`UpdateRejected` /
  :class:`WrongServer`, the status mapping of both ends;
- :mod:`.framing`: chunk framing of streamed calls, written once (send, reassemble under a
  cap, count wire bytes);
- :mod:`.protocol`: the service's methods and codecs, the :class:`GossipHandler` protocol;
- :mod:`.options`: :class:`TransportOptions` and the gRPC channel/server arguments;
- :mod:`.admission` and :mod:`.limits`: who may call, and how much;
- :mod:`.buffers`: receive buffers reused between pushes; :mod:`.malloc`: glibc tuning;
- :mod:`.server`: :class:`GossipServer`; :mod:`.client`: :class:`PeerClient`;
  :mod:`.identity`: what failed when a client's pinned TLS handshake did.
"""

from gossipgrad.peer.network.client import PeerClient, PushResult
from gossipgrad.peer.network.errors import (
    REJECT_REASONS,
    TransportError,
    UpdateRejected,
    WrongServer,
)
from gossipgrad.peer.network.options import TransportOptions
from gossipgrad.peer.network.protocol import GossipHandler, push_wire_bytes
from gossipgrad.peer.network.server import GossipServer

__all__ = [
    "REJECT_REASONS",
    "GossipHandler",
    "GossipServer",
    "PeerClient",
    "PushResult",
    "TransportError",
    "TransportOptions",
    "UpdateRejected",
    "WrongServer",
    "push_wire_bytes",
]
