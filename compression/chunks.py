"""Splitting encoded payloads into stream chunks and joining them back under a size cap."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gossipgrad.compression.errors import DecodeError

__all__ = ["iter_chunks", "join_chunks"]


def iter_chunks(data: bytes, chunk_size: int = 1 << 20) -> Iterator[memoryview]:
    """Yield zero-copy views of ``data`` of at most ``chunk_size`` bytes (gRPC streams cap a
    message at 4 MiB by default). Empty ``data`` yields nothing."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    view = memoryview(data)
    for lo in range(0, len(view), chunk_size):
        yield view[lo : lo + chunk_size]


def join_chunks(chunks: Iterable[bytes | bytearray | memoryview], max_bytes: int) -> bytes:
    """Concatenate streamed chunks, failing as soon as the running total exceeds ``max_bytes``.

    Raises:
        DecodeError: before buffering more than ``max_bytes`` (plus one chunk) in total.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    buf = bytearray()
    for chunk in chunks:
        if len(buf) + len(chunk) > max_bytes:
            raise DecodeError(
                f"payload exceeds {max_bytes} bytes ({len(buf) + len(chunk)} received so far)"
            )
        buf += chunk
    return bytes(buf)
