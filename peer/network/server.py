"""The gossip gRPC server of one peer: admission, then dispatch to a :class:`GossipHandler`.

Every request arrives as raw bytes and is parsed here, so whatever a caller sends ends with a
status that names the problem: bytes that are no valid request get INVALID_ARGUMENT, reason
``malformed``, never gRPC's INTERNAL "Exception deserializing request". Around the parse the
call is admitted (:class:`~gossipgrad.peer.network.admission.Admission`: token, certificate
and, under TLS, the caller's limits and the bulk budget before the request is awaited; the
claimed identity after it), and only then is a buffer allocated or the handler run. Each
refusal by the transport itself is reported to ``on_reject`` so the engine can count it.

Threads: gRPC's synchronous server runs a call's handler on a worker thread from the moment
the call opens. Every method is registered with a streamed request, even those a client
calls as unary (the same bytes on the wire), so the handler runs before the request has come
and can admit the caller and bound the wait: a call whose request does not come within
``request_timeout`` (plus what a chunk takes at ``min_rate_bytes`` for a whole push; a
streamed push has as long for its header, then ``push_deadline`` of its size) is cancelled.
Heartbeats run on a pool of ``heartbeat_slots`` threads of their own, so no number of pushes
and state downloads, stalled or not, leaves a heartbeat waiting for a thread; gRPC's own cap
on concurrent calls, which heartbeats shared, is off.

Handlers refuse a call by raising :class:`UpdateRejected`; the call ends with its status,
detail and the reason token in trailing metadata. Any other handler exception ends the call
with INTERNAL (logged; the server stays up): that is a bug, not a hostile request.

Example::

    server = GossipServer(handler, bind="127.0.0.1:0")
    port = server.start()
    ...
    server.stop(grace=2.0)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, NoReturn, TypeVar

import grpc
from gossipgrad.peer.network import protocol
from gossipgrad.peer.network.admission import Admission, Ticket
from gossipgrad.peer.network.buffers import BufferPool
from gossipgrad.peer.network.deadlines import CallDeadlines, Watch
from gossipgrad.peer.network.errors import BindError, UpdateRejected, abort, malformed
from gossipgrad.peer.network.framing import (
    FrameError,
    StreamedPayload,
    as_bytes_view,
    read_header,
    receive_payload,
    rechunk,
)
from gossipgrad.peer.network.malloc import tune_malloc
from gossipgrad.peer.network.options import TransportOptions, server_channel_args
from gossipgrad.peer.network.pacing import BytePacer
from gossipgrad.peer.network.protocol import (
    STATE_CODEC,
    UPDATE_CODEC,
    GossipHandler,
    parse_request,
    parse_whole_update,
)
from gossipgrad.peer.network.relay import (
    ACCEPT_TIMEOUT_S,
    THREADS_PER_ATTACHED,
    RelayHub,
    open_frame,
)
from gossipgrad.peer.security import TransportSecurity
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest single sleep while a state chunk waits for the rate limit: a cancelled download
#: frees its thread and slots within this.
PACE_SLICE_S = 0.1

#: Largest heartbeat request accepted, bytes: a peer list at its entry cap (4096 entries of
#: about 100 bytes) fits with room to spare; refused (``too_large``) before it is parsed.
MAX_HEARTBEAT_BYTES = 1 << 20

#: A state download whose reader takes no chunk for this long is cancelled (its slots freed).
STATE_STALL_S = 10.0


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
        relays: the relay side of Attach, Relay and Accept (None: relays for nobody).
    """

    def __init__(
        self,
        handler: GossipHandler,
        bind: str = "127.0.0.1:0",
        options: TransportOptions | None = None,
        on_reject: Callable[[str, str], None] | None = None,
        security: TransportSecurity | None = None,
        relays: RelayHub | None = None,
    ) -> None:
        self.handler = handler
        self.bind = bind
        self.options = options or TransportOptions()
        self.on_reject = on_reject
        self.security = security
        self.admission = Admission(self.options, security)
        self.relays = relays if relays is not None else RelayHub(0)
        self._pool = BufferPool(self.options.recv_pool_bytes)
        #: Paces the chunks of every state download this server streams (one shared budget).
        self.state_pacer = BytePacer(self.options.state_rate_bytes, self.options.chunk_size)
        #: Cancels a push that outlives ``push_timeout`` and a download that stalls.
        self.deadlines = CallDeadlines()
        self._server: grpc.Server | None = None
        self._beat_pool: futures.ThreadPoolExecutor | None = None
        self._relay_pool: futures.ThreadPoolExecutor | None = None
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
            self._beat_pool = futures.ThreadPoolExecutor(
                max_workers=o.heartbeat_slots, thread_name_prefix="gossip-heartbeat"
            )
            # Relay calls last as long as a tunnel: threads of their own, as many as the
            # relay's bounds allow, plus a few that refuse the others.
            self._relay_pool = futures.ThreadPoolExecutor(
                max_workers=self.relays.capacity * THREADS_PER_ATTACHED + 4,
                thread_name_prefix="gossip-relay",
            )
            server = grpc.server(
                futures.ThreadPoolExecutor(
                    max_workers=o.bulk_threads, thread_name_prefix="gossip-server"
                ),
                handlers=(self._rpc_handlers(),),
                options=server_channel_args(o),
                maximum_concurrent_rpcs=None,  # admission bounds calls (module docstring)
            )
            try:
                self._port = self._bind(server)
            except OSError:
                self._beat_pool.shutdown(wait=False)
                self._relay_pool.shutdown(wait=False)
                self._beat_pool = self._relay_pool = None
                raise
            server.start()
            self._server = server
            log.info(
                "gossip server listening on %s (%s)",
                self.address,
                "mutual TLS" if self._tls else "plaintext",
            )
            return self._port

    @property
    def _tls(self) -> bool:
        return self.security is not None and self.security.tls

    def _bind(self, server: grpc.Server) -> int:
        try:
            if self._tls:
                port = server.add_secure_port(self.bind, self.security.server_credentials())
            else:
                port = server.add_insecure_port(self.bind)
        except RuntimeError as err:
            raise BindError(
                f"cannot bind gossip server to {self.bind} (peer.listen): {err}"
            ) from err
        if port == 0:
            raise BindError(f"cannot bind gossip server to {self.bind} (peer.listen)")
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
            beat_pool, self._beat_pool = self._beat_pool, None
            relay_pool, self._relay_pool = self._relay_pool, None
        if server is None:
            return
        server.stop(grace).wait()
        for pool in (beat_pool, relay_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self.deadlines.close()
        log.info("gossip server on %s stopped", self.address)

    def __enter__(self) -> GossipServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- plumbing --------------------------------------------------------------------------

    def _rpc_handlers(self) -> grpc.GenericRpcHandler:
        # Requests are deserialized in the handlers (identity deserializers here), and every
        # request is streamed (see the module docstring). Chunk decoding never raises, so it
        # may stay in gRPC's hands.
        return grpc.method_handlers_generic_handler(
            protocol.SERVICE,
            {
                protocol.PUSH: grpc.stream_unary_rpc_method_handler(
                    self._push_update,
                    request_deserializer=UPDATE_CODEC.decode,
                    response_serializer=pb.PushReply.SerializeToString,
                ),
                protocol.PUSH_WHOLE: grpc.stream_unary_rpc_method_handler(
                    self._push_whole_update,
                    response_serializer=pb.PushReply.SerializeToString,
                ),
                protocol.HEARTBEAT: grpc.stream_unary_rpc_method_handler(
                    _OnPool(self._heartbeat, self._beat_pool),
                    response_serializer=pb.HeartbeatReply.SerializeToString,
                ),
                protocol.REACH: grpc.stream_unary_rpc_method_handler(
                    self._check_reachability,
                    response_serializer=pb.ReachabilityReply.SerializeToString,
                ),
                protocol.STATE: grpc.stream_stream_rpc_method_handler(
                    self._download_state,
                    response_serializer=STATE_CODEC.encode,
                ),
                protocol.ATTACH: grpc.stream_stream_rpc_method_handler(
                    _OnPool(self._attach, self._relay_pool),
                    response_serializer=pb.AttachEvent.SerializeToString,
                ),
                protocol.RELAY: grpc.stream_stream_rpc_method_handler(
                    _OnPool(self._relay, self._relay_pool)
                ),
                protocol.ACCEPT: grpc.stream_stream_rpc_method_handler(
                    _OnPool(self._accept, self._relay_pool)
                ),
            },
        )

    def _refuse(self, context: grpc.ServicerContext, err: UpdateRejected) -> NoReturn:
        """End a call the transport itself refuses, reporting it to ``on_reject``."""
        log.debug("call from %s refused: %s", context.peer(), err)
        if self.on_reject is not None:
            try:
                self.on_reject(err.reason, context.peer())
            except Exception:
                log.exception("on_reject callback failed")
        abort(context, err)

    def _refuse_frame(self, context: grpc.ServicerContext, err: FrameError) -> NoReturn:
        code = err.code(malformed=grpc.StatusCode.INVALID_ARGUMENT)
        self._refuse(context, UpdateRejected(code, err.reason, err.why))

    def _or_refuse(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """``fn()``, or end the call with the UpdateRejected it raises (see :meth:`_refuse`)."""
        try:
            return fn()
        except UpdateRejected as err:
            self._refuse(context, err)

    def _guarded(self, what: str, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        """Run the handler in ``fn``: UpdateRejected to its status, anything else to INTERNAL."""
        try:
            return fn()
        except UpdateRejected as err:
            log.debug("%s from %s rejected: %s", what, context.peer(), err)
            abort(context, err)
        except Exception as err:
            if not context.is_active():  # caller went away (cancelled, deadline): not a bug
                log.debug("%s from %s ended early: %r", what, context.peer(), err)
                raise
            log.exception("%s handler failed (peer %s)", what, context.peer())
            context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(err).__name__}")
        raise AssertionError("unreachable")  # context.abort always raises

    # --- admission -------------------------------------------------------------------------

    def _admit_caller(
        self, context: grpc.ServicerContext, bulk: bool, state: bool = False
    ) -> tuple[str | None, Ticket | None]:
        """Before the request is awaited: the token and certificate, and under TLS the
        caller's limits and slots. Returns (certificate identity, ticket or None without
        TLS); ends the call if refused."""
        identity = self._or_refuse(context, lambda: self.admission.authenticate(context))
        ticket = self._or_refuse(
            context, lambda: self.admission.enter_caller(identity, bulk, state)
        )
        return identity, ticket

    def _admit_sender(
        self,
        context: grpc.ServicerContext,
        identity: str | None,
        ticket: Ticket | None,
        claimed: str,
        bulk: bool,
        state: bool = False,
    ) -> Ticket:
        """Once the request names its sender: the claim checked against the certificate
        (``ticket`` from :meth:`_admit_caller`), or without TLS the call admitted now.
        Ends the call if refused (the caller still releases ``ticket``)."""
        if ticket is not None:
            self._or_refuse(context, lambda: self.admission.check_claim(identity, claimed))
            return ticket
        return self._or_refuse(
            context, lambda: self.admission.enter(context, identity, claimed, bulk, state)
        )

    def _request(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """The one message of a request the client sends whole (a unary call on the wire)."""
        raw = next(requests, None)
        if raw is None:
            self._refuse(context, malformed("the call ended without a request"))
        return raw

    # --- calls -----------------------------------------------------------------------------

    def _push_update(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushReply:
        # Whatever the client's deadline (or none), the call ends by the server's own: its
        # header comes with the call, then the body may take as long as its size needs.
        watch = self.deadlines.watch(context, self.options.request_timeout, protocol.PUSH)
        ticket = None
        try:
            identity, ticket = self._admit_caller(context, bulk=True)
            try:
                header = read_header(chunks, UPDATE_CODEC)
            except FrameError as err:
                self._refuse_frame(context, err)
            # The body may take as long as its size needs (capped before any byte is read).
            watch.extend(self.options.push_deadline(header.payload_size))
            ticket = self._admit_sender(context, identity, ticket, header.sender, bulk=True)
            return self._receive_and_deliver(header, chunks, context)
        finally:
            if ticket is not None:
                self.admission.leave(ticket)
            self.deadlines.release(watch)

    def _push_whole_update(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.PushReply:
        o = self.options
        wait = o.request_timeout + o.chunk_size / o.min_rate_bytes  # at most a chunk comes
        watch = self.deadlines.watch(context, wait, protocol.PUSH_WHOLE)
        ticket = None
        try:
            identity, ticket = self._admit_caller(context, bulk=True)
            raw = self._request(requests, context)
            self.deadlines.release(watch)
            update = self._or_refuse(context, lambda: parse_whole_update(raw))
            header = update.header
            ticket = self._admit_sender(context, identity, ticket, header.sender, bulk=True)
            return self._guarded(
                protocol.PUSH_WHOLE,
                context,
                lambda: self._deliver(header, memoryview(update.data), context.peer()),
            )
        finally:
            if ticket is not None:
                self.admission.leave(ticket)
            self.deadlines.release(watch)

    def _receive_and_deliver(
        self, header: pb.UpdateHeader, chunks: Iterator[Any], context: grpc.ServicerContext
    ) -> pb.PushReply:
        size = header.payload_size
        try:
            buf, _ = receive_payload(
                chunks, size, self.options.max_payload_bytes, self._pool.acquire, self._pool.release
            )
        except FrameError as err:
            self._refuse_frame(context, err)
        try:
            # The view lives only for the handler's call, so the buffer can go back to the pool.
            return self._guarded(
                protocol.PUSH,
                context,
                lambda: self._deliver(header, _readonly_prefix(buf, size), context.peer()),
            )
        finally:
            self._pool.release(buf)

    def _deliver(self, header: pb.UpdateHeader, payload: memoryview, peer: str) -> Any:
        reply = self.handler.handle_update(header, payload, peer)
        if not isinstance(reply, pb.PushReply):
            raise TypeError(f"handle_update returned {type(reply).__name__}, not PushReply")
        return reply

    def _heartbeat(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        watch = self.deadlines.watch(context, self.options.request_timeout, protocol.HEARTBEAT)
        ticket = None
        try:
            identity, ticket = self._admit_caller(context, bulk=False)
            raw = self._request(requests, context)
            self.deadlines.release(watch)
            if len(raw) > MAX_HEARTBEAT_BYTES:
                self._refuse(context, _too_large("heartbeat", len(raw), MAX_HEARTBEAT_BYTES))
            request = self._or_refuse(context, lambda: parse_request(pb.HeartbeatRequest, raw))
            ticket = self._admit_sender(context, identity, ticket, request.sender.id, bulk=False)
            return self._guarded(
                protocol.HEARTBEAT, context, lambda: self.handler.handle_heartbeat(request)
            )
        finally:
            if ticket is not None:
                self.admission.leave(ticket)
            self.deadlines.release(watch)

    def _check_reachability(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.ReachabilityReply:
        # A bulk call: the dial-back holds this thread for up to its own deadline, so it
        # takes a bulk slot and counts against the caller's bulk limits like a push.
        watch = self.deadlines.watch(context, self.options.request_timeout, protocol.REACH)
        ticket = None
        try:
            identity, ticket = self._admit_caller(context, bulk=True)
            raw = self._request(requests, context)
            self.deadlines.release(watch)
            request = self._or_refuse(context, lambda: parse_request(pb.ReachabilityRequest, raw))
            ticket = self._admit_sender(context, identity, ticket, request.requester, bulk=True)
            return self._guarded(
                protocol.REACH, context, lambda: self.handler.handle_reachability(request)
            )
        finally:
            if ticket is not None:
                self.admission.leave(ticket)
            self.deadlines.release(watch)

    def _download_state(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        # The request must come within request_timeout; then a reader that stops reading
        # blocks this thread in gRPC's send: cancelled once no chunk has gone for
        # STATE_STALL_S, which frees the thread and the state slot.
        watch = self.deadlines.watch(context, self.options.request_timeout, protocol.STATE)
        ticket = None
        try:
            identity, ticket = self._admit_caller(context, bulk=True, state=True)
            raw = self._request(requests, context)
            watch.extend(STATE_STALL_S)
            request = self._or_refuse(context, lambda: parse_request(pb.StateRequest, raw))
            ticket = self._admit_sender(
                context, identity, ticket, request.requester, bulk=True, state=True
            )
            header, data = self._guarded(protocol.STATE, context, lambda: self._state_for(request))
            for chunk in itertools.chain((STATE_CODEC.header_bytes(header),), data):
                if not self._paced(len(chunk), context, watch):
                    return
                yield chunk
                watch.extend(STATE_STALL_S)
        finally:
            if ticket is not None:
                self.admission.leave(ticket)
            self.deadlines.release(watch)

    # --- relays (peer/network/relay.py) ---------------------------------------------------

    def _opening(
        self, requests: Iterator[bytes], context: grpc.ServicerContext, what: str, cls: type
    ) -> tuple[str | None, Any]:
        """A relay call's caller (certificate identity) and its first request, parsed as
        ``cls``, within ``request_timeout``; ends the call if refused."""
        watch = self.deadlines.watch(context, self.options.request_timeout, what)
        try:
            identity = self._or_refuse(context, lambda: self.admission.authenticate(context))
            raw = self._request(requests, context)
        finally:
            self.deadlines.release(watch)
        return identity, self._or_refuse(context, lambda: parse_request(cls, raw))

    def _attach(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        identity, request = self._opening(requests, context, protocol.ATTACH, pb.AttachRequest)
        self._or_refuse(context, lambda: self.admission.check_claim(identity, request.peer))
        yield from self._or_refuse(context, lambda: self.relays.attach(request, context))

    def _relay(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        identity, frame = self._opening(requests, context, protocol.RELAY, pb.RelayFrame)
        if not frame.HasField("open"):
            self._refuse(context, malformed("a relay call must open with RelayOpen"))
        opening = frame.open
        self._or_refuse(context, lambda: self.admission.check_claim(identity, opening.sender))
        caller = identity or opening.sender or context.peer()
        tunnel = self._or_refuse(
            context, lambda: self.relays.open(opening, caller, requests, context)
        )
        if opening.splice:  # the caller waits to hear how the tunnel goes
            yield open_frame(pb.RelayOpen(tunnel=tunnel.id, ticket=tunnel.caller_ticket))
            if tunnel.tickets:
                return  # spliced: its ends (or its timeout) close it, not this call
        try:
            if not tunnel.accepted.wait(ACCEPT_TIMEOUT_S):
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{opening.target} did not accept the tunnel within {ACCEPT_TIMEOUT_S:g}s",
                )
            yield from self.relays.to_caller(tunnel)
        finally:
            self.relays.close(tunnel)

    def _accept(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        identity, frame = self._opening(requests, context, protocol.ACCEPT, pb.RelayFrame)
        if not frame.HasField("open"):
            self._refuse(context, malformed("an accept call must open with RelayOpen"))
        tunnel = self._or_refuse(
            context, lambda: self.relays.accept(frame.open, identity, requests, context)
        )
        yield from self.relays.to_target(tunnel)

    def _paced(self, nbytes: int, context: grpc.ServicerContext, watch: Watch) -> bool:
        """Wait until ``nbytes`` of state may go (``state_rate_bytes``); False if the caller
        went away meanwhile (cancelled, deadline). Waiting on the pacer is no stall."""
        wait = self.state_pacer.reserve(nbytes)
        end = time.monotonic() + wait
        while wait > 0:
            if not context.is_active():
                return False
            time.sleep(min(wait, PACE_SLICE_S))
            watch.extend(STATE_STALL_S)
            wait = end - time.monotonic()
        return True

    def _state_for(self, request: pb.StateRequest) -> tuple[pb.StateHeader, Iterator[memoryview]]:
        """The handler's state as a header with payload_size set and its data chunks: slices
        of a blob, or of a payload produced as it is sent (:class:`StreamedPayload`)."""
        header, blob = self.handler.handle_state_request(request)
        chunk = self.options.chunk_size
        if isinstance(blob, StreamedPayload):
            size, data = blob.size, rechunk(blob.pieces(), chunk, blob.size)
        else:
            view = as_bytes_view(blob)
            size, data = view.nbytes, (view[i : i + chunk] for i in range(0, view.nbytes, chunk))
        if header.payload_size not in (0, size):
            raise ValueError(f"state header says {header.payload_size} bytes, blob has {size}")
        out = pb.StateHeader()
        out.CopyFrom(header)
        out.payload_size = size
        return out, data


class _OnPool:
    """A method's handler that gRPC runs on ``pool`` instead of the server's own threads
    (gRPC's synchronous server looks for a handler's ``experimental_thread_pool``)."""

    def __init__(self, handler: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> None:
        self._handler = handler
        self.experimental_thread_pool = pool

    def __call__(self, *args: Any) -> Any:
        return self._handler(*args)


def _too_large(what: str, size: int, limit: int) -> UpdateRejected:
    return UpdateRejected(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "too_large",
        f"{what} of {size} bytes exceeds the limit of {limit}",
    )


def _readonly_prefix(buf: bytearray, size: int) -> memoryview:
    """A read-only view of the first ``size`` bytes of ``buf``."""
    with memoryview(buf) as whole:
        return whole[:size].toreadonly()
