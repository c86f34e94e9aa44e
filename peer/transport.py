"""The gRPC transport between peers: :class:`GossipServer` and :class:`PeerClient`.

Service ``gossipgrad.v1.Gossip`` (proto/gossip.proto), three methods:

1. ``PushUpdate`` (client-streaming): an ``UpdateHeader`` chunk, then the payload in data
   chunks of ``TransportOptions.chunk_size``. The server checks ``header.payload_size``
   against its limit before allocating, copies chunks into one buffer (reused between
   pushes, see :class:`~gossipgrad.peer.chunking.BufferPool`) while checking the running
   total, and hands header and payload to the handler.
2. ``Heartbeat`` (unary): liveness plus peer exchange.
3. ``DownloadState`` (server-streaming): a ``StateHeader`` chunk, then the state blob.

Security (docs in SECURITY.md): with a :class:`~gossipgrad.peer.security.TransportSecurity`
holding TLS material, the server requires a client certificate signed by the swarm CA (a
client without one fails in the TLS handshake, before any call), and every call's claimed
sender (``UpdateHeader.sender``, ``HeartbeatRequest.sender.id``, ``StateRequest.requester``)
must equal the certificate's common name. A swarm token, if set, must come with every call.
Each caller is then admitted by a :class:`~gossipgrad.peer.limits.PeerLimiter` (calls in
flight, calls per second). All of this happens before a buffer is allocated or the handler
runs; refusals are reported to ``on_reject`` with reason ``unauthenticated`` or
``rate_limited``.

Handlers refuse a call by raising :class:`UpdateRejected`; the call ends with its status,
detail and the reason token in trailing metadata, and the client raises the same exception
class. Any other handler exception ends the call with INTERNAL (logged; the server stays up).

Example::

    server = GossipServer(handler, bind="127.0.0.1:0")
    port = server.start()
    client = PeerClient(server.address)
    reply = client.push(header, payload)          # PushReply; wire bytes in
    client.last_push_wire_bytes                   # ... or use push_detailed()
    client.close(); server.stop(grace=2.0)
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol, TypeVar

import grpc
from gossipgrad.peer.channel import (
    GRPC_FRAME_OVERHEAD,
    REASON_METADATA_KEY,
    TransportError,
    TransportOptions,
    UpdateRejected,
    client_channel_args,
    server_channel_args,
    tune_malloc,
)
from gossipgrad.peer.chunking import BufferPool, ChunkCodec, Malformed, data_prefix
from gossipgrad.peer.limits import PeerLimiter
from gossipgrad.peer.metrics import REJECT_REASONS
from gossipgrad.peer.security import TransportSecurity, peer_identity
from gossipgrad.proto import gossip_pb2 as pb

__all__ = [
    "GossipHandler",
    "GossipServer",
    "PeerClient",
    "PushResult",
    "TransportError",
    "TransportOptions",
    "UpdateRejected",
    "push_wire_bytes",
]

log = logging.getLogger(__name__)

SERVICE = "gossipgrad.v1.Gossip"
_PUSH = f"/{SERVICE}/PushUpdate"
_HEARTBEAT = f"/{SERVICE}/Heartbeat"
_STATE = f"/{SERVICE}/DownloadState"

_UPDATE_CODEC = ChunkCodec(pb.UpdateChunk)
_STATE_CODEC = ChunkCodec(pb.StateChunk)

T = TypeVar("T")


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


def push_wire_bytes(header: pb.UpdateHeader, payload_size: int, chunk_size: int) -> int:
    """Bytes a push of ``payload_size`` bytes costs on the wire in ``chunk_size`` chunks.

    Counts every gRPC message (the header chunk and each data chunk, serialized) plus gRPC's
    5-byte message framing; HTTP/2 frame headers and HPACK-compressed call headers are not
    counted. This is what :attr:`PushResult.wire_bytes` reports for a single attempt.
    """
    total = len(_UPDATE_CODEC.header_bytes(header)) + GRPC_FRAME_OVERHEAD
    full, rest = divmod(payload_size, chunk_size)
    total += full * (len(data_prefix(chunk_size)) + chunk_size + GRPC_FRAME_OVERHEAD)
    if rest:
        total += len(data_prefix(rest)) + rest + GRPC_FRAME_OVERHEAD
    return total


# ---------------------------------------------------------------------------------- server


class GossipServer:
    """The gossip gRPC server of one peer, delegating every call to a handler.

    Args:
        handler: the engine (:class:`GossipHandler`).
        bind: ``host:port`` to listen on; port 0 picks a free port (read it from
            :meth:`start` or :attr:`address`).
        options: transport settings (limits, threads, buffer pool, gRPC arguments).
        on_reject: called as ``on_reject(reason, context_peer)`` whenever the transport
            itself refuses a call (``malformed``, ``too_large``, ``unauthenticated``,
            ``rate_limited``) before the handler sees it, so the engine can count it;
            handler-raised rejections are the handler's to count.
        security: TLS material and/or swarm token (None: plaintext, anyone may call).
    """

    def __init__(
        self,
        handler: GossipHandler,
        bind: str = "127.0.0.1:0",
        options: TransportOptions | None = None,
        on_reject: Callable[[str, str], None] | None = None,
        security: TransportSecurity | None = None,
    ) -> None:
        self.handler = handler
        self.bind = bind
        self.options = options or TransportOptions()
        self.on_reject = on_reject
        self.security = security
        o = self.options
        self.limiter = PeerLimiter(o.max_streams_per_peer, o.peer_rate, o.peer_burst)
        self._pool = BufferPool(self.options.recv_pool_bytes)
        self._server: grpc.Server | None = None
        self._port = 0
        self._lock = threading.Lock()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and start serving; returns the bound port. Raises OSError if binding fails."""
        with self._lock:
            if self._server is not None:
                return self._port
            o = self.options
            if o.tune_malloc:
                tune_malloc()
            server = grpc.server(
                futures.ThreadPoolExecutor(
                    max_workers=o.server_threads, thread_name_prefix="gossip-server"
                ),
                options=server_channel_args(o),
                maximum_concurrent_rpcs=o.max_concurrent_rpcs,
            )
            server.add_generic_rpc_handlers((self._rpc_handlers(),))
            try:
                if self.security is not None and self.security.tls:
                    port = server.add_secure_port(self.bind, self.security.server_credentials())
                else:
                    port = server.add_insecure_port(self.bind)
            except RuntimeError as err:
                raise OSError(f"cannot bind gossip server to {self.bind}: {err}") from err
            if port == 0:
                raise OSError(f"cannot bind gossip server to {self.bind}")
            server.start()
            self._server, self._port = server, port
            log.info(
                "gossip server listening on %s (%s)",
                self.address,
                "mutual TLS" if self.security is not None and self.security.tls else "plaintext",
            )
            return port

    @property
    def port(self) -> int:
        """The bound port (0 before :meth:`start`)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` clients dial: the bind host with the bound port."""
        host = self.bind.rsplit(":", 1)[0]
        return f"{host}:{self._port}"

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop accepting calls, let in-flight ones finish for ``grace`` seconds, cancel the
        rest, and wait until the server is down. Idempotent."""
        with self._lock:
            server, self._server = self._server, None
        if server is None:
            return
        server.stop(grace).wait()
        log.info("gossip server on %s stopped", self.address)

    def __enter__(self) -> GossipServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- calls -----------------------------------------------------------------------------

    def _rpc_handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "PushUpdate": grpc.stream_unary_rpc_method_handler(
                    self._push_update,
                    request_deserializer=_UPDATE_CODEC.decode,
                    response_serializer=pb.PushReply.SerializeToString,
                ),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(
                    self._heartbeat,
                    request_deserializer=pb.HeartbeatRequest.FromString,
                    response_serializer=pb.HeartbeatReply.SerializeToString,
                ),
                "DownloadState": grpc.unary_stream_rpc_method_handler(
                    self._download_state,
                    request_deserializer=pb.StateRequest.FromString,
                    response_serializer=_STATE_CODEC.encode,
                ),
            },
        )

    def _reject(self, context: grpc.ServicerContext, err: UpdateRejected, peer: str) -> None:
        if self.on_reject is not None:
            try:
                self.on_reject(err.reason, peer)
            except Exception:
                log.exception("on_reject callback failed")
        self._abort(context, err)

    @staticmethod
    def _abort(context: grpc.ServicerContext, err: UpdateRejected) -> None:
        context.set_trailing_metadata(((REASON_METADATA_KEY, err.reason),))
        context.abort(err.code(), err.detail)

    def _guarded(self, what: str, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """Run ``fn``, mapping UpdateRejected to its status and anything else to INTERNAL."""
        try:
            return fn()
        except UpdateRejected as err:
            log.debug("%s from %s rejected: %s", what, context.peer(), err)
            self._abort(context, err)
        except Exception as err:
            if not context.is_active():  # caller went away (cancelled, deadline): not a bug
                log.debug("%s from %s ended early: %r", what, context.peer(), err)
                raise
            log.exception("%s handler failed (peer %s)", what, context.peer())
            context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(err).__name__}")
        raise AssertionError("unreachable")  # context.abort always raises

    def _admit(self, context: grpc.ServicerContext, claimed: str) -> str:
        """Authenticate one call and count it against its caller's limits.

        Returns the caller key to pass to ``limiter.leave`` when the call ends; raises
        UpdateRejected (already reported to ``on_reject``) when the call is refused.
        """
        try:
            return self._admission(context, claimed)
        except UpdateRejected as err:
            self._reject(context, err, context.peer())
        raise AssertionError("unreachable")  # _reject always raises

    def _admission(self, context: grpc.ServicerContext, claimed: str) -> str:
        sec = self.security
        identity = None
        if sec is not None:
            if not sec.token_ok(context.invocation_metadata() or ()):
                raise UpdateRejected(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "unauthenticated",
                    "missing or wrong swarm token",
                )
            if sec.tls:
                identity = peer_identity(context)
                if identity is None:
                    raise UpdateRejected(
                        grpc.StatusCode.UNAUTHENTICATED,
                        "unauthenticated",
                        "no client certificate",
                    )
                if claimed != identity:
                    raise UpdateRejected(
                        grpc.StatusCode.PERMISSION_DENIED,
                        "unauthenticated",
                        f"sender {claimed!r} does not match the certificate of {identity!r}",
                    )
        key = identity or claimed or _host_of(context.peer())
        why = self.limiter.enter(key)
        if why is not None:
            raise UpdateRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited", why)
        return key

    def _push_update(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushReply:
        peer = context.peer()
        first = next(chunks, None)
        if not isinstance(first, pb.UpdateHeader):
            why = "empty stream" if first is None else "first chunk is not an UpdateHeader"
            if isinstance(first, Malformed):
                why = first.why
            self._reject(context, _malformed(why), peer)
        header: pb.UpdateHeader = first
        key = self._admit(context, header.sender)
        try:
            return self._push_admitted(header, chunks, context, peer)
        finally:
            self.limiter.leave(key)

    def _push_admitted(
        self,
        header: pb.UpdateHeader,
        chunks: Iterator[Any],
        context: grpc.ServicerContext,
        peer: str,
    ) -> pb.PushReply:
        size = header.payload_size
        limit = self.options.max_payload_bytes
        if size > limit:
            self._reject(
                context,
                UpdateRejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "too_large",
                    f"payload of {size} bytes exceeds this peer's limit of {limit}",
                ),
                peer,
            )
        buf = self._pool.acquire(size)
        try:
            error = self._receive_into(buf, size, chunks)
            if error is not None:
                self._reject(context, error, peer)
            return self._guarded(
                "PushUpdate", context, lambda: self._deliver(header, buf, size, peer)
            )
        finally:
            self._pool.release(buf)

    @staticmethod
    def _receive_into(buf: bytearray, size: int, chunks: Iterator[Any]) -> UpdateRejected | None:
        """Copy data chunks into ``buf``; an error if they do not add up to ``size``."""
        view = memoryview(buf)
        try:
            offset = 0
            for part in chunks:
                if not isinstance(part, memoryview):
                    why = part.why if isinstance(part, Malformed) else "second header in stream"
                    return _malformed(why)
                end = offset + part.nbytes
                if end > size:
                    return _malformed(f"payload longer than header.payload_size={size}")
                view[offset:end] = part
                offset = end
            if offset != size:
                return _malformed(f"payload of {offset} bytes, header.payload_size={size}")
            return None
        finally:
            view.release()

    def _deliver(self, header: pb.UpdateHeader, buf: bytearray, size: int, peer: str) -> Any:
        with memoryview(buf) as whole:
            payload = whole[:size].toreadonly()
        reply = self.handler.handle_update(header, payload, peer)
        if not isinstance(reply, pb.PushReply):
            raise TypeError(f"handle_update returned {type(reply).__name__}, not PushReply")
        return reply

    def _heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        key = self._admit(context, request.sender.id)
        try:
            return self._guarded(
                "Heartbeat", context, lambda: self.handler.handle_heartbeat(request)
            )
        finally:
            self.limiter.leave(key)

    def _download_state(
        self, request: pb.StateRequest, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        key = self._admit(context, request.requester)
        try:
            header, view = self._guarded("DownloadState", context, lambda: self._state_for(request))
            yield header
            step = self.options.chunk_size
            for offset in range(0, view.nbytes, step):
                yield view[offset : offset + step]
        finally:
            self.limiter.leave(key)

    def _state_for(self, request: pb.StateRequest) -> tuple[pb.StateHeader, memoryview]:
        """The handler's state as a header with payload_size set and a byte view of the blob."""
        header, blob = self.handler.handle_state_request(request)
        view = memoryview(blob).cast("B")
        if header.payload_size not in (0, view.nbytes):
            raise ValueError(
                f"state header says {header.payload_size} bytes, blob has {view.nbytes}"
            )
        out = pb.StateHeader()
        out.CopyFrom(header)
        out.payload_size = view.nbytes
        return out, view


