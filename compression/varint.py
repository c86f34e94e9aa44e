"""Protobuf base-128 varints: the one encoder and reader of the compression library.

A varint stores a non-negative integer in 7-bit groups, least significant first, with the high
bit of each byte set on every byte but the last (the protobuf encoding of lengths and keys).
"""

from __future__ import annotations

from gossipgrad.compression.errors import DecodeError

__all__ = ["MAX_VARINT_BYTES", "encode_varint", "read_varint"]

#: A 64-bit value takes at most 10 bytes.
MAX_VARINT_BYTES = 10


def encode_varint(n: int) -> bytes:
    """The varint bytes of ``n`` (``0 <= n < 2**64``; ValueError otherwise)."""
    if not 0 <= n < (1 << 64):
        raise ValueError(f"varint value must be in [0, 2**64), got {n}")
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """Read the varint starting at ``buf[pos]``, not reading at or past ``end``.

    Returns:
        ``(value, position just after the varint)``.

    Raises:
        DecodeError: the varint runs past ``end`` or is longer than 10 bytes.
    """
    value = shift = 0
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 7 * MAX_VARINT_BYTES:
            raise DecodeError(f"varint longer than {MAX_VARINT_BYTES} bytes")
