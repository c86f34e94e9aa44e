"""Chunk framing of the streamed calls, written once for PushUpdate and DownloadState.

A streamed call carries one ``oneof part {Header header = 1; bytes data = 2;}`` message per
chunk: first the header, then data chunks adding up to ``header.payload_size``. Both streams
and both directions use the same three pieces:

1. :class:`ChunkCodec`, the gRPC (de)serializer of one chunk type. Wrapping each data chunk
   in a protobuf object costs a copy and an allocation per chunk, so it writes and reads data
   chunks itself: a data chunk on the wire is exactly the protobuf encoding of ``{data:
   ...}`` (tag byte 0x12, varint length, bytes), which any protobuf implementation reads;
   any other encoding a foreign sender produces falls back to the protobuf parser.
2. :func:`frames`, the sending side: the header chunk, then ``chunk_size`` slices of the
   payload, each counted in a :class:`WireTally`; a payload produced as it is sent
   (:class:`StreamedPayload`, a state read off its tensors) is sliced by :func:`rechunk`.
3. :func:`read_header` and :func:`receive_payload`, the receiving side: the first chunk must
   be the header; its declared size is checked against the receiver's cap *before* a buffer
   is allocated, the buffer grows with the bytes that arrive (a declared size alone pins at
   most :data:`EAGER_BYTES`), and the running total is checked against the declared size on
   every chunk. :func:`receive_into` makes the same checks and hands each chunk to a writer
   instead of a buffer (a state read into its tensors as it arrives).

Receive-side problems raise :class:`FrameError` with a reject reason (``malformed`` or
``too_large``); each end maps it to its own status.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from gossipgrad.compression import DecodeError as CompressionDecodeError
from gossipgrad.compression.varint import encode_varint, read_varint

#: Bytes a message costs on top of its serialized size: gRPC's length-prefixed framing
#: (1 compressed-flag byte + 4 length bytes). HTTP/2 frame headers are not counted.
GRPC_FRAME_OVERHEAD = 5

#: A payload up to this size gets its whole buffer at once; a larger one starts here and
#: doubles as its bytes arrive (what a declared size alone can make a receiver hold).
EAGER_BYTES = 4 << 20

#: Wire tag of field 2 (``data``), length-delimited: (2 << 3) | 2.
_DATA_TAG = 0x12


class Malformed:
    """What :meth:`ChunkCodec.decode` returns for bytes that are no valid chunk."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"Malformed({self.why!r})"


