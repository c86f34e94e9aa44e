"""Relays: a peer that nobody can dial is still called, through a member it dials out to.

A peer behind NAT or a firewall that drops inbound connections (*outbound-only*) keeps one
``Attach`` call open to a reachable member, its *relay*, and advertises the relay's id in its
``PeerInfo.relay``. A caller that wants it does not dial its address; its gRPC client dials a
local endpoint instead (:class:`RelayDialer`), and every connection made there becomes a
byte tunnel:

1. the caller opens ``Relay`` to the relay, first frame ``RelayOpen(sender, target)``;
2. the relay (:class:`RelayHub`) names a new tunnel id on the target's ``Attach`` stream;
3. the target (:class:`Attachment`) opens ``Accept`` to the relay with that id and connects
   it to its own gossip server on loopback;
4. the relay splices the two calls: each frame one side sends, the other side receives.

What travels is the caller's own connection to the target's server, TLS and all: under
mutual TLS the relay sees ciphertext only, cannot alter or forge a byte undetected, and the
target's server admits, limits and times every call exactly as a direct one (the caller's
certificate reaches it end to end). A relay queues nothing of its own: it reads one frame
of a tunnel only once the other side took the one before (gRPC flow control), takes at most
``capacity`` attached peers, :data:`MAX_TUNNELS_PER_PEER` tunnels to each and
:data:`MAX_TUNNELS_PER_CALLER` from each caller.

This module is transport only: which relay to use, and when to choose another, is the
runtime's (``peer/runtime/relaying.py``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator

import grpc
from gossipgrad.peer.network.errors import TransportError, UpdateRejected, from_rpc_error
from gossipgrad.peer.network.framing import data_prefix
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Bytes one tunnel frame carries at most (one socket read). Bulk data costs the relay less
#: CPU per byte in larger frames (256 KiB: 1.7-1.9 s per GB against 3.0-3.2), but two sites
#: behind NAT then ended 4.8x further apart (BENCHMARKS.md, Relays): kept at 64 KiB.
FRAME_BYTES = 64 * 1024
#: Seconds a caller's tunnel waits for the attached peer to accept it.
ACCEPT_TIMEOUT_S = 5.0
#: An idle Attach stream hears from its relay this often (an empty event).
ATTACH_PING_S = 2.0
#: Tunnels one attached peer may have through its relay at once (a caller's client opens
#: two: heartbeats and bulk calls; a third while one reconnects).
MAX_TUNNELS_PER_PEER = 32
#: Tunnels one caller may have open through one relay, all its targets together.
MAX_TUNNELS_PER_CALLER = 16
#: Threads a relay's calls may hold per attached peer: its Attach call and both ends of
#: each tunnel.
THREADS_PER_ATTACHED = 1 + 2 * MAX_TUNNELS_PER_PEER

_CLOSED = 0  # an Attach stream's queue item that ends it


def data_frame(data: bytes | memoryview) -> bytes:
    """A ``RelayFrame`` carrying ``data``, serialized (field 2, like an UpdateChunk's data)."""
    return b"".join((data_prefix(len(data)), data))


def open_frame(request: pb.RelayOpen) -> bytes:
    """The first ``RelayFrame`` of a Relay or Accept call, serialized."""
    return pb.RelayFrame(open=request).SerializeToString()


# --------------------------------------------------------------------------- relay side


class _Attached:
    """One peer attached here: its Attach call and the tunnel ids it has yet to accept."""

    def __init__(self, peer: str, context: grpc.ServicerContext) -> None:
        self.peer = peer
        self.context = context
        self.pending: queue.Queue[int] = queue.Queue()
        self.tunnels = 0


class Tunnel:
    """One caller's connection to an attached peer, spliced at the relay."""

    def __init__(
        self, tunnel_id: int, caller: str, target: str, from_caller: Iterator[bytes], context
    ) -> None:
        self.id = tunnel_id
        self.caller = caller
        self.target = target
        self.from_caller = from_caller
        self.caller_context = context
        self.from_target: Iterator[bytes] | None = None
        self.target_context: grpc.ServicerContext | None = None
        self.accepted = threading.Event()


class RelayHub:
    """The relay's side: who is attached here, and the tunnels to them.

    Args:
        capacity: peers this member relays for at once (0: none; ``peer.relay_capacity``).
        swarm: the swarm's name ("" takes any: a bare transport in tests).
        on_bytes: ``on_bytes(attached peer, n)`` for every frame forwarded to or from it.
        on_load: ``on_load(n)`` with the number of peers attached here after every change
            (called under the hub's lock, in order: keep it short; this member advertises
            it, ``PeerInfo.relaying``).
    """

    def __init__(
        self,
        capacity: int,
        swarm: str = "",
        on_bytes: Callable[[str, int], None] = lambda peer, n: None,
        on_load: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.capacity = capacity
        self.swarm = swarm
        self._on_bytes = on_bytes
        self._on_load = on_load
        self._attached: dict[str, _Attached] = {}
        self._tunnels: dict[int, Tunnel] = {}
        self._by_caller: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: Frames forwarded so far, both ways (with the bytes, what a tunnel costs the relay:
        #: scripts/bench_relay_forwarding.py).
        self.forwarded_frames = 0

    def attached(self) -> list[str]:
        """Ids of the peers attached here now."""
        with self._lock:
            return sorted(self._attached)

    def tunnels(self) -> dict[str, int]:
        """Tunnels open through this relay now, per caller."""
        with self._lock:
            return dict(self._by_caller)

    def _check_swarm(self, swarm: str) -> None:
        if self.swarm and swarm != self.swarm:
            raise UpdateRejected(
                grpc.StatusCode.PERMISSION_DENIED, "unknown_swarm", f"swarm {swarm!r}"
            )

    def attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> Iterator:
        """Attach ``request.peer`` (its claim already checked against the certificate):
        returns its event stream, or raises UpdateRejected (``rate_limited``: full). A peer
        that attaches again replaces its older stream, which ends."""
        self._check_swarm(request.swarm)
        peer = request.peer
        if not peer:
            raise UpdateRejected(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "no peer id")
        entry = _Attached(peer, context)
        with self._lock:
            old = self._attached.get(peer)
            if old is None and len(self._attached) >= self.capacity:
                raise UpdateRejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "rate_limited",
                    f"relaying for {len(self._attached)} peers, its limit "
                    f"(peer.relay_capacity = {self.capacity})",
                )
            self._attached[peer] = entry
            self._on_load(len(self._attached))
        if old is not None:
            old.pending.put(_CLOSED)
        log.info("relaying for %s", peer)
        return self._events(entry)

    def _events(self, entry: _Attached) -> Iterator[pb.AttachEvent]:
        try:
            yield pb.AttachEvent(tunnel=0)
            while entry.context.is_active():
                try:
                    tunnel = entry.pending.get(timeout=ATTACH_PING_S)
                except queue.Empty:
                    tunnel = None
                if tunnel == _CLOSED:
                    return
                yield pb.AttachEvent(tunnel=tunnel or 0)
        finally:
            with self._lock:
                if self._attached.get(entry.peer) is entry:
                    del self._attached[entry.peer]
                    self._on_load(len(self._attached))
                    log.info("no longer relaying for %s", entry.peer)

    def open(
        self,
        request: pb.RelayOpen,
        caller: str,
        from_caller: Iterator[bytes],
        context: grpc.ServicerContext,
    ) -> Tunnel:
        """A tunnel from ``caller`` to ``request.target``, named on the target's Attach
        stream; raises UpdateRejected (NOT_FOUND/``unknown_sender``: not attached here,
        ``rate_limited``: too many tunnels). :meth:`close` it when the call ends."""
        self._check_swarm(request.swarm)
        with self._lock:
            entry = self._attached.get(request.target)
            if entry is None:
                raise UpdateRejected(
                    grpc.StatusCode.NOT_FOUND,
                    "unknown_sender",
                    f"{request.target!r} is not attached to this relay",
                )
            if entry.tunnels >= MAX_TUNNELS_PER_PEER:
                raise UpdateRejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "rate_limited",
                    f"{MAX_TUNNELS_PER_PEER} tunnels to {request.target} open",
                )
            if self._by_caller[caller] >= MAX_TUNNELS_PER_CALLER:
                raise UpdateRejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "rate_limited",
                    f"{MAX_TUNNELS_PER_CALLER} tunnels from {caller} open",
                )
            tunnel = Tunnel(next(self._ids), caller, request.target, from_caller, context)
            self._tunnels[tunnel.id] = tunnel
            self._by_caller[caller] += 1
            entry.tunnels += 1
        entry.pending.put(tunnel.id)
        return tunnel

    def accept(
        self, request: pb.RelayOpen, identity: str | None, from_target: Iterator[bytes], context
    ) -> Tunnel:
        """The attached peer takes tunnel ``request.tunnel``; raises UpdateRejected unless
        it is open, not yet taken and, under TLS, to the caller's certificate."""
        with self._lock:
            tunnel = self._tunnels.get(request.tunnel)
            if tunnel is None or tunnel.accepted.is_set():
                raise UpdateRejected(
                    grpc.StatusCode.NOT_FOUND, "stale", f"no tunnel {request.tunnel} waiting"
                )
            if identity is not None and identity != tunnel.target:
                raise UpdateRejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "unauthenticated",
                    f"tunnel {tunnel.id} is to {tunnel.target}, not {identity}",
                )
            tunnel.from_target = from_target
            tunnel.target_context = context
            tunnel.accepted.set()
        # Either call's end ends the other (add_callback is False once a call has ended).
        for ended, other in (
            (tunnel.caller_context, context),
            (context, tunnel.caller_context),
        ):
            if not ended.add_callback(other.cancel):
                other.cancel()
        return tunnel

    def to_caller(self, tunnel: Tunnel) -> Iterator[bytes]:
        """What the target sends on ``tunnel``, frame by frame (after :meth:`accept`)."""
        return self._forward(tunnel.from_target, tunnel.target)

    def to_target(self, tunnel: Tunnel) -> Iterator[bytes]:
        """What the caller sends on ``tunnel``, frame by frame."""
        return self._forward(tunnel.from_caller, tunnel.target)

    def _forward(self, frames: Iterator[bytes] | None, attached: str) -> Iterator[bytes]:
        # One frame at a time: the next is read only once gRPC sent this one (no queue).
        if frames is None:
            return
        try:
            for raw in frames:
                self._on_bytes(attached, len(raw))
                self.forwarded_frames += 1  # a count for benchmarks: races may lose a few
                yield raw
        except grpc.RpcError:  # the other call ended
            return

    def open_local(self, caller: str, frames: Iterator[bytes]) -> Iterator[pb.RelayFrame]:
        """A tunnel this member opens itself to a peer attached here: what a Relay call to
        its own server does (``frames`` open with a RelayOpen frame; the same bounds, the
        same byte count), without the call, so its own calls to the peers it relays for
        cross no loopback connection and no server threads of its own. Returns the frames
        the target sends (ending when either side does; ``cancel()`` ends it), or raises
        UpdateRejected as :meth:`open` does."""
        try:
            opening = pb.RelayFrame.FromString(next(frames)).open
        except StopIteration:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", "a relay call must open"
            ) from None
        call = _LocalCall()
        return _LocalReplies(self, self.open(opening, caller, frames, call), call)

    def close(self, tunnel: Tunnel) -> None:
        """The caller's call ended: forget the tunnel."""
        with self._lock:
            if self._tunnels.pop(tunnel.id, None) is None:
                return
            self._by_caller[tunnel.caller] -= 1
            if self._by_caller[tunnel.caller] <= 0:
                del self._by_caller[tunnel.caller]
            entry = self._attached.get(tunnel.target)
            if entry is not None and entry.tunnels > 0:
                entry.tunnels -= 1