def _malformed(why: str) -> UpdateRejected:
    return UpdateRejected(grpc.StatusCode.INVALID_ARGUMENT, "malformed", why)


def _host_of(context_peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4`` (one limiter key per host, not per socket)."""
    return context_peer.rsplit(":", 1)[0] if context_peer.count(":") > 1 else context_peer


# ---------------------------------------------------------------------------------- client


@dataclasses.dataclass(frozen=True)
class PushResult:
    """Outcome of one :meth:`PeerClient.push_detailed`.

    Attributes:
        reply: the receiver's answer.
        wire_bytes: bytes put on the wire by all attempts, counted as in
            :func:`push_wire_bytes` (feed this to the ``sent_bytes`` metric).
        attempts: attempts made (1 = no retry).
        seconds: wall time of the whole call, retries included.
    """

    reply: pb.PushReply
    wire_bytes: int
    attempts: int
    seconds: float


class PeerClient:
    """A channel to one peer's gossip server, with deadlines and retries on every call.

    Every call takes ``timeout`` (seconds, retries included; default from the options) and
    raises :class:`TransportError` on failure, or :class:`UpdateRejected` when the remote
    handler refused the call. Calls failing with a code in ``options.retry_codes`` are
    retried up to ``options.retries`` times with exponential backoff. Thread-safe, except
    that ``last_*`` attributes describe whichever call finished last.
    """

    def __init__(
        self,
        address: str,
        options: TransportOptions | None = None,
        security: TransportSecurity | None = None,
    ) -> None:
        self.address = address
        self.options = options or TransportOptions()
        if self.options.tune_malloc:
            tune_malloc()
        args: list[tuple[str, Any]] = list(client_channel_args(self.options))
        if security is not None and security.tls:
            args += security.channel_args()
            self._channel = grpc.secure_channel(
                address, security.channel_credentials(), options=args
            )
        else:
            self._channel = grpc.insecure_channel(address, options=args)
        self._metadata = security.call_metadata() if security is not None else ()
        self._push = self._channel.stream_unary(
            _PUSH,
            request_serializer=_UPDATE_CODEC.encode,
            response_deserializer=pb.PushReply.FromString,
        )
        self._heartbeat = self._channel.unary_unary(
            _HEARTBEAT,
            request_serializer=pb.HeartbeatRequest.SerializeToString,
            response_deserializer=pb.HeartbeatReply.FromString,
        )
        self._state = self._channel.unary_stream(
            _STATE,
            request_serializer=pb.StateRequest.SerializeToString,
            response_deserializer=_STATE_CODEC.decode,
        )
        self._random = random.Random()
        self._retry_codes = self.options.retry_status_codes
        #: Wire bytes of the last completed push (see :func:`push_wire_bytes`).
        self.last_push_wire_bytes = 0
        #: Wire bytes received by the last completed state download.
        self.last_state_wire_bytes = 0

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
        """Stream one update: the header chunk, then the payload in ``chunk_size`` chunks.

        ``header.payload_size`` must equal the payload length, or be 0 to have it filled in
        (on a copy; the caller's header is not modified).
        """
        view = memoryview(payload)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        size = view.nbytes
        if header.payload_size != size:
            if header.payload_size != 0:
                raise ValueError(
                    f"header.payload_size={header.payload_size} but payload has {size} bytes"
                )
            filled = pb.UpdateHeader()
            filled.CopyFrom(header)
            filled.payload_size = size
            header = filled
        head = _UPDATE_CODEC.header_bytes(header)
        step = self.options.chunk_size
        sent = [0]

        def chunks() -> Iterator[bytes | memoryview]:
            sent[0] += len(head) + GRPC_FRAME_OVERHEAD
            yield head
            for offset in range(0, size, step):
                piece = view[offset : offset + step]
                sent[0] += len(data_prefix(piece.nbytes)) + piece.nbytes + GRPC_FRAME_OVERHEAD
                yield piece

        started = time.monotonic()
        reply, attempts = self._with_retries(
            "PushUpdate",
            timeout if timeout is not None else self.options.push_timeout,
            lambda remaining: self._push(
                chunks(), timeout=remaining, metadata=self._metadata or None
            ),
        )
        self.last_push_wire_bytes = sent[0]
        return PushResult(reply, sent[0], attempts, time.monotonic() - started)

    def heartbeat(
        self, request: pb.HeartbeatRequest, timeout: float | None = None
    ) -> pb.HeartbeatReply:
        """One heartbeat round trip (peer exchange)."""
        reply, _ = self._with_retries(
            "Heartbeat",
            timeout if timeout is not None else self.options.heartbeat_timeout,
            lambda remaining: self._heartbeat(
                request, timeout=remaining, metadata=self._metadata or None
            ),
        )
        return reply

    def download_state(
        self, request: pb.StateRequest, timeout: float | None = None
    ) -> tuple[pb.StateHeader, bytearray]:
        """Download the peer's state: its StateHeader and the blob (a ``bytearray``)."""
        result, _ = self._with_retries(
            "DownloadState",
            timeout if timeout is not None else self.options.state_timeout,
            lambda remaining: self._download_once(request, remaining),
        )
        return result

    def _download_once(
        self, request: pb.StateRequest, remaining: float
    ) -> tuple[pb.StateHeader, bytearray]:
        call = self._state(request, timeout=remaining, metadata=self._metadata or None)
        try:
            first = next(call, None)
            if not isinstance(first, pb.StateHeader):
                raise _bad_state("stream does not start with a StateHeader")
            size = first.payload_size
            if size > self.options.max_state_bytes:
                raise TransportError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "too_large",
                    f"state of {size} bytes exceeds max_state_bytes={self.options.max_state_bytes}",
                )
            blob = bytearray(size)
            received = len(_STATE_CODEC.header_bytes(first)) + GRPC_FRAME_OVERHEAD
            with memoryview(blob) as view:
                offset = 0
                for part in call:
                    if not isinstance(part, memoryview):
                        raise _bad_state("unexpected chunk after the StateHeader")
                    end = offset + part.nbytes
                    if end > size:
                        raise _bad_state(f"state longer than header.payload_size={size}")
                    view[offset:end] = part
                    received += len(data_prefix(part.nbytes)) + part.nbytes + GRPC_FRAME_OVERHEAD
                    offset = end
            if offset != size:
                raise _bad_state(f"state of {offset} bytes, header.payload_size={size}")
        except TransportError:
            call.cancel()
            raise
        self.last_state_wire_bytes = received
        return first, blob

    def close(self) -> None:
        """Close the channel; in-flight calls are cancelled."""
        self._channel.close()

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
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TransportError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "", "deadline spent on retries"
                    )
                return attempt(remaining), attempts
            except TransportError as err:  # raised by us: final (before grpc.RpcError!)
                err.attempts = attempts
                raise
            except grpc.RpcError as err:
                failure = _as_transport_error(err, attempts)
            pause = min(delay, self.options.backoff_max)
            pause *= 1 + self.options.backoff_jitter * self._random.random()
            if (
                failure.code() not in self._retry_codes
                or attempts > self.options.retries
                or time.monotonic() + pause >= deadline
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


def _bad_state(why: str) -> TransportError:
    return TransportError(grpc.StatusCode.DATA_LOSS, "malformed", why)


def _as_transport_error(err: grpc.RpcError, attempts: int) -> TransportError:
    """The TransportError (or UpdateRejected) a failed gRPC call stands for."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    detail = err.details() if callable(getattr(err, "details", None)) else str(err)
    reason = ""
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else ()
    for key, value in trailing or ():
        if key == REASON_METADATA_KEY:
            reason = value if isinstance(value, str) else value.decode()
    if reason in REJECT_REASONS:
        return UpdateRejected(code, reason, detail or "", attempts)
    return TransportError(code, reason, detail or "", attempts)
