"""Relays: a peer that nobody can dial is still called, through a member it dials out to.

A peer behind NAT or a firewall that drops inbound connections (*outbound-only*) keeps one
``Attach`` call open to a reachable member, its *relay*, and advertises the relay's id in its
``PeerInfo.relay``. A caller that wants it does not dial its address; its gRPC client dials a
local endpoint instead (:class:`RelayDialer`), and every connection made there becomes a
byte tunnel:

1. the caller opens ``Relay`` to the relay, first frame ``RelayOpen(sender, target)``;
2. the relay (:class:`RelayHub`) names a new tunnel id on the target's ``Attach`` stream;
3. the target (:class:`Attachment`) connects the tunnel to its own gossip server on
   loopback;
4. the relay splices the two ends.

The ends are plain TCP connections to the relay's *raw tunnel listener*
(``PeerInfo.relay_port``) wherever both can reach it: the relay answers the Relay call with a
ticket for the caller and names the tunnel with another on the Attach stream, each end
connects to the listener and sends its ticket, and the relay copies bytes between the two
connections (:func:`splice`), a few system calls per read. Otherwise (the listener is off
or blocked, or either end reaches the relay only through an emulated link) the caller's
Relay call and the target's ``Accept`` call carry the bytes as frames, which costs the relay
gRPC's handling of two messages per frame, some 0.2 ms each (BENCHMARKS.md, Relays).

What travels is the caller's own connection to the target's server, TLS and all: under
mutual TLS the relay sees ciphertext only, cannot alter or forge a byte undetected, and the
target's server admits, limits and times every call exactly as a direct one (the caller's
certificate reaches it end to end). A relay queues nothing of its own: it reads from one end
only once the other took what it read before (a blocking send, or gRPC flow control), takes
at most ``capacity`` attached peers, :data:`MAX_TUNNELS_PER_PEER` tunnels to each and
:data:`MAX_TUNNELS_PER_CALLER` from each caller. A ticket is single-use and names one end of
one tunnel; a connection to the listener that does not send a live one within
:data:`ACCEPT_TIMEOUT_S` is closed.

This module is transport only: which relay to use, and when to choose another, is the
runtime's (``peer/runtime/relaying.py``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

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
#: Bytes one read of a spliced tunnel takes at most (into a buffer kept for the tunnel).
SPLICE_BYTES = 256 * 1024
#: What a connection to a relay's raw tunnel listener sends first, then its ticket.
SPLICE_MAGIC = b"GGT1"
TICKET_BYTES = 16
#: Connections a raw tunnel listener holds at once before they name their tunnel.
MAX_UNNAMED = 64
#: Seconds to connect to a relay's raw tunnel listener (more: use gRPC calls instead).
SPLICE_CONNECT_TIMEOUT_S = 2.0

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

    def __init__(self, peer: str, context: grpc.ServicerContext, splice: bool) -> None:
        self.peer = peer
        self.context = context
        self.splice = splice  # it reached the raw tunnel listener
        self.pending: queue.Queue[Tunnel | int] = queue.Queue()
        self.tunnels = 0


class Tunnel:
    """One caller's connection to an attached peer, spliced at the relay: two raw
    connections to its listener (``tickets`` set), or a Relay and an Accept call."""

    def __init__(
        self,
        tunnel_id: int,
        caller: str,
        target: str,
        from_caller: Iterator[bytes] | None,
        context,
        spliced: bool = False,
    ) -> None:
        self.id = tunnel_id
        self.caller = caller
        self.target = target
        self.from_caller = from_caller
        self.caller_context = context
        self.from_target: Iterator[bytes] | None = None
        self.target_context: grpc.ServicerContext | None = None
        self.accepted = threading.Event()
        #: The caller's ticket and the target's (spliced), else None.
        self.tickets: tuple[bytes, bytes] | None = (
            (secrets.token_bytes(TICKET_BYTES), secrets.token_bytes(TICKET_BYTES))
            if spliced
            else None
        )
        #: A spliced tunnel's ends connected so far: 0 the caller's, 1 the target's.
        self.ends: dict[int, socket.socket] = {}
        self.opened_at = time.monotonic()

    @property
    def caller_ticket(self) -> bytes:
        """What the caller sends first on its raw connection (b"": not spliced)."""
        return self.tickets[0] if self.tickets else b""

    @property
    def target_ticket(self) -> bytes:
        """What the target sends first on its raw connection (b"": not spliced)."""
        return self.tickets[1] if self.tickets else b""


class RelayHub:
    """The relay's side: who is attached here, and the tunnels to them.

    Args:
        capacity: peers this member relays for at once (0: none; ``peer.relay_capacity``).
        swarm: the swarm's name ("" takes any: a bare transport in tests).
        on_bytes: ``on_bytes(attached peer, n)`` for every frame forwarded to or from it.
        on_load: ``on_load(n)`` with the number of peers attached here after every change
            (called under the hub's lock, in order: keep it short; this member advertises
            it, ``PeerInfo.relaying``).
        on_tunnel: ``on_tunnel(how)`` for every tunnel opened: "spliced" or "calls".
    """

    def __init__(
        self,
        capacity: int,
        swarm: str = "",
        on_bytes: Callable[[str, int], None] = lambda peer, n: None,
        on_load: Callable[[int], None] = lambda n: None,
        on_tunnel: Callable[[str], None] = lambda how: None,
    ) -> None:
        self.capacity = capacity
        self._on_tunnel = on_tunnel
        self.swarm = swarm
        self._on_bytes = on_bytes
        self._on_load = on_load
        self._attached: dict[str, _Attached] = {}
        self._tunnels: dict[int, Tunnel] = {}
        # ticket -> (tunnel, end): the spliced tunnels' ends not yet connected
        self._tickets: dict[bytes, tuple[Tunnel, int]] = {}
        self._listener: socket.socket | None = None
        self._unnamed = threading.BoundedSemaphore(MAX_UNNAMED)
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
        entry = _Attached(peer, context, request.splice)
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
                    yield pb.AttachEvent(tunnel=0)
                    continue
                if tunnel == _CLOSED:
                    return
                yield pb.AttachEvent(tunnel=tunnel.id, ticket=tunnel.target_ticket)
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
        ``rate_limited``: too many tunnels). Spliced at the raw tunnel listener when the
        caller asks (``request.splice``) and the target reached it too: then the tunnel's
        ends close it (or its :data:`ACCEPT_TIMEOUT_S` running out before both connected);
        else :meth:`close` it when the call ends."""
        self._check_swarm(request.swarm)
        with self._lock:
            stale = self._expire_locked()
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
            spliced = request.splice and entry.splice and self._listener is not None
            tunnel = Tunnel(next(self._ids), caller, request.target, from_caller, context, spliced)
            self._tunnels[tunnel.id] = tunnel
            for end, ticket in enumerate(tunnel.tickets or ()):
                self._tickets[ticket] = (tunnel, end)
            self._by_caller[caller] += 1
            entry.tunnels += 1
        for sock in stale:
            _shut(sock)
        self._on_tunnel("spliced" if spliced else "calls")
        entry.pending.put(tunnel)
        return tunnel

    def _expire_locked(self) -> list[socket.socket]:
        """Forget the spliced tunnels whose ends did not both connect in time (an end
        waiting for the other closes its own connection); returns the connections to close."""
        now = time.monotonic()
        stale = [
            t
            for t in self._tunnels.values()
            if t.tickets and len(t.ends) < 2 and now - t.opened_at > 2 * ACCEPT_TIMEOUT_S
        ]
        socks = []
        for tunnel in stale:
            socks.extend(tunnel.ends.values())
            self._forget_locked(tunnel)
        return socks

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

    # --- the raw tunnel listener: spliced tunnels -------------------------------------------

    @property
    def port(self) -> int:
        """The raw tunnel listener's port (0: not listening)."""
        listener = self._listener
        return listener.getsockname()[1] if listener is not None else 0

    def listen(self, host: str, port: int = 0) -> int:
        """Open the raw tunnel listener on ``host:port`` (0: any free port); returns the
        port. Until then every tunnel goes through gRPC calls."""
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server(
            (host, port),
            family=family,
            backlog=MAX_UNNAMED,
            dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6(),
        )
        self._listener = listener
        threading.Thread(
            target=self._accept_raw, args=(listener,), name="relay-listen", daemon=True
        ).start()
        return listener.getsockname()[1]

    def stop_listening(self) -> None:
        """Close the raw tunnel listener and end every spliced tunnel (both ends see their
        connection end, as a tunnel in calls does when the server stops)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            _shut(listener)
        with self._lock:
            ends = [sock for t in self._tunnels.values() if t.tickets for sock in t.ends.values()]
        for sock in ends:  # the splice's threads close them
            _end(sock)

    def _accept_raw(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed
                return
            if not self._unnamed.acquire(blocking=False):
                _shut(conn)
                continue
            threading.Thread(
                target=self._named, args=(conn,), name="relay-raw", daemon=True
            ).start()

    def _named(self, conn: socket.socket) -> None:
        """Read a raw connection's ticket and join it to its tunnel (else close it)."""
        try:
            conn.settimeout(ACCEPT_TIMEOUT_S)
            header = _read_exactly(conn, len(SPLICE_MAGIC) + TICKET_BYTES)
            conn.settimeout(None)
        except OSError:
            header = b""
        finally:
            self._unnamed.release()
        with self._lock:
            found = self._tickets.get(header[len(SPLICE_MAGIC) :])
        if not header.startswith(SPLICE_MAGIC) or found is None:
            log.debug("raw tunnel connection without a live ticket: closed")
            _shut(conn)
            return
        self._join(*found, conn)

    def _join(self, tunnel: Tunnel, end: int, conn: socket.socket) -> None:
        """End ``end`` of spliced ``tunnel`` connected: wait for the other (the second to
        come splices them, in its thread, until either closes), at most ACCEPT_TIMEOUT_S."""
        _no_delay(conn)
        second = False
        with self._lock:
            live = self._tunnels.get(tunnel.id) is tunnel and end not in tunnel.ends
            if live:
                tunnel.ends[end] = conn
                self._tickets.pop(tunnel.tickets[end], None)
                second = len(tunnel.ends) == 2
                if second:
                    tunnel.accepted.set()
        if not live:
            _shut(conn)
            return
        if not second:
            if tunnel.accepted.wait(ACCEPT_TIMEOUT_S):
                return
            with self._lock:
                late = not tunnel.accepted.is_set()
                if late:
                    self._forget_locked(tunnel)
            if late:
                log.debug("tunnel %d: the other end did not connect", tunnel.id)
                _shut(conn)
            return
        try:
            self._splice(tunnel)
        finally:
            self.close(tunnel)

    def _splice(self, tunnel: Tunnel) -> None:
        def count(n: int) -> None:
            self._on_bytes(tunnel.target, n)
            self.forwarded_frames += 1  # reads, for benchmarks: races may lose a few

        splice(tunnel.ends[0], tunnel.ends[1], count)

    def can_splice(self, target: str) -> bool:
        """Whether a tunnel to ``target`` would be spliced (listening, and it reached the
        listener when it attached)."""
        with self._lock:
            entry = self._attached.get(target)
            return self._listener is not None and entry is not None and entry.splice

    def open_spliced(self, opening: pb.RelayOpen, caller: str, conn: socket.socket) -> bool:
        """A spliced tunnel this member opens itself to a peer attached here, its end the
        connection ``conn`` (no ticket, no listener crossed): False if the tunnel would not
        be spliced; blocks until the target's end connected (then it splices), or raises
        UpdateRejected as :meth:`open` does."""
        if not self.can_splice(opening.target):
            return False
        request = pb.RelayOpen()
        request.CopyFrom(opening)
        request.splice = True
        tunnel = self.open(request, caller, None, _LocalCall())
        if not tunnel.tickets:  # the target re-attached meanwhile without the listener
            self.close(tunnel)
            return False
        self._join(tunnel, 0, conn)
        return True

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
        """The caller's call ended (or a spliced tunnel's ends): forget the tunnel."""
        with self._lock:
            self._forget_locked(tunnel)

    def _forget_locked(self, tunnel: Tunnel) -> None:
        if self._tunnels.pop(tunnel.id, None) is None:
            return
        for ticket in tunnel.tickets or ():
            self._tickets.pop(ticket, None)
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