class _LocalCall:
    """The caller's end of a tunnel a relay opens itself (:meth:`RelayHub.open_local`): what
    the splice needs of a Relay call's context, to end the other call and be ended by it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def is_active(self) -> bool:
        return not self._ended

    def cancel(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class _LocalReplies:
    """The target's frames on a tunnel opened in process, as a Relay call's replies."""

    def __init__(self, hub: RelayHub, tunnel: Tunnel, call: _LocalCall) -> None:
        self._hub = hub
        self._tunnel = tunnel
        self._call = call

    def __iter__(self) -> Iterator[pb.RelayFrame]:
        try:
            if not self._tunnel.accepted.wait(ACCEPT_TIMEOUT_S):
                log.debug("%s did not accept tunnel %d", self._tunnel.target, self._tunnel.id)
                return
            for raw in self._hub.to_caller(self._tunnel):
                if not self._call.is_active():
                    return
                yield pb.RelayFrame.FromString(raw)
        finally:
            self._call.cancel()
            self._hub.close(self._tunnel)

    def cancel(self) -> None:
        self._call.cancel()


# --------------------------------------------------------------------------- both ends


def _pump_in(sock: socket.socket, first: bytes, count: Callable[[int], None]) -> Iterator[bytes]:
    """``first``, then what ``sock`` receives, as RelayFrames, until it closes (read into
    one buffer: a read allocates nothing of FRAME_BYTES, only its frame)."""
    yield first
    buf = bytearray(FRAME_BYTES)
    view = memoryview(buf)
    while True:
        try:
            n = sock.recv_into(buf)
        except OSError:
            return
        if not n:
            return
        count(n)
        yield data_frame(view[:n])


def _pump_out(
    replies: Iterator[pb.RelayFrame], sock: socket.socket, count: Callable[[int], None]
) -> None:
    """Write the data of ``replies`` to ``sock`` until either ends; then close ``sock``."""
    try:
        for frame in replies:
            if frame.WhichOneof("part") == "data":
                count(len(frame.data))
                sock.sendall(frame.data)
    except (grpc.RpcError, OSError) as err:
        log.debug("tunnel ended: %s", err)
    finally:
        _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# --------------------------------------------------------------------------- attached peer

#: ``open_stream(first frame and data frames) -> replies``: a Relay or Accept call.
OpenStream = Callable[[Iterator[bytes]], Iterator[pb.RelayFrame]]


class Attachment:
    """This peer's Attach call to its relay, and the tunnels the relay names on it.

    Args:
        relay: the relay's id (for logs and the byte count).
        attach: ``attach(request)``: the Attach call (a response iterator with ``cancel``).
        accept: opens an Accept call to the relay (:data:`OpenStream`).
        request: this peer's AttachRequest.
        local: ``host:port`` of this peer's own gossip server, as dialled on loopback.
        on_bytes: ``on_bytes(n)`` for every byte a tunnel carries, either way.
    """

    def __init__(
        self,
        relay: str,
        attach: Callable[[pb.AttachRequest], Iterator[pb.AttachEvent]],
        accept: OpenStream,
        request: pb.AttachRequest,
        local: str,
        on_bytes: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.relay = relay
        self._attach = attach
        self._accept = accept
        self._request = request
        self._local = local
        self._on_bytes = on_bytes
        self._call: Iterator[pb.AttachEvent] | None = None
        self._attached = threading.Event()
        self._ended = threading.Event()
        self.error: TransportError | None = None

    def start(self, timeout: float) -> None:
        """Attach; returns once the relay said so, or raises TransportError (refused, or no
        answer within ``timeout``)."""
        self._call = self._attach(self._request)
        threading.Thread(target=self._events, name=f"attach-{self.relay}", daemon=True).start()
        if not self._attached.wait(timeout) or self._ended.is_set():
            self.close()
            raise self.error or TransportError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "", f"relay {self.relay} did not answer"
            )

    @property
    def alive(self) -> bool:
        """Attached, and the call has not ended."""
        return self._attached.is_set() and not self._ended.is_set()

    def wait_ended(self, timeout: float) -> bool:
        """Wait until the Attach call ends (the relay died, left or refused); whether it did."""
        return self._ended.wait(timeout)

    def _events(self) -> None:
        try:
            for event in self._call:
                self._attached.set()
                if event.tunnel:
                    threading.Thread(
                        target=self._serve, args=(event.tunnel,), name="tunnel", daemon=True
                    ).start()
        except grpc.RpcError as err:
            self.error = from_rpc_error(err, 1)
            if self._attached.is_set():
                log.warning("relay %s lost: %s", self.relay, self.error)
        finally:
            self._ended.set()

    def _serve(self, tunnel: int) -> None:
        """Connect tunnel ``tunnel`` to this peer's own server."""
        host, _, port = self._local.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
        except OSError as err:
            log.warning("tunnel %d: own server at %s: %s", tunnel, self._local, err)
            return
        sock.settimeout(None)
        first = open_frame(pb.RelayOpen(swarm=self._request.swarm, tunnel=tunnel))
        try:
            replies = self._accept(_pump_in(sock, first, self._on_bytes))
        except (grpc.RpcError, ValueError) as err:
            log.debug("tunnel %d not accepted: %s", tunnel, err)
            _shut(sock)
            return
        _pump_out(replies, sock, self._on_bytes)
        _cancel(replies)

    def close(self) -> None:
        """End the Attach call (its tunnels end with the relay's calls)."""
        if self._call is not None:
            _cancel(self._call)