class FrameError(Exception):
    """A received chunk stream that is refused: ``reason`` is ``malformed`` or ``too_large``."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason
        self.why = why

    def code(self, malformed: grpc.StatusCode) -> grpc.StatusCode:
        """The status to end with: RESOURCE_EXHAUSTED if too large, else ``malformed``
        (the server answers INVALID_ARGUMENT, a client reading a bad download DATA_LOSS)."""
        return grpc.StatusCode.RESOURCE_EXHAUSTED if self.reason == "too_large" else malformed


def data_prefix(n: int) -> bytes:
    """Bytes preceding an ``n``-byte data chunk in its serialized chunk message."""
    return bytes((_DATA_TAG,)) + encode_varint(n)


def data_chunk_wire_bytes(n: int) -> int:
    """Wire bytes of one ``n``-byte data chunk: prefix, data and gRPC message framing."""
    return len(data_prefix(n)) + n + GRPC_FRAME_OVERHEAD


def stream_wire_bytes(header_bytes: int, payload_size: int, chunk_size: int) -> int:
    """Wire bytes of a whole stream: a serialized header chunk of ``header_bytes``, then
    ``payload_size`` bytes in ``chunk_size`` chunks (what :func:`frames` counts)."""
    full, rest = divmod(payload_size, chunk_size)
    total = header_bytes + GRPC_FRAME_OVERHEAD + full * data_chunk_wire_bytes(chunk_size)
    return total + (data_chunk_wire_bytes(rest) if rest else 0)


class ChunkCodec:
    """(De)serializer of one chunk message type (``UpdateChunk`` or ``StateChunk``).

    ``encode`` takes either a protobuf header message (sent wrapped in the chunk's
    ``header`` field), pre-serialized ``bytes`` (sent as is), or a ``memoryview`` of payload
    (sent as a ``data`` chunk). ``decode`` returns the header message, a ``memoryview`` of
    the data (zero-copy on the fast path), or :class:`Malformed`; it never raises.
    """

    def __init__(self, chunk_cls: type[Message], header_field: str = "header") -> None:
        self._chunk_cls = chunk_cls
        self._header_field = header_field
        field = chunk_cls.DESCRIPTOR.fields_by_name[header_field]
        #: The header message class, e.g. ``UpdateHeader``.
        self.header_cls: type[Message] = getattr(chunk_cls(), header_field).__class__
        self.header_name: str = field.message_type.name

    def header_bytes(self, header: Message) -> bytes:
        """The serialized chunk message carrying ``header``."""
        chunk = self._chunk_cls()
        getattr(chunk, self._header_field).CopyFrom(header)
        return chunk.SerializeToString()

    def encode(self, item: Any) -> bytes:
        """Serialize one outgoing chunk (see the class docstring for accepted items)."""
        if isinstance(item, memoryview):
            return b"".join((data_prefix(item.nbytes), item))
        if isinstance(item, bytes):
            return item
        return self.header_bytes(item)

    def decode(self, raw: bytes) -> Message | memoryview | Malformed:
        """Parse one incoming chunk; never raises on bad input."""
        if len(raw) >= 2 and raw[0] == _DATA_TAG:
            try:
                length, start = read_varint(raw, 1, len(raw))
            except CompressionDecodeError:
                length, start = -1, 0  # cut off or too long: let protobuf say why
            if start + length == len(raw):
                return memoryview(raw)[start:]
        try:
            chunk = self._chunk_cls.FromString(raw)
        except DecodeError as err:
            return Malformed(f"undecodable chunk: {err}")
        which = chunk.WhichOneof("part")
        if which == self._header_field:
            return getattr(chunk, self._header_field)
        if which == "data":
            return memoryview(chunk.data)
        return Malformed("chunk carries neither header nor data")


# ---------------------------------------------------------------------------------- sending


@dataclasses.dataclass
class WireTally:
    """Wire bytes sent so far by :func:`frames` (summed over every stream it is given to)."""

    bytes: int = 0


def frames(
    head: bytes, payload: memoryview, chunk_size: int, tally: WireTally | None = None
) -> Iterator[bytes | memoryview]:
    """The chunks of one stream: the serialized header chunk ``head``, then ``payload`` in
    ``chunk_size`` slices (zero-copy views), adding each one's wire bytes to ``tally``."""
    if tally is not None:
        tally.bytes += len(head) + GRPC_FRAME_OVERHEAD
    yield head
    for offset in range(0, payload.nbytes, chunk_size):
        piece = payload[offset : offset + chunk_size]
        if tally is not None:
            tally.bytes += data_chunk_wire_bytes(piece.nbytes)
        yield piece


@dataclasses.dataclass(frozen=True)
class StreamedPayload:
    """A payload of known ``size`` produced piece by piece as it is sent (a state serialized
    from its tensors), instead of one buffer holding all of it: ``pieces()`` yields views
    adding up to ``size`` bytes, each valid until the next is asked for."""

    size: int
    pieces: Callable[[], Iterator[memoryview]]


def rechunk(pieces: Iterable[memoryview], chunk_size: int, size: int) -> Iterator[memoryview]:
    """``pieces`` as ``chunk_size`` slices (the last one shorter): zero-copy views where a
    slice lies within one piece, else a chunk's worth copied together (small tensors, a
    piece's end). Raises ValueError if they do not add up to ``size`` bytes (a bug of the
    producer: the header declared ``size``)."""
    carry = bytearray()
    total = 0
    for piece in pieces:
        view = as_bytes_view(piece)
        total += view.nbytes
        if total > size:
            raise ValueError(f"payload pieces exceed the declared {size} bytes")
        if carry:
            need = chunk_size - len(carry)
            carry += view[:need]
            view = view[need:]
            if len(carry) < chunk_size:
                continue
            yield memoryview(carry)
            carry = bytearray()
        full = view.nbytes - view.nbytes % chunk_size
        for offset in range(0, full, chunk_size):
            yield view[offset : offset + chunk_size]
        carry += view[full:]
    if total != size:
        raise ValueError(f"payload pieces of {total} bytes, declared {size}")
    if carry:
        yield memoryview(carry)


def as_bytes_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of any bytes-like payload (no copy)."""
    view = memoryview(payload)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


# ---------------------------------------------------------------------------------- receiving


def read_header(chunks: Iterator[Any], codec: ChunkCodec) -> Message:
    """The first chunk of a stream, which must be ``codec``'s header; else FrameError."""
    first = next(chunks, None)
    if isinstance(first, codec.header_cls):
        return first
    if first is None:
        raise FrameError("malformed", "empty stream")
    if isinstance(first, Malformed):
        raise FrameError("malformed", first.why)
    article = "an" if codec.header_name[0] in "AEIOU" else "a"
    raise FrameError("malformed", f"first chunk is not {article} {codec.header_name}")


