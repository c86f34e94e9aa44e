"""The one exception every decoder raises on bad input."""

from __future__ import annotations

__all__ = ["DecodeError"]


class DecodeError(ValueError):
    """Bytes that cannot be decoded into the tensor they claim to hold.

    Raised for truncated, oversized, corrupted or inconsistent input and for input that does not
    fit the caller's limits or output tensor. Subclasses ValueError so that callers that only
    know "bad value" still catch it.
    """
