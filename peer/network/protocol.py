"""The ``gossipgrad.v1.Gossip`` service as both ends see it: methods, codecs, handler protocol.

Eight methods (proto/gossip.proto):

1. ``PushUpdate`` (client-streaming): an ``UpdateHeader`` chunk, then the payload in data
   chunks (see :mod:`~gossipgrad.peer.network.framing`).
2. ``PushWholeUpdate`` (unary): an update whose header and payload fit in one chunk, as the
   two chunks' bytes back to back (a ``WholeUpdate``). Half a stream's CPU on both ends, so
   every update that fits goes this way (:func:`fits_whole`).
3. ``Heartbeat`` (unary): liveness plus peer exchange.
4. ``DownloadState`` (server-streaming): a ``StateHeader`` chunk, then the state blob.
5. ``CheckReachability`` (unary): a starting peer asks a member to dial it back.
6. ``Attach`` (server-streaming), ``Relay`` and ``Accept`` (bidirectional): a peer nobody can
   dial is called through a relay (:mod:`~gossipgrad.peer.network.relay`).

The server takes every request as raw bytes and parses it itself (:func:`parse_request`, and
:class:`~gossipgrad.peer.network.framing.ChunkCodec` for chunks), so bytes that are no valid
request are refused as ``malformed`` with INVALID_ARGUMENT rather than failing inside gRPC's
deserializer with INTERNAL.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from google.protobuf.message import DecodeError, Message
from gossipgrad.peer.network.errors import malformed
from gossipgrad.peer.network.framing import (
    GRPC_FRAME_OVERHEAD,
    ChunkCodec,
    data_prefix,
    stream_wire_bytes,
)
from gossipgrad.proto import gossip_pb2 as pb

SERVICE = "gossipgrad.v1.Gossip"
PUSH = "PushUpdate"
PUSH_WHOLE = "PushWholeUpdate"
HEARTBEAT = "Heartbeat"
STATE = "DownloadState"
REACH = "CheckReachability"
ATTACH = "Attach"
RELAY = "Relay"
ACCEPT = "Accept"


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

    def handle_reachability(self, request: pb.ReachabilityRequest) -> pb.ReachabilityReply: ...


def parse_request(message_cls: type[M], raw: bytes) -> M:
    """``raw`` parsed as ``message_cls``; UpdateRejected (``malformed``) if it does not parse."""
    try:
        return message_cls.FromString(raw)
    except DecodeError as err:
        raise malformed(f"undecodable {message_cls.__name__}: {err}") from None


def parse_whole_update(raw: bytes) -> pb.WholeUpdate:
    """``raw`` as a ``WholeUpdate`` with a header whose ``payload_size`` is the data's length;
    UpdateRejected (``malformed``) otherwise."""
    update = parse_request(pb.WholeUpdate, raw)
    if not update.HasField("header"):
        raise malformed("whole update without a header")
    if update.header.payload_size != len(update.data):
        raise malformed(
            f"payload of {len(update.data)} bytes, header.payload_size={update.header.payload_size}"
        )
    return update


def whole_update_bytes(head_bytes: int, payload_size: int) -> int:
    """Serialized size of a ``WholeUpdate``: its header chunk (``head_bytes``) and data chunk."""
    return head_bytes + len(data_prefix(payload_size)) + payload_size


def fits_whole(head_bytes: int, payload_size: int, chunk_size: int) -> bool:
    """Whether an update goes in one ``PushWholeUpdate`` message: its serialized header chunk
    (``head_bytes``) and its data chunk together within ``chunk_size`` bytes."""
    return whole_update_bytes(head_bytes, payload_size) <= chunk_size


def whole_update(head: bytes, payload: memoryview) -> bytes:
    """The ``PushWholeUpdate`` request: the header chunk ``head``, then the data chunk."""
    return b"".join((head, data_prefix(payload.nbytes), payload))


def push_wire_bytes(header: pb.UpdateHeader, payload_size: int, chunk_size: int) -> int:
    """Bytes a push of ``payload_size`` bytes costs on the wire with ``chunk_size`` chunks.

    Counts every gRPC message (one ``WholeUpdate`` if :func:`fits_whole`, else the header
    chunk and each data chunk, serialized) plus gRPC's 5-byte message framing; HTTP/2 frame
    headers and HPACK-compressed call headers are not counted. This is what
    ``PushResult.wire_bytes`` reports for a single attempt to a peer that serves
    ``PushWholeUpdate``.
    """
    head = len(UPDATE_CODEC.header_bytes(header))
    if fits_whole(head, payload_size, chunk_size):
        return whole_update_bytes(head, payload_size) + GRPC_FRAME_OVERHEAD
    return stream_wire_bytes(head, payload_size, chunk_size)