def splice(a: socket.socket, b: socket.socket, count: Callable[[int], None]) -> None:
    """Copy bytes both ways between ``a`` and ``b`` until either closes or fails, then close
    both; ``count(n)`` for every read. Blocks (one direction on a thread of its own)."""
    other = threading.Thread(target=_copy, args=(b, a, count), name="splice", daemon=True)
    other.start()
    _copy(a, b, count)
    other.join()
    a.close()
    b.close()


def _copy(src: socket.socket, dst: socket.socket, count: Callable[[int], None]) -> None:
    """``src`` to ``dst`` until ``src`` ends; then shut both, which ends the other way."""
    buf = bytearray(SPLICE_BYTES)
    view = memoryview(buf)
    try:
        while n := src.recv_into(buf):
            dst.sendall(view[:n])
            count(n)
    except OSError:
        pass
    finally:
        _end(src)
        _end(dst)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (fewer: it closed first)."""
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return bytes(got)


def _no_delay(sock: socket.socket) -> None:
    # Small messages (heartbeats, replies) go out at once, as gRPC's own connections do.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect_spliced(address: tuple[str, int], ticket: bytes) -> socket.socket:
    """A connection to a relay's raw tunnel listener, its ticket sent (raises OSError)."""
    sock = socket.create_connection(address, timeout=SPLICE_CONNECT_TIMEOUT_S)
    try:
        _no_delay(sock)
        sock.sendall(SPLICE_MAGIC + ticket)
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