def _cancel(call: object) -> None:
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()


# --------------------------------------------------------------------------- caller


class RelayDialer:
    """Local endpoints through which this peer's gRPC clients reach peers behind relays.

    One loopback listener per target peer: a client dials it as it would the peer, and each
    connection it makes is forwarded through the relay the target uses *at that moment*
    (``route``), so a client outlives its target's change of relay.

    Args:
        opener: ``opener(swarm, sender, target)``: the first frame's ``RelayOpen``.
        route: ``route(target)``: ``(relay id, open_stream)`` for the target's relay now
            (:data:`OpenStream` opening a Relay call there), or None if it has none.
        on_bytes: ``on_bytes(relay id, n)`` for every byte a tunnel carries, either way.
    """

    def __init__(
        self,
        opener: Callable[[str], pb.RelayOpen],
        route: Callable[[str], tuple[str, OpenStream] | None],
        on_bytes: Callable[[str, int], None] = lambda relay, n: None,
    ) -> None:
        self._opener = opener
        self._route = route
        self._on_bytes = on_bytes
        self._listeners: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = False

    def endpoint(self, target: str) -> str:
        """``127.0.0.1:port`` to dial for ``target`` (a listener opened on first use)."""
        with self._lock:
            sock = self._listeners.get(target)
            if sock is None:
                if self._closed:
                    raise ValueError("relay dialer closed")
                sock = socket.create_server(("127.0.0.1", 0))
                self._listeners[target] = sock
                threading.Thread(
                    target=self._accept_loop, args=(sock, target), name="relay-dial", daemon=True
                ).start()
        return f"127.0.0.1:{sock.getsockname()[1]}"

    def _accept_loop(self, listener: socket.socket, target: str) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self._forward, args=(conn, target), name="relay-tunnel", daemon=True
            ).start()

    def _forward(self, conn: socket.socket, target: str) -> None:
        route = self._route(target)
        if route is None:
            log.debug("no relay known for %s", target)
            _shut(conn)
            return
        relay, open_stream = route

        def count(n: int) -> None:
            self._on_bytes(relay, n)

        try:
            replies = open_stream(_pump_in(conn, open_frame(self._opener(target)), count))
        except (grpc.RpcError, ValueError) as err:
            log.debug("relay %s for %s: %s", relay, target, err)
            _shut(conn)
            return
        _pump_out(replies, conn, count)
        _cancel(replies)

    def close(self) -> None:
        """Close every listener (tunnels in flight end with their connections)."""
        with self._lock:
            self._closed = True
            listeners, self._listeners = list(self._listeners.values()), {}
        for sock in listeners:
            _shut(sock)
