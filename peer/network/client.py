"""The client side of the gossip service: :class:`PeerClient`, one per remote peer.

A client holds two gRPC channels to its peer, each on its own TCP connection: one for bulk
calls (pushes, state downloads) and one for heartbeats. A heartbeat therefore never waits
behind the data frames of a large push in the same connection's HTTP/2 flow-control window
or stream limit; the server keeps a separate budget for heartbeats too (see
:mod:`~gossipgrad.peer.network.admission`), so a burst of resyncs cannot starve liveness
into false deaths. The heartbeat connection costs one idle socket per peer; the bulk one is
opened only on the first push or download (gRPC channels connect lazily), so a far peer
that is only heartbeated costs one connection.

Example::

    client = PeerClient("127.0.0.1:7000")
    reply = client.push(header, payload)          # PushReply; wire bytes in
    client.last_push_wire_bytes                   # ... or use push_detailed()
    client.close()
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from gossipgrad.peer.network import framing, protocol
from gossipgrad.peer.network.errors import TransportError, WrongServer, from_rpc_error
from gossipgrad.peer.network.identity import serves_another_member
from gossipgrad.peer.network.malloc import tune_malloc
from gossipgrad.peer.network.options import TransportOptions, client_channel_args
from gossipgrad.peer.network.protocol import STATE_CODEC, UPDATE_CODEC
from gossipgrad.peer.security import TransportSecurity
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PushResult:
    """Outcome of one :meth:`PeerClient.push_detailed`.

    Attributes:
        reply: the receiver's answer.
        wire_bytes: bytes put on the wire by all attempts, counted as in
            :func:`~gossipgrad.peer.network.protocol.push_wire_bytes` (feed this to the
            ``sent_bytes`` metric).
        attempts: attempts made (1 = no retry).
        seconds: wall time of the whole call, retries included.
    """

    reply: pb.PushReply
    wire_bytes: int
    attempts: int
    seconds: float


class PeerClient:
    """Channels to one peer's gossip server, with deadlines and retries on every call.

    Every call takes ``timeout`` (seconds, retries included; default from the options) and
    raises :class:`TransportError` on failure, or :class:`UpdateRejected` when the remote
    handler refused the call. Calls failing with a code in ``options.retry_codes`` are
    retried up to ``options.retries`` times with exponential backoff; a refused connection
    (``TransportError.refused``: nothing listens there) only if ``options.retry_refused``,
    else the caller hears it at once. Thread-safe, except
    that ``last_*`` attributes describe whichever call finished last. After :meth:`close`,
    every call raises TransportError with CANCELLED.

    Under TLS, ``peer`` pins the server's identity: only a server holding ``peer``'s
    certificate is talked to; one holding another member's fails every call with
    :class:`WrongServer` (not retried), and ``on_wrong_server(address, peer)`` hears of
    each. Without ``peer`` (a bootstrap address) any member's certificate is accepted.
    """

    def __init__(
        self,
        address: str,
        options: TransportOptions | None = None,
        security: TransportSecurity | None = None,
        peer: str | None = None,
        on_wrong_server: Callable[[str, str], None] | None = None,
    ) -> None:
        self.address = address
        self.options = options or TransportOptions()
        if self.options.tune_malloc:
            tune_malloc()
        self._security = security
        #: The peer id the server must prove it is (None: any member).
        self.peer = peer or None
        self._on_wrong_server = on_wrong_server
        self._metadata = (security.call_metadata() if security is not None else ()) or None
        self._bulk = self._open_channel()
        self._beat = self._open_channel()
        self._push = self._bulk.stream_unary(
            protocol.method_path(protocol.PUSH),
            request_serializer=UPDATE_CODEC.encode,
            response_deserializer=pb.PushReply.FromString,
        )
        self._push_whole = self._bulk.unary_unary(
            protocol.method_path(protocol.PUSH_WHOLE),
            response_deserializer=pb.PushReply.FromString,
        )
        #: The peer answered PushWholeUpdate with UNIMPLEMENTED (an older version): stream.
        self._stream_only = False
        self._state = self._bulk.unary_stream(
            protocol.method_path(protocol.STATE),
            request_serializer=pb.StateRequest.SerializeToString,
            response_deserializer=STATE_CODEC.decode,
        )
        self._heartbeat = self._beat.unary_unary(
            protocol.method_path(protocol.HEARTBEAT),
            request_serializer=pb.HeartbeatRequest.SerializeToString,
            response_deserializer=pb.HeartbeatReply.FromString,
        )
        self._reach = self._beat.unary_unary(
            protocol.method_path(protocol.REACH),
            request_serializer=pb.ReachabilityRequest.SerializeToString,
            response_deserializer=pb.ReachabilityReply.FromString,
        )
        #: Relay calls (Attach, Relay, Accept) live as long as a tunnel does: they go on a
        #: connection of their own, opened on first use.
        self._tunnel: grpc.Channel | None = None
        self._tunnel_lock = threading.Lock()
        self._random = random.Random()
        self._closed = threading.Event()
        #: Wire bytes of the last completed push (see ``push_wire_bytes``).
        self.last_push_wire_bytes = 0
        #: Wire bytes received by the last completed state download.
        self.last_state_wire_bytes = 0

    def _open_channel(self) -> grpc.Channel:
        args: list[tuple[str, Any]] = list(client_channel_args(self.options))
        sec = self._security
        if sec is not None and sec.tls:
            args += sec.channel_args(self.peer)
            return grpc.secure_channel(self.address, sec.channel_credentials(), options=args)
        return grpc.insecure_channel(self.address, options=args)

    # --- calls -----------------------------------------------------------------------------

    def push(
        self,
        header: pb.UpdateHeader,
        payload: bytes | bytearray | memoryview,
        timeout: float | None = None,
    ) -> pb.PushReply:
        """Stream one update to the peer; returns its reply (see :meth:`push_detailed`)."""
        return self.push_detailed(header, payload, timeout).reply

    def push_detailed(
        self,
        header: pb.UpdateHeader,
        payload: bytes | bytearray | memoryview,
        timeout: float | None = None,
    ) -> PushResult:
        """Send one update: in one unary ``PushWholeUpdate`` if header and payload fit in one
        chunk (half a stream's CPU), else streamed, the header chunk, then the payload in
        ``chunk_size`` chunks. A peer that answers UNIMPLEMENTED to the unary call (an older
        version) is streamed to from then on.

        ``header.payload_size`` must equal the payload length, or be 0 to have it filled in
        (on a copy; the caller's header is not modified).
        """
        view = framing.as_bytes_view(payload)
        head = UPDATE_CODEC.header_bytes(_with_payload_size(header, view.nbytes))
        timeout = timeout if timeout is not None else self.options.push_timeout
        started = time.monotonic()
        if not self._stream_only and protocol.fits_whole(
            len(head), view.nbytes, self.options.chunk_size
        ):
            request = protocol.whole_update(head, view)
            try:
                reply, attempts = self._with_retries(
                    protocol.PUSH_WHOLE,
                    timeout,
                    lambda remaining: self._push_whole(
                        request, timeout=remaining, metadata=self._metadata
                    ),
                )
            except TransportError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("%s does not serve %s: streaming to it", self.address, protocol.PUSH_WHOLE)
                self._stream_only = True
            else:
                wire = attempts * (len(request) + framing.GRPC_FRAME_OVERHEAD)
                self.last_push_wire_bytes = wire
                return PushResult(reply, wire, attempts, time.monotonic() - started)
        sent = framing.WireTally()
        reply, attempts = self._with_retries(
            protocol.PUSH,
            max(0.0, timeout - (time.monotonic() - started)),
            lambda remaining: self._push(
                framing.frames(head, view, self.options.chunk_size, sent),
                timeout=remaining,
                metadata=self._metadata,
            ),
        )
        self.last_push_wire_bytes = sent.bytes
        return PushResult(reply, sent.bytes, attempts, time.monotonic() - started)

    def heartbeat(
        self, request: pb.HeartbeatRequest, timeout: float | None = None
    ) -> pb.HeartbeatReply:
        """One heartbeat round trip (peer exchange), on the heartbeat connection."""
        reply, _ = self._with_retries(
            protocol.HEARTBEAT,
            timeout if timeout is not None else self.options.heartbeat_timeout,
            lambda remaining: self._heartbeat(request, timeout=remaining, metadata=self._metadata),
        )
        return reply

    def check_reachability(
        self, request: pb.ReachabilityRequest, timeout: float
    ) -> pb.ReachabilityReply:
        """Ask the peer to dial this one back (on the heartbeat connection); ``timeout``
        must leave room for the peer's own dial-back deadline."""
        reply, _ = self._with_retries(
            protocol.REACH,
            timeout,
            lambda remaining: self._reach(request, timeout=remaining, metadata=self._metadata),
        )
        return reply

    def download_state(
        self,
        request: pb.StateRequest,
        timeout: float | None = None,
        sink: Callable[[pb.StateHeader], framing.PayloadWriter | None] | None = None,
    ) -> tuple[pb.StateHeader, Any]:
        """Download the peer's state: its StateHeader and the blob (a ``bytearray``), or
        what ``sink(header)`` returned, having been written every data chunk as it came (a
        state read into tensors as it arrives; a sink that returns None: the blob).

        The download may take ``timeout`` (default ``state_timeout``) plus the time its
        declared size needs at the slowest rate expected (:meth:`TransportOptions.
        state_deadline`): a state of many GB over a slow link is not cut off by a deadline
        sized for small ones, and one that stalls is cut off once that time has passed.
        """
        fixed = timeout if timeout is not None else self.options.state_timeout
        result, _ = self._with_retries(
            protocol.STATE,
            self.options.state_deadline(self.options.max_state_bytes, fixed),
            lambda remaining: self._download_once(request, remaining, fixed, sink),
        )
        return result

    def _download_once(
        self,
        request: pb.StateRequest,
        remaining: float,
        fixed: float,
        sink: Callable[[pb.StateHeader], framing.PayloadWriter | None] | None,
    ) -> tuple[pb.StateHeader, Any]:
        started = time.monotonic()
        call = self._state(request, timeout=remaining, metadata=self._metadata)
        timer: threading.Timer | None = None
        cut = threading.Event()  # set when the timer cancels the call
        try:
            header = framing.read_header(call, STATE_CODEC)
            size, limit = header.payload_size, self.options.max_state_bytes
            # From here the call has what its declared size needs (checked against the cap
            # before any byte is written), not the bound of the largest state accepted.
            allowed = self.options.state_deadline(min(size, limit), fixed)
            timer = threading.Timer(
                max(0.0, allowed - (time.monotonic() - started)), _cut, (call, cut)
            )
            timer.daemon = True
            timer.start()
            writer = sink(header) if sink is not None else None
            if writer is None:
                blob, data_wire = framing.receive_payload(call, size, limit, what="state")
            else:
                data_wire = framing.receive_into(call, size, limit, writer.write, what="state")
                blob = writer
        except framing.FrameError as err:
            call.cancel()
            code = err.code(malformed=grpc.StatusCode.DATA_LOSS)
            raise TransportError(code, err.reason, err.why) from None
        except grpc.RpcError:
            if cut.is_set():  # cancelled by the deadline its size allowed
                raise TransportError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "",
                    f"state of {header.payload_size} bytes not downloaded in "
                    f"{time.monotonic() - started:.0f}s",
                ) from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
        head_wire = len(STATE_CODEC.header_bytes(header)) + framing.GRPC_FRAME_OVERHEAD
        self.last_state_wire_bytes = head_wire + data_wire
        return header, blob

    # --- relays (peer/network/relay.py) ---------------------------------------------------

    def _tunnel_channel(self) -> grpc.Channel:
        with self._tunnel_lock:
            if self.closed:
                raise TransportError(grpc.StatusCode.CANCELLED, "", "client closed")
            if self._tunnel is None:
                self._tunnel = self._open_channel()
            return self._tunnel

    def attach(self, request: pb.AttachRequest) -> Any:
        """Open the Attach call to this peer as a relay: an iterator of AttachEvents (with
        ``cancel()``), open until cancelled, the relay gone or the client closed."""
        call = self._tunnel_channel().unary_stream(
            protocol.method_path(protocol.ATTACH),
            request_serializer=pb.AttachRequest.SerializeToString,
            response_deserializer=pb.AttachEvent.FromString,
        )
        return call(request, metadata=self._metadata)

    def relay_stream(self, method: str, frames: Any) -> Any:
        """Open a ``Relay`` or ``Accept`` call (``method``) sending ``frames`` (serialized
        RelayFrames): an iterator of the RelayFrames that come back (with ``cancel()``)."""
        call = self._tunnel_channel().stream_stream(
            protocol.method_path(method), response_deserializer=pb.RelayFrame.FromString
        )
        return call(frames, metadata=self._metadata)

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def close(self) -> None:
        """Close every channel (in-flight calls are cancelled); idempotent."""
        self._closed.set()
        self._bulk.close()
        self._beat.close()
        with self._tunnel_lock:
            tunnel, self._tunnel = self._tunnel, None
        if tunnel is not None:
            tunnel.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- retries ---------------------------------------------------------------------------

    def _with_retries(
        self, what: str, timeout: float, attempt: Callable[[float], T]
    ) -> tuple[T, int]:
        """Run ``attempt(remaining_seconds)`` until success, a final error, or the deadline."""
        deadline = time.monotonic() + timeout
        delay = self.options.backoff_initial
        attempts = 0
        while True:
            attempts += 1
            outcome = self._attempt_once(attempt, deadline, attempts)
            if not isinstance(outcome, TransportError):
                return outcome, attempts
            failure = outcome
            pause = min(delay, self.options.backoff_max)
            pause *= 1 + self.options.backoff_jitter * self._random.random()
            if (
                failure.code() not in self.options.retry_status_codes
                or (failure.refused and not self.options.retry_refused)
                or attempts > self.options.retries
                or time.monotonic() + pause >= deadline
                or self.closed
            ):
                raise failure
            log.info(
                "%s to %s failed (%s); retry %d in %.2fs",
                what,
                self.address,
                failure,
                attempts,
                pause,
            )
            time.sleep(pause)
            delay *= self.options.backoff_multiplier

    def _attempt_once(
        self, attempt: Callable[[float], T], deadline: float, attempts: int
    ) -> T | TransportError:
        """One attempt: its result, or how the gRPC call failed (the caller decides whether to
        retry). Errors of our own (closed client, spent deadline, a bad stream) are raised."""
        remaining = deadline - time.monotonic()
        if self.closed:
            raise TransportError(grpc.StatusCode.CANCELLED, "", "client closed", attempts)
        if remaining <= 0:
            raise TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "", "deadline spent on retries", attempts
            )
        try:
            return attempt(remaining)
        except TransportError as err:  # raised by us: final (before grpc.RpcError!)
            err.attempts = attempts
            raise
        except grpc.RpcError as err:
            failure = from_rpc_error(err, attempts)
        except ValueError:
            if self.closed:  # gRPC refuses calls on a channel closed under our feet
                raise TransportError(
                    grpc.StatusCode.CANCELLED, "", "client closed", attempts
                ) from None
            raise
        if self._serves_another_member(failure, deadline):
            if self._on_wrong_server is not None:
                self._on_wrong_server(self.address, self.peer)
            raise WrongServer(self.address, self.peer, attempts)
        return failure

    def _serves_another_member(self, failure: TransportError, deadline: float) -> bool:
        """Whether a call that failed to connect met a member other than :attr:`peer` (see
        :mod:`~gossipgrad.peer.network.identity`); asked only of pinned TLS clients."""
        sec = self._security
        if (
            self.peer is None
            or sec is None
            or not sec.tls
            or failure.code() != grpc.StatusCode.UNAVAILABLE
            or failure.reason
            or failure.refused
        ):
            return False
        patience = max(0.5, min(2.0, deadline - time.monotonic()))
        return serves_another_member(self.address, sec, self.options, self.peer, patience)


def _with_payload_size(header: pb.UpdateHeader, size: int) -> pb.UpdateHeader:
    """``header`` with ``payload_size == size``: as is, or a filled-in copy if it was 0."""
    if header.payload_size == size:
        return header
    if header.payload_size != 0:
        raise ValueError(f"header.payload_size={header.payload_size} but payload has {size} bytes")
    filled = pb.UpdateHeader()
    filled.CopyFrom(header)
    filled.payload_size = size
    return filled


def _cut(call: grpc.Call, cut: threading.Event) -> None:
    """Cancel a call at the deadline its size allowed (``cut`` tells the reader why)."""
    cut.set()
    call.cancel()
