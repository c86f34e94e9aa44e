"""Transport settings and the gRPC channel/server arguments derived from them.

Everything tunable about the gRPC transport lives in :class:`TransportOptions`; the gRPC
channel and server arguments are built from it in one place (:func:`client_channel_args`,
:func:`server_channel_args`), so the two ends always agree on message sizes and keepalive.
"""

from __future__ import annotations

import dataclasses

import grpc

MiB = 1 << 20
GiB = 1 << 30

#: Bulk threads beyond the bulk slots (:attr:`TransportOptions.bulk_threads`).
ADMISSION_THREADS = 4


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """Limits, deadlines, retries and gRPC knobs of one peer's transport (both ends).

    Durations are in seconds, sizes in bytes. The defaults suit a peer on a wide-area link
    exchanging updates up to a few hundred MB; ``chunk_size`` 1 MiB measured fastest on
    loopback (see BENCHMARKS.md, "Transport").
    """

    #: Payload bytes per streamed chunk (PushUpdate and DownloadState). 256 KiB-1 MiB keep
    #: per-message overhead low without large per-message allocations. An update whose
    #: header and payload fit in one chunk goes whole in one unary call (PushWholeUpdate).
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
    #: Default deadline of a whole push, retries included, plus its payload's size over
    #: ``min_rate_bytes`` (:meth:`push_deadline`).
    push_timeout: float = 30.0
    #: The slowest link a push must get through, bytes per second.
    min_rate_bytes: float = 1e6
    #: Default deadline of a heartbeat, retries included.
    heartbeat_timeout: float = 5.0
    #: Deadline of a state download, retries included, plus its size over the slower of
    #: ``min_rate_bytes`` and ``state_rate_bytes`` (:meth:`state_deadline`).
    state_timeout: float = 600.0
    #: Extra attempts after the first for calls failing with a code in ``retry_codes``.
    #: Every call is safe to retry: heartbeats and downloads are reads, and a receiver
    #: deduplicates pushes by their per-edge sequence number.
    retries: int = 3
    #: Status codes (names of :class:`grpc.StatusCode`) worth another attempt.
    retry_codes: tuple[str, ...] = ("UNAVAILABLE",)
    #: Retry a refused connection too (UNAVAILABLE with nothing listening at the address),
    #: e.g. to wait within a call for a server restarting on the same port. Off by default:
    #: a refused address is a process that is gone, the caller should hear it at once (a
    #: peer then bridges over the crashed neighbour), and its next round tries again anyway.
    retry_refused: bool = False
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
    #: Worker threads of the (synchronous) gRPC server for bulk calls (pushes and state
    #: downloads): ``max(server_threads, max_concurrent_rpcs)``, so every admitted bulk call
    #: has one, plus a few that refuse the others (:attr:`bulk_threads`). Heartbeats run
    #: on ``heartbeat_slots`` threads of their own.
    server_threads: int = 16
    #: Bulk calls (pushes and state downloads) the server runs at once; more are refused
    #: with RESOURCE_EXHAUSTED, reason ``rate_limited`` (bounds memory: each in-flight push
    #: may hold up to ``max_payload_bytes``).
    max_concurrent_rpcs: int = 16
    #: State downloads served at once (each holds a serialised copy of the state); more are
    #: refused with RESOURCE_EXHAUSTED, reason ``rate_limited``, so a joiner moves on to
    #: another donor. Counted within ``max_concurrent_rpcs``.
    max_state_downloads: int = 2
    #: Bytes per second this server streams state at, all downloads together (token bucket
    #: of one chunk, see :mod:`~gossipgrad.peer.network.pacing`; 0: unlimited).
    state_rate_bytes: float = 0.0
    #: Threads that serve heartbeats and nothing else: however many pushes and downloads
    #: are in flight or stalled, a heartbeat is served at once, so bulk transfers never
    #: starve liveness.
    heartbeat_slots: int = 8
    #: Heartbeats one caller may have in flight on this server (more are refused,
    #: ``rate_limited``): with ``request_timeout``, what one member can hold of the
    #: heartbeat threads. An honest peer has one at a time, two while it says goodbye.
    heartbeats_per_peer: int = 2
    #: Seconds the server waits for what a client sends with the call: the request of a
    #: heartbeat or state download, a push's header (a whole push: plus ``chunk_size`` at
    #: ``min_rate_bytes``). A call whose request has not come by then is cancelled, freeing
    #: its thread and slots.
    request_timeout: float = 2.0
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
    #: Kept small: a pooled buffer the size of a dense resync would be a model-sized
    #: allocation kept between rounds; sparse updates' buffers fit.
    recv_pool_bytes: int = 64 * MiB
    #: Apply :func:`tune_malloc` when a server starts or a client is created (process-wide,
    #: glibc only). Cuts the receiver's CPU per GB by a fifth to a third (BENCHMARKS.md).
    tune_malloc: bool = True

    def push_deadline(self, payload_bytes: int) -> float:
        """Seconds a push of ``payload_bytes`` may take: ``push_timeout`` plus the time the
        payload needs at ``min_rate_bytes``, so a dense resync of a large model over a slow
        link is not cancelled (and sent again, forever) by a deadline sized for sparse ones."""
        return self.push_timeout + payload_bytes / self.min_rate_bytes

    def state_deadline(self, payload_bytes: int, fixed: float | None = None) -> float:
        """Seconds a state download of ``payload_bytes`` may take: ``fixed`` (default
        ``state_timeout``) plus the payload's time at ``min_rate_bytes``, or at
        ``state_rate_bytes`` where donors serve slower than that (a 100M-parameter state with
        AdamW's moments and a diloco anchor, 1.6 GB, needs 128 s at 100 Mbit/s, past a fixed
        120 s)."""
        rate = self.min_rate_bytes
        if self.state_rate_bytes:
            rate = min(rate, self.state_rate_bytes)
        return (self.state_timeout if fixed is None else fixed) + payload_bytes / rate

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
            "min_rate_bytes",
            "heartbeat_timeout",
            "request_timeout",
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
        if (
            min(
                self.server_threads,
                self.max_concurrent_rpcs,
                self.heartbeat_slots,
                self.heartbeats_per_peer,
            )
            < 1
        ):
            raise ValueError(
                "server_threads, max_concurrent_rpcs, heartbeat_slots and heartbeats_per_peer "
                "must be >= 1"
            )
        if self.heartbeat_slots <= self.heartbeats_per_peer:
            raise ValueError(
                f"heartbeat_slots ({self.heartbeat_slots}) must exceed heartbeats_per_peer "
                f"({self.heartbeats_per_peer}), else one caller can hold every heartbeat thread"
            )
        if self.max_state_downloads < 1 or self.state_rate_bytes < 0:
            raise ValueError("need max_state_downloads >= 1 and state_rate_bytes >= 0")
        if self.max_concurrent_streams < 1:
            raise ValueError("max_concurrent_streams must be >= 1")
        if self.max_streams_per_peer < 0 or self.peer_rate < 0 or self.peer_burst < 1:
            raise ValueError("need max_streams_per_peer >= 0, peer_rate >= 0, peer_burst >= 1")
        unknown = [c for c in self.retry_codes if c not in grpc.StatusCode.__members__]
        if unknown:
            raise ValueError(f"retry_codes {unknown} are not grpc.StatusCode names")

    @property
    def bulk_threads(self) -> int:
        """Threads of the server's bulk pool: one per bulk call it admits, and
        :data:`ADMISSION_THREADS` more that admit or refuse calls while every bulk slot is
        taken (a call refused for want of a slot needs a thread to be told so)."""
        return max(self.server_threads, self.max_concurrent_rpcs) + ADMISSION_THREADS

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
    """gRPC arguments of a client channel to a peer.

    Each channel gets its own subchannel pool, hence its own TCP connection: two channels
    to one address (bulk and heartbeats, see ``PeerClient``) never share HTTP/2 flow
    control or stream limits.
    """
    return [
        *_common_args(o),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.keepalive_time_ms", _ms(o.keepalive_time)),
        ("grpc.keepalive_timeout_ms", _ms(o.keepalive_timeout)),
        ("grpc.keepalive_permit_without_calls", int(o.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", 0),
        # Not grpc.min_reconnect_backoff_ms: gRPC gives each connection attempt at least
        # that long (20 s by default), and a short one cut off TLS handshakes over a WAN.
        ("grpc.initial_reconnect_backoff_ms", _ms(o.reconnect_backoff_initial)),
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
