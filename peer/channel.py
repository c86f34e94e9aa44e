"""Transport settings, errors and the gRPC channel/server arguments derived from them.

Everything tunable about the gRPC transport lives in :class:`TransportOptions`; the gRPC
channel and server arguments are built from it in one place (:func:`client_channel_args`,
:func:`server_channel_args`), so the two ends always agree on message sizes and keepalive.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import platform
import threading

import grpc
from gossipgrad.peer.metrics import REJECT_REASONS

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30

#: Trailing-metadata key carrying the reject reason token of a refused call.
REASON_METADATA_KEY = "gossipgrad-reject-reason"

#: Bytes a message costs on top of its serialized size: gRPC's length-prefixed framing
#: (1 compressed-flag byte + 4 length bytes). HTTP/2 frame headers are not counted.
GRPC_FRAME_OVERHEAD = 5


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """Limits, deadlines, retries and gRPC knobs of one peer's transport (both ends).

    Durations are in seconds, sizes in bytes. The defaults suit a peer on a wide-area link
    exchanging updates up to a few hundred MB; ``chunk_size`` 1 MiB measured fastest on
    loopback (see BENCHMARKS.md, "Transport").
    """

    #: Payload bytes per streamed chunk (PushUpdate and DownloadState). 256 KiB-1 MiB keep
    #: per-message overhead low without large per-message allocations.
    chunk_size: int = 1 * MiB
    #: Largest update payload the server accepts. Checked against ``header.payload_size``
    #: before any buffer is allocated, then against the running total of received chunks;
    #: larger pushes are refused with RESOURCE_EXHAUSTED (reason ``too_large``).
    max_payload_bytes: int = 1 * GiB
    #: Largest state blob a client accepts from DownloadState (checked against the
    #: StateHeader before allocating).
    max_state_bytes: int = 16 * GiB
    #: Largest single gRPC message either end sends or receives (one chunk plus framing).
    #: gRPC's default is 4 MiB; must exceed ``chunk_size``.
    max_message_bytes: int = 4 * MiB + 64 * 1024
    #: Default deadline of a whole push, retries included.
    push_timeout: float = 30.0
    #: Default deadline of a heartbeat, retries included.
    heartbeat_timeout: float = 5.0
    #: Default deadline of a state download, retries included.
    state_timeout: float = 600.0
    #: Extra attempts after the first for calls failing with a code in ``retry_codes``.
    #: Every call is safe to retry: heartbeats and downloads are reads, and a receiver
    #: deduplicates pushes by their per-edge sequence number.
    retries: int = 3
    #: Status codes (names of :class:`grpc.StatusCode`) worth another attempt.
    retry_codes: tuple[str, ...] = ("UNAVAILABLE",)
    #: First pause between attempts; multiplied by ``backoff_multiplier`` after each retry,
    #: capped at ``backoff_max``, with up to +``backoff_jitter`` relative random jitter.
    backoff_initial: float = 0.1
    backoff_max: float = 2.0
    backoff_multiplier: float = 2.0
    backoff_jitter: float = 0.2
    #: How fast a channel reconnects after losing its server (gRPC's defaults are 1 s
    #: growing to 120 s, far too slow for a peer that restarts).
    reconnect_backoff_initial: float = 0.1
    reconnect_backoff_max: float = 5.0
    #: Client keepalive ping interval and how long to wait for its ack before the
    #: connection is declared dead; pings also flow with no call in flight if permitted.
    keepalive_time: float = 30.0
    keepalive_timeout: float = 10.0
    keepalive_permit_without_calls: bool = True
    #: Worker threads of the (synchronous) gRPC server: one per in-flight call.
    server_threads: int = 16
    #: Calls the server runs at once; more are refused with RESOURCE_EXHAUSTED by gRPC
    #: (bounds memory: each in-flight push may hold up to ``max_payload_bytes``).
    max_concurrent_rpcs: int = 16
    #: HTTP/2 streams one connection may carry at once.
    max_concurrent_streams: int = 32
    #: Calls one caller (certificate identity, else claimed peer id) may have in flight on
    #: this server; more are refused with RESOURCE_EXHAUSTED (reason ``rate_limited``), so a
    #: flood from one peer leaves server threads to the others (0: no limit).
    max_streams_per_peer: int = 8
    #: Sustained calls per second one caller may make (token bucket; 0: no limit), and the
    #: bucket's capacity. Honest peers make about one push per neighbour per round plus a
    #: few heartbeats per second; the defaults leave room for very fast rounds.
    peer_rate: float = 1000.0
    peer_burst: int = 2000
    #: Receive buffers the server keeps for reuse between pushes, in bytes (0 disables).
    #: Reusing buffers avoids page-faulting a fresh buffer per push, the largest cost of a
    #: big push on a busy machine; a buffer the handler keeps a reference to is never reused.
    recv_pool_bytes: int = 1 * GiB
    #: Apply :func:`tune_malloc` when a server starts or a client is created (process-wide,
    #: glibc only). Cuts the receiver's CPU per GB by a fifth to a third (BENCHMARKS.md).
    tune_malloc: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.chunk_size + 64 > self.max_message_bytes:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be at least 64 bytes below "
                f"max_message_bytes {self.max_message_bytes}; raise max_message_bytes"
            )
        for name in ("max_payload_bytes", "max_state_bytes", "recv_pool_bytes", "retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "push_timeout",
            "heartbeat_timeout",
            "state_timeout",
            "keepalive_time",
            "keepalive_timeout",
            "reconnect_backoff_initial",
            "reconnect_backoff_max",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.backoff_initial < 0 or self.backoff_max < self.backoff_initial:
            raise ValueError("need 0 <= backoff_initial <= backoff_max")
        if self.backoff_multiplier < 1 or self.backoff_jitter < 0:
            raise ValueError("need backoff_multiplier >= 1 and backoff_jitter >= 0")
        if self.server_threads < 1 or self.max_concurrent_rpcs < 1:
            raise ValueError("server_threads and max_concurrent_rpcs must be >= 1")
        if self.max_concurrent_streams < 1:
            raise ValueError("max_concurrent_streams must be >= 1")
        if self.max_streams_per_peer < 0 or self.peer_rate < 0 or self.peer_burst < 1:
            raise ValueError("need max_streams_per_peer >= 0, peer_rate >= 0, peer_burst >= 1")
        unknown = [c for c in self.retry_codes if c not in grpc.StatusCode.__members__]
        if unknown:
            raise ValueError(f"retry_codes {unknown} are not grpc.StatusCode names")

    @property
    def retry_status_codes(self) -> frozenset[grpc.StatusCode]:
        """``retry_codes`` as :class:`grpc.StatusCode` members."""
        return frozenset(grpc.StatusCode[c] for c in self.retry_codes)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _common_args(o: TransportOptions) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", o.max_message_bytes),
        ("grpc.max_receive_message_length", o.max_message_bytes),
        # We retry ourselves (with our backoff and a whole-call deadline); gRPC's own
        # transparent retries would buffer streamed chunks for replay.
        ("grpc.enable_retries", 0),
    ]


def client_channel_args(o: TransportOptions) -> list[tuple[str, int]]:
    """gRPC arguments of a client channel to a peer."""
    return [
        *_common_args(o),
        ("grpc.keepalive_time_ms", _ms(o.keepalive_time)),
        ("grpc.keepalive_timeout_ms", _ms(o.keepalive_timeout)),
        ("grpc.keepalive_permit_without_calls", int(o.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", _ms(o.reconnect_backoff_initial)),
        ("grpc.min_reconnect_backoff_ms", _ms(o.reconnect_backoff_initial)),
        ("grpc.max_reconnect_backoff_ms", _ms(o.reconnect_backoff_max)),
    ]


def server_channel_args(o: TransportOptions) -> list[tuple[str, int]]:
    """gRPC arguments of the gossip server."""
    return [
        *_common_args(o),
        ("grpc.max_concurrent_streams", o.max_concurrent_streams),
        # Accept client keepalive pings as often as clients are configured to send them
        # (else the server answers with GOAWAY "too_many_pings").
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _ms(o.keepalive_time) // 2),
        ("grpc.keepalive_permit_without_calls", int(o.keepalive_permit_without_calls)),
        ("grpc.http2.max_ping_strikes", 0),
        # One server per port: a second bind must fail rather than share the port.
        ("grpc.so_reuseport", 0),
    ]


_malloc_lock = threading.Lock()
_malloc_tuned: bool | None = None

#: glibc ``mallopt`` parameters and the values :func:`tune_malloc` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 8 * MiB
MALLOC_TRIM_THRESHOLD = 64 * MiB


def tune_malloc() -> bool:
    """Keep chunk-sized allocations on glibc's heap instead of fresh mmaps; idempotent.

    Every streamed chunk allocates and frees a few buffers of ``chunk_size`` (gRPC read
    slices, the Python ``bytes`` of the message). With glibc's defaults these are served by
    ``mmap``/``munmap`` or trimmed off the heap again, so each one is page-faulted afresh --
    on loopback that was the largest CPU cost of a push after the copies. Fixing the mmap
    threshold at 8 MiB (above any gRPC message we allow by default) and the trim threshold at
    64 MiB -- the same bounds glibc's own dynamic thresholds may grow to -- lets freed chunks be
    reused. Process-wide; returns False (and changes nothing) off glibc.
    """
    global _malloc_tuned
    with _malloc_lock:
        if _malloc_tuned is not None:
            return _malloc_tuned
        _malloc_tuned = False
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
            ok = libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1 and ok
        except (OSError, AttributeError) as err:
            log.debug("mallopt unavailable: %s", err)
            return False
        _malloc_tuned = ok
        log.debug("malloc thresholds tuned: %s", ok)
        return ok


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


class UpdateRejected(TransportError):
    """Raised by a handler to refuse a call; the client receives it as the same class.

    Args:
        code: gRPC status the call ends with (e.g. ``INVALID_ARGUMENT``).
        reason: short token from :data:`gossipgrad.peer.metrics.REJECT_REASONS` (it labels
            a Prometheus counter, so the set is closed).
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
