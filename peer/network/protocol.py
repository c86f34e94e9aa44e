"""The ``gossipgrad.v1.Gossip`` service as both ends see it: methods, codecs, handler protocol.

Three methods (proto/gossip.proto):

1. ``PushUpdate`` (client-streaming): an ``UpdateHeader`` chunk, then the payload in data
   chunks (see :mod:`~gossipgrad.peer.network.framing`).
2. ``Heartbeat`` (unary): liveness plus peer exchange.
3. ``DownloadState`` (server-streaming): a ``StateHeader`` chunk, then the state blob.

The server takes every request as raw bytes and parses it itself (:func:`parse_request`, and
:class:`~gossipgrad.peer.network.framing.ChunkCodec` for chunks), so bytes that are no valid
request are refused as ``malformed`` with INVALID_ARGUMENT rather than failing inside gRPC's
deserializer with INTERNAL.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from google.protobuf.message import DecodeError, Message
from gossipgrad.peer.network.errors import malformed
from gossipgrad.peer.network.framing import ChunkCodec, stream_wire_bytes
from gossipgrad.proto import gossip_pb2 as pb

SERVICE = "gossipgrad.v1.Gossip"
PUSH = "PushUpdate"
HEARTBEAT = "Heartbeat"
STATE = "DownloadState"


def method_path(name: str) -> str:
    """The gRPC path of one method, e.g. ``/gossipgrad.v1.Gossip/Heartbeat``."""
    return f"/{SERVICE}/{name}"


UPDATE_CODEC = ChunkCodec(pb.UpdateChunk)
STATE_CODEC = ChunkCodec(pb.StateChunk)

M = TypeVar("M", bound=Message)


class GossipHandler(Protocol):
    """What the server calls; implemented by the peer engine. May raise UpdateRejected.

    ``payload`` is a read-only ``memoryview`` of the received bytes (bytes-like: protobuf,
    zstandard, numpy and torch read it without copying). It stays valid for as long as it
    is referenced; the buffer is reused for a later push only once nothing references it.
    """

    def handle_update(
        self, header: pb.UpdateHeader, payload: memoryview, context_peer: str
    ) -> pb.PushReply: ...

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply: ...

    def handle_state_request(
        self, request: pb.StateRequest
    ) -> tuple[pb.StateHeader, bytes | bytearray | memoryview]: ...


def parse_request(message_cls: type[M], raw: bytes) -> M:
    """``raw`` parsed as ``message_cls``; UpdateRejected (``malformed``) if it does not parse."""
    try:
        return message_cls.FromString(raw)
    except DecodeError as err:
        raise malformed(f"undecodable {message_cls.__name__}: {err}") from None


def push_wire_bytes(header: pb.UpdateHeader, payload_size: int, chunk_size: int) -> int:
    """Bytes a push of ``payload_size`` bytes costs on the wire in ``chunk_size`` chunks.

    Counts every gRPC message (the header chunk and each data chunk, serialized) plus gRPC's
    5-byte message framing; HTTP/2 frame headers and HPACK-compressed call headers are not
    counted. This is what ``PushResult.wire_bytes`` reports for a single attempt.
    """
    head = len(UPDATE_CODEC.header_bytes(header))
    return stream_wire_bytes(head, payload_size, chunk_size)
