"""One emulated link on real sockets: a TCP relay on 127.0.0.1:0 forwarding every connection
to one upstream address, each direction through a ``LinkPath`` (``link_path``).

The bytes the client sends go through the relay's *forward* path, the upstream's replies
through its *reverse* path. The delay line is a pipe, not store-and-forward: chunks are small
(about 5 ms of the stage's rate, at most 64 KiB), so a large message has a bandwidth-delay
product in flight. The bytes a direction holds are bounded (bandwidth-delay product plus a
256 KiB queue); past that the relay stops reading and TCP's flow control pushes back on the
sender. Writes are timed early by the loop's recent timer lateness (at most a quarter of the
path's delay), so a loaded machine's scheduling delay does not add to the emulated delay on
average.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from gossipgrad.experiment.link_path import MAX_CHUNK_BYTES, LinkPath, LinkReset

log = logging.getLogger(__name__)

# Chunks due within this much of each other leave in one write.
RELEASE_SLACK_S = 0.0005
# Past this many bytes unsent in the socket's user-space buffer, wait for it to drain.
WRITE_BUFFER_BYTES = 256 * 1024
UPSTREAM_WAIT_S = 30.0
CLOSE_TIMEOUT_S = 10.0

Upstream = str | Callable[[], str | None]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Relay:
    """One listening socket forwarding to one upstream through two paths.

    Args:
        name: label in logs and stats (e.g. ``"0->1"``).
        upstream: ``host:port``, or a callable returning it once known (None until then;
            a connection waits up to ``UPSTREAM_WAIT_S`` for it).
        forward: path of the bytes the client sends.
        reverse: path of the upstream's replies.
        host: address to listen on (port 0: the kernel picks one).
    """

    def __init__(
        self, name: str, upstream: Upstream, forward: LinkPath, reverse: LinkPath,
        host: str = "127.0.0.1",
    ) -> None:  # fmt: skip
        self.name = name
        self.upstream = upstream
        self.forward = forward
        self.reverse = reverse
        self.host = host
        self.port = 0
        self.connections = 0
        self.failed_connects = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def address_tuple(self) -> tuple[str, int]:
        return self.host, self.port

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "connections": self.connections,
            "failed_connects": self.failed_connects,
            "forward": vars(self.forward.stats).copy(),
            "reverse": vars(self.reverse.stats).copy(),
        }

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and abort every connection still open."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _upstream_address(self) -> str | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UPSTREAM_WAIT_S
        while True:
            address = self.upstream() if callable(self.upstream) else self.upstream
            if address or loop.time() > deadline:
                return address
            await asyncio.sleep(0.05)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        u_writer: asyncio.StreamWriter | None = None
        finished = False
        try:
            address = await self._upstream_address()
            if not address:
                raise ConnectionError(f"relay {self.name}: upstream unknown")
            u_reader, u_writer = await asyncio.open_connection(*_split(address))
            await _run_pipes(
                _pipe(c_reader, u_writer, self.forward), _pipe(u_reader, c_writer, self.reverse)
            )
            for w in (c_writer, u_writer):
                w.close()  # flushes what is still buffered, then closes
            for w in (c_writer, u_writer):
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(w.wait_closed(), CLOSE_TIMEOUT_S)
            finished = True
        except LinkReset:
            log.debug("relay %s: emulated reset", self.name)
            for w in (c_writer, u_writer):
                if w is not None:
                    _reset(w)
        except (OSError, ConnectionError) as err:
            if u_writer is None:
                self.failed_connects += 1
            log.debug("relay %s: connection ended: %r", self.name, err)
        except asyncio.CancelledError:
            # close(): end quietly (asyncio's stream callback would log a cancelled task).
            pass
        finally:
            if not finished:
                for w in (c_writer, u_writer):
                    if w is not None:
                        w.transport.abort()
            self._tasks.discard(task)


async def _run_pipes(*pipes: Any) -> None:
    """Run both directions; when one fails, cancel the other and re-raise."""
    tasks = [asyncio.ensure_future(p) for p in pipes]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        await asyncio.gather(*pending)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _DelayLine:
    """One direction of one connection: chunks read from ``reader``, held until their
    release time on ``path``, then written to ``writer`` in order.

    Two coroutines share the queue: ``pump_in`` reads and stamps chunks (pausing while the
    queue holds ``path.queue_bytes``), ``pump_out`` sleeps until the head is due and writes
    every chunk due with it.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: LinkPath
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.path = path
        self.loop = asyncio.get_running_loop()
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held_bytes = 0
        self.eof = False
        self.has_data, self.has_room = asyncio.Event(), asyncio.Event()
        self.has_room.set()

    async def pump_in(self) -> None:
        """Read until EOF, cutting what arrives into chunks stamped with their release."""
        last = 0.0
        while True:
            await self.has_room.wait()
            data = await self.reader.read(MAX_CHUNK_BYTES)
            if not data:
                self.eof = True
                self.has_data.set()
                return
            last = self._hold(data, last)

    def _hold(self, data: bytes, last: float) -> float:
        """Queue ``data`` as chunks released in order after ``last``; the last release."""
        now = self.loop.time()
        size = self.path.chunk_bytes
        for k in range(0, len(data), size):
            piece = data[k : k + size]
            last = self.path.release(now, len(piece), last)
            self.held.append((last, piece))
        self.held_bytes += len(data)
        if self.held_bytes >= self.path.queue_bytes:
            self.has_room.clear()
        self.has_data.set()
        return last

    async def pump_out(self) -> None:
        """Write each chunk at its release time; after EOF and the last chunk, half-close."""
        while True:
            if not self.held:
                if self.eof:
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    return
                self.has_data.clear()
                await self.has_data.wait()
                continue
            release = self.held[0][0]
            await self._sleep_until(release)
            self._write_due(release)
            if self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_BYTES:
                await self.writer.drain()

    async def _sleep_until(self, release: float) -> None:
        """Sleep until ``release`` less the wake-up lead, learning how late the timer woke."""
        wait = release - self.path.wake_lead - self.loop.time()
        if wait > 0:
            target = self.loop.time() + wait
            await asyncio.sleep(wait)
            self.path.adapt_wake_lead(self.loop.time() - target)
        else:
            self.path.adapt_wake_lead(0.0)  # nothing to learn from: let the lead decay

    def _write_due(self, release: float) -> None:
        """Write the head chunk (due at ``release``) and every chunk due with it, in one write."""
        now = self.loop.time()
        stats = self.path.stats
        stats.writes += 1
        stats.release_error_seconds += abs(now - release)
        stats.max_late_seconds = max(stats.max_late_seconds, now - release)
        due = max(now, release) + RELEASE_SLACK_S
        out = []
        while self.held and self.held[0][0] <= due:
            out.append(self.held.popleft()[1])
        self.held_bytes -= sum(len(b) for b in out)
        if self.held_bytes < self.path.queue_bytes:
            self.has_room.set()
        self.writer.write(b"".join(out) if len(out) > 1 else out[0])


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: LinkPath) -> None:
    """Forward one direction until EOF: read, cut into chunks, release each at its time in
    order (chunks due together leave in one write)."""
    line = _DelayLine(reader, writer, path)
    await _run_pipes(line.pump_in(), line.pump_out())