def receive_payload(
    chunks: Iterator[Any],
    size: int,
    limit: int,
    allocate: Callable[[int], bytearray] = bytearray,
    release: Callable[[bytearray], object] | None = None,
    what: str = "payload",
    eager: int | None = None,
) -> tuple[bytearray, int]:
    """Reassemble the data chunks after a header declaring ``size`` bytes, under ``limit``.

    Steps: 1. refuse ``size > limit`` (reason ``too_large``) before allocating anything;
    2. ``allocate`` a buffer of ``size`` bytes, or of ``eager`` (default
    :data:`EAGER_BYTES`) if that is less, grown by doubling as the data arrives, so a
    header that declares a huge size and sends nothing pins no more than ``eager`` bytes;
    3. copy each data chunk in, refusing a second header, an undecodable chunk or a total
    past ``size`` as soon as it arrives; 4. refuse a total short of ``size``. A buffer
    outgrown or refused goes to ``release`` (FrameError, reason ``malformed``).

    Returns the buffer (its first ``size`` bytes are the payload) and the wire bytes of the
    data chunks received.
    """
    if size > limit:
        raise FrameError(
            "too_large", f"{what} of {size} bytes exceeds the receiver's limit of {limit}"
        )
    fill = _Fill(allocate, release, size, EAGER_BYTES if eager is None else eager)
    why = fill.take(chunks, what)
    if why is None:
        return fill.buf, fill.wire
    if release is not None:
        release(fill.buf)
    raise FrameError("malformed", why)


class PayloadWriter(Protocol):
    """Where :func:`receive_into` hands a payload's chunks as they arrive."""

    def write(self, part: memoryview) -> str | None:
        """Take the next bytes (not kept past the call); why they are refused, or None."""


def receive_into(
    chunks: Iterator[Any],
    size: int,
    limit: int,
    write: Callable[[memoryview], str | None],
    what: str = "payload",
) -> int:
    """Hand the data chunks after a header declaring ``size`` bytes, under ``limit``, to
    ``write`` as they arrive, instead of gathering them in one buffer (e.g. into the tensors
    of a state as it downloads); ``write`` returns why it refuses the bytes, or None, and
    keeps no view past its call. The same checks as :func:`receive_payload`: ``size >
    limit`` refused (``too_large``) before anything is written, a second header, an
    undecodable chunk or a total past or short of ``size`` refused (``malformed``).

    Returns the wire bytes of the data chunks received.
    """
    if size > limit:
        raise FrameError(
            "too_large", f"{what} of {size} bytes exceeds the receiver's limit of {limit}"
        )
    wire = offset = 0
    for part in chunks:
        if not isinstance(part, memoryview):
            why = part.why if isinstance(part, Malformed) else "second header in stream"
            raise FrameError("malformed", why)
        offset += part.nbytes
        if offset > size:
            raise FrameError("malformed", f"{what} longer than header.payload_size={size}")
        why = write(part)
        if why is not None:
            raise FrameError("malformed", why)
        wire += data_chunk_wire_bytes(part.nbytes)
    if offset != size:
        raise FrameError("malformed", f"{what} of {offset} bytes, header.payload_size={size}")
    return wire


class _Fill:
    """A payload being copied in: its buffer, grown as bytes arrive, and the wire bytes."""

    def __init__(
        self,
        allocate: Callable[[int], bytearray],
        release: Callable[[bytearray], object] | None,
        size: int,
        eager: int,
    ) -> None:
        self._allocate = allocate
        self._release = release
        self.size = size
        self.buf = allocate(min(size, max(eager, 1)))
        self.wire = 0
        self.offset = 0

    def _grow(self, needed: int) -> None:
        """A buffer of at least ``needed`` bytes (doubling, never past ``size``) holding
        what arrived so far; the old one goes to ``release``."""
        old = self.buf
        new = self._allocate(min(self.size, max(needed, 2 * len(old))))
        new[: self.offset] = memoryview(old)[: self.offset]
        self.buf = new
        if self._release is not None:
            self._release(old)

    def take(self, chunks: Iterator[Any], what: str) -> str | None:
        """Copy data chunks in; why they do not add up, or None.

        Returns rather than raises, so no traceback keeps this frame (and the buffer) alive
        when the caller hands the buffer back to a pool.
        """
        size = self.size
        for part in chunks:
            if not isinstance(part, memoryview):
                return part.why if isinstance(part, Malformed) else "second header in stream"
            end = self.offset + part.nbytes
            if end > size:
                return f"{what} longer than header.payload_size={size}"
            if end > len(self.buf):
                self._grow(end)
            with memoryview(self.buf) as view:
                view[self.offset : end] = part
            self.wire += data_chunk_wire_bytes(part.nbytes)
            self.offset = end
        if self.offset != size:
            return f"{what} of {self.offset} bytes, header.payload_size={size}"
        return None
