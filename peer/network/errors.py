"""The gossip protocol's error vocabulary: reject reasons, the exceptions, the status mapping.

A refused call ends with a gRPC status, a human-readable detail and, in trailing metadata
:data:`REASON_METADATA_KEY`, one token of :data:`REJECT_REASONS` saying why. The set is closed
because it labels a Prometheus counter (``gossipgrad_rejected_updates_total{reason}``);
:mod:`gossipgrad.peer.metrics` takes it from here.

Server side, :func:`abort` ends a call with an :class:`UpdateRejected`; client side,
:func:`from_rpc_error` turns the failed call back into the same exception class.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

#: Why a call was refused (the ``reason`` label of ``rejected_updates_total``).
REJECT_REASONS: tuple[str, ...] = (
    "malformed",
    "too_large",
    "unknown_swarm",
    "unknown_sender",
    "fingerprint",
    "decode_error",
    "stale",
    "rate_limited",
    "unauthenticated",
)

#: Trailing-metadata key carrying the reject reason token of a refused call.
REASON_METADATA_KEY = "gossipgrad-reject-reason"


class BindError(OSError):
    """A port this peer serves on could not be opened (in use, or no such address): a start-up
    error the daemon reports in one line."""


class TransportError(grpc.RpcError):
    """A gossip call that failed: the gRPC status, its detail and, if any, the reason token.

    A :class:`grpc.RpcError` with the methods of a failed call (``code()``, ``details()``),
    so code that branches on ``err.code()`` works unchanged.

    Attributes:
        reason: the reject reason token (from :data:`REJECT_REASONS`) when the remote
            handler refused the call, else ``""`` (network failure, deadline, ...).
        detail: human-readable explanation (also ``details()``).
        attempts: how many attempts were made (client side).
    """

    def __init__(self, code: grpc.StatusCode, reason: str, detail: str, attempts: int = 1) -> None:
        super().__init__(f"{code.name}: {reason + ': ' if reason else ''}{detail}")
        self._code = code
        self.reason = reason
        self.detail = detail
        self.attempts = attempts

    def code(self) -> grpc.StatusCode:
        """The gRPC status code the call ended with."""
        return self._code

    def details(self) -> str:
        """The status detail message."""
        return self.detail

    @property
    def refused(self) -> bool:
        """The connection was refused: nothing listens at the address (the peer's process is
        gone, or not started yet). Unlike a timeout, this is a definite answer, and at once."""
        return self._code == grpc.StatusCode.UNAVAILABLE and "connection refused" in (
            self.detail.lower()
        )


class WrongServer(TransportError):
    """A client dialled peer ``expected`` at ``address`` and the server there holds another
    member's certificate (one that does not name ``expected``): nothing is sent to it, and
    the call is not retried. Reason ``unauthenticated``."""

    def __init__(self, address: str, expected: str, attempts: int = 1) -> None:
        super().__init__(
            grpc.StatusCode.UNAUTHENTICATED,
            "unauthenticated",
            f"the server at {address} holds a swarm certificate that is not {expected!r}'s "
            "(another member serves there, or its certificate predates per-peer names and "
            "must be reissued with 'gossipgrad-peer certs')",
            attempts,
        )
        self.address = address
        self.expected = expected


class UpdateRejected(TransportError):
    """Raised by a handler to refuse a call; the client receives it as the same class.

    Args:
        code: gRPC status the call ends with (e.g. ``INVALID_ARGUMENT``).
        reason: short token from :data:`REJECT_REASONS` (it labels a Prometheus counter, so
            the set is closed).
        detail: human-readable explanation sent to the caller.
    """

    def __init__(
        self, code: grpc.StatusCode, reason: str, detail: str = "", attempts: int = 1
    ) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"reject reason {reason!r} is not one of {REJECT_REASONS}")
        if code == grpc.StatusCode.OK:
            raise ValueError("a rejection needs an error status code, not OK")
        super().__init__(code, reason, detail, attempts)


def malformed(why: str) -> UpdateRejected:
    """The refusal of a request that does not parse or does not add up."""
    return UpdateRejected(grpc.StatusCode.INVALID_ARGUMENT, "malformed", why)


def abort(context: grpc.ServicerContext, err: UpdateRejected) -> NoReturn:
    """End the call with ``err``'s status and detail, its reason in trailing metadata."""
    context.set_trailing_metadata(((REASON_METADATA_KEY, err.reason),))
    context.abort(err.code(), err.detail)
    raise AssertionError("unreachable")  # context.abort always raises


def from_rpc_error(err: grpc.RpcError, attempts: int) -> TransportError:
    """The TransportError (or UpdateRejected, if it carries a reason) a failed call stands for."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    detail = err.details() if callable(getattr(err, "details", None)) else str(err)
    reason = ""
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else ()
    for key, value in trailing or ():
        if key == REASON_METADATA_KEY:
            reason = value if isinstance(value, str) else value.decode(errors="replace")
    if reason in REJECT_REASONS:
        return UpdateRejected(code, reason, detail or "", attempts)
    return TransportError(code, reason, detail or "", attempts)
