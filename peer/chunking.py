"""Chunk stream framing and receive buffers of the gRPC transport.

Streamed calls (PushUpdate, DownloadState) carry a ``oneof part {Header header = 1; bytes
data = 2;}`` message per chunk. Wrapping each data chunk in a protobuf object costs a copy
and an allocation per chunk, so :class:`ChunkCodec` writes and reads the data chunks itself:
a data chunk on the wire is exactly the protobuf encoding of ``{data: ...}`` (tag byte 0x12,
varint length, bytes), which any protobuf implementation reads, and any other encoding a
foreign sender produces falls back to the protobuf parser. The gRPC (de)serializers of the
streamed methods are :meth:`ChunkCodec.encode` / :meth:`ChunkCodec.decode`.

:class:`BufferPool` keeps receive buffers between pushes: allocating (and page-faulting) a
fresh buffer per large push costs more CPU than receiving it.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from google.protobuf.message import DecodeError, Message

log = logging.getLogger(__name__)

#: Wire tag of field 2 (``data``), length-delimited: (2 << 3) | 2.
_DATA_TAG = 0x12


class Malformed:
    """What :meth:`ChunkCodec.decode` returns for bytes that are no valid chunk."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"Malformed({self.why!r})"


def varint(n: int) -> bytes:
    """Protobuf base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def data_prefix(n: int) -> bytes:
    """Bytes preceding an ``n``-byte data chunk in its serialized chunk message."""
    return bytes((_DATA_TAG,)) + varint(n)


class ChunkCodec:
    """(De)serializer of one chunk message type (``UpdateChunk`` or ``StateChunk``).

    ``encode`` takes either a protobuf header message (sent wrapped in the chunk's
    ``header`` field), pre-serialized ``bytes`` (sent as is), or a ``memoryview`` of payload
    (sent as a ``data`` chunk). ``decode`` returns the header message, a ``memoryview`` of
    the data (zero-copy on the fast path), or :class:`Malformed`.
    """

    def __init__(self, chunk_cls: type[Message], header_field: str = "header") -> None:
        self._chunk_cls = chunk_cls
        self._header_field = header_field

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
        n = len(raw)
        if n >= 2 and raw[0] == _DATA_TAG:
            length, shift, pos = 0, 0, 1
            while pos < n and pos <= 10:
                byte = raw[pos]
                length |= (byte & 0x7F) << shift
                pos += 1
                if byte < 0x80:
                    if pos + length == n:
                        return memoryview(raw)[pos:]
                    break
                shift += 7
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


class BufferPool:
    """Receive buffers reused across calls, up to ``max_bytes`` kept idle.

    A buffer comes back with :meth:`release`; it is kept only if nothing else references it,
    checked with the reference count: every memoryview, numpy array or slice sharing its memory
    holds a reference to it, so a handler that keeps the payload keeps its buffer out of reuse.
    Thread-safe.
    """

    #: Buffers are allocated in multiples of this, so sizes that vary a little share buffers.
    GRANULE = 1 << 20

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: list[bytearray] = []
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._solo_refs = self._calibrate()

    def _calibrate(self) -> int:
        probe = bytearray(1)
        return self._count_like_release(probe)

    def _count_like_release(self, buf: bytearray) -> int:
        return self._refs_seen_by_release(buf)

    def _refs_seen_by_release(self, buf: bytearray) -> int:
        # Reached from release() and via _count_like_release() from _calibrate() through the
        # same number of frames, so a buffer nobody else references counts as calibrated.
        return sys.getrefcount(buf)

    def acquire(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (contents undefined)."""
        if self.max_bytes and size > 0:
            with self._lock:
                best = None
                for i, buf in enumerate(self._idle):
                    if len(buf) >= size and (best is None or len(buf) < len(self._idle[best])):
                        best = i
                if best is not None:
                    buf = self._idle.pop(best)
                    self._idle_bytes -= len(buf)
                    return buf
            size = -(-size // self.GRANULE) * self.GRANULE
        return bytearray(size)

    def release(self, buf: bytearray) -> bool:
        """Offer ``buf`` back for reuse; returns whether it was kept.

        The caller must hold no other reference (views included) besides ``buf`` itself.
        """
        if not self.max_bytes or len(buf) == 0 or len(buf) > self.max_bytes:
            return False
        if self._refs_seen_by_release(buf) > self._solo_refs:
            log.debug("receive buffer of %d bytes still referenced; not reused", len(buf))
            return False
        with self._lock:
            self._idle.append(buf)
            self._idle_bytes += len(buf)
            while self._idle_bytes > self.max_bytes:
                # Drop the smallest first: big buffers are the costly ones to refault.
                smallest = min(range(len(self._idle)), key=lambda i: len(self._idle[i]))
                self._idle_bytes -= len(self._idle.pop(smallest))
            return any(b is buf for b in self._idle)

    @property
    def idle_bytes(self) -> int:
        """Bytes held in idle buffers."""
        return self._idle_bytes