def can_connect(address: tuple[str, int]) -> bool:
    """Whether a TCP connection to ``address`` opens within SPLICE_CONNECT_TIMEOUT_S (a
    relay's raw tunnel listener: a firewall may let only its gRPC port through)."""
    try:
        socket.create_connection(address, timeout=SPLICE_CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _pump_in(
    sock: socket.socket, first: bytes | None, count: Callable[[int], None]
) -> Iterator[bytes]:
    """``first`` (if any), then what ``sock`` receives, as RelayFrames, until it closes
    (read into one buffer: a read allocates nothing of FRAME_BYTES, only its frame)."""
    if first is not None:
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


def _end(sock: socket.socket) -> None:
    """Shut ``sock`` both ways (a thread blocked on it returns); it stays open to close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _shut(sock: socket.socket) -> None:
    _end(sock)
    sock.close()


# --------------------------------------------------------------------------- attached peer

#: ``open_stream(first frame and data frames) -> replies``: a Relay or Accept call.
OpenStream = Callable[[Iterator[bytes]], Iterator[pb.RelayFrame]]


class RelayRoute(NamedTuple):
    """How a caller reaches a peer behind a relay now."""

    #: The relay's id.
    relay: str
    #: Opens a Relay call there (or its in-process twin, :meth:`RelayHub.open_local`).
    open_stream: OpenStream
    #: The relay's raw tunnel listener, if this peer can reach it: tunnels are spliced there.
    splice_at: tuple[str, int] | None = None
    #: This peer is the relay: ``splice_local(opening, connection)`` splices a connection
    #: straight to the target (:meth:`RelayHub.open_spliced`; False: not possible now).
    splice_local: Callable[[pb.RelayOpen, socket.socket], bool] | None = None


class Attachment:
    """This peer's Attach call to its relay, and the tunnels the relay names on it.

    Args:
        relay: the relay's id (for logs and the byte count).
        attach: ``attach(request)``: the Attach call (a response iterator with ``cancel``).
        accept: opens an Accept call to the relay (:data:`OpenStream`).
        request: this peer's AttachRequest.
        local: ``host:port`` of this peer's own gossip server, as dialled on loopback.
        on_bytes: ``on_bytes(n)`` for every byte a tunnel carries, either way.
        splice_at: the relay's raw tunnel listener, if this peer reached it (then
            ``request.splice`` says so), where the tunnels named with a ticket connect.
    """

    def __init__(
        self,
        relay: str,
        attach: Callable[[pb.AttachRequest], Iterator[pb.AttachEvent]],
        accept: OpenStream,
        request: pb.AttachRequest,
        local: str,
        on_bytes: Callable[[int], None] = lambda n: None,
        splice_at: tuple[str, int] | None = None,
    ) -> None:
        self.relay = relay
        self._splice_at = splice_at
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
                        target=self._serve,
                        args=(event.tunnel, event.ticket),
                        name="tunnel",
                        daemon=True,
                    ).start()
        except grpc.RpcError as err:
            self.error = from_rpc_error(err, 1)
            if self._attached.is_set():
                log.warning("relay %s lost: %s", self.relay, self.error)
        finally:
            self._ended.set()

    def _serve(self, tunnel: int, ticket: bytes) -> None:
        """Connect tunnel ``tunnel`` to this peer's own server: at the relay's raw tunnel
        listener with ``ticket``, or through an Accept call (no ticket)."""
        host, _, port = self._local.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
        except OSError as err:
            log.warning("tunnel %d: own server at %s: %s", tunnel, self._local, err)
            return
        sock.settimeout(None)
        if ticket and self._splice_at is not None:
            try:
                raw = connect_spliced(self._splice_at, ticket)
            except OSError as err:
                log.warning("tunnel %d: relay %s's tunnel listener: %s", tunnel, self.relay, err)
                _shut(sock)
                return
            _no_delay(sock)
            splice(sock, raw, self._on_bytes)
            return
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
        opener: ``opener(target)``: the first frame's ``RelayOpen``.
        route: ``route(target)``: the :class:`RelayRoute` to the target's relay now, or None
            if it has none.
        on_bytes: ``on_bytes(relay id, n)`` for every byte a tunnel carries, either way.
    """

    def __init__(
        self,
        opener: Callable[[str], pb.RelayOpen],
        route: Callable[[str], RelayRoute | None],
        on_bytes: Callable[[str, int], None] = lambda relay, n: None,
    ) -> None:
        self._opener = opener
        self._route = route
        self._on_bytes = on_bytes
        self._listeners: dict[str, socket.socket] = {}
        # relay tunnel listener -> whether this peer could connect to it
        self._reachable: dict[tuple[str, int], bool] = {}
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
        _no_delay(conn)

        def count(n: int) -> None:
            self._on_bytes(route.relay, n)

        opening = self._opener(target)
        try:
            if route.splice_local is not None and route.splice_local(opening, conn):
                return
            if route.splice_at is not None and self._reaches(route.splice_at):
                opening.splice = True
                call = self._splice_or_frames(conn, route, opening, count)
                if call is None:
                    return
                replies, frames = call
            else:
                replies = route.open_stream(_pump_in(conn, open_frame(opening), count))
                frames = replies
        except (grpc.RpcError, ValueError, TransportError) as err:
            log.debug("relay %s for %s: %s", route.relay, target, err)
            _shut(conn)
            return
        _pump_out(frames, conn, count)
        _cancel(replies)

    def _splice_or_frames(
        self,
        conn: socket.socket,
        route: RelayRoute,
        opening: pb.RelayOpen,
        count: Callable[[int], None],
    ) -> tuple[Iterator[pb.RelayFrame], Iterator[pb.RelayFrame]] | None:
        """Ask the relay for a spliced tunnel: if it gives a ticket, splice ``conn`` to its
        listener (None, once the tunnel ended); else the call and its frames still to come,
        which carry the tunnel (``conn``'s bytes go out on the call)."""
        decided = threading.Event()
        ticket = b""  # read by requests() once decided: no ticket, the call carries the bytes

        def requests() -> Iterator[bytes]:
            yield open_frame(opening)
            decided.wait()
            if not ticket:
                yield from _pump_in(conn, None, count)

        replies = route.open_stream(requests())
        frames = iter(replies)
        try:
            first = next(frames, None)
            ticket = first.open.ticket if first is not None and first.HasField("open") else b""
        finally:
            decided.set()
        if first is None:
            raise ValueError("the relay ended the tunnel")
        if not ticket:
            return replies, frames
        try:
            raw = connect_spliced(route.splice_at, ticket)
        except OSError as err:
            with self._lock:
                self._reachable[route.splice_at] = False  # gRPC calls from now on
            raise ValueError(f"its tunnel listener: {err}") from err
        splice(conn, raw, count)
        return None

    def _reaches(self, address: tuple[str, int]) -> bool:
        with self._lock:
            known = self._reachable.get(address)
        if known is None:
            known = can_connect(address)
            with self._lock:
                self._reachable[address] = known
        return known

    def close(self) -> None:
        """Close every listener (tunnels in flight end with their connections)."""
        with self._lock:
            self._closed = True
            listeners, self._listeners = list(self._listeners.values()), {}
        for sock in listeners:
            _shut(sock)
