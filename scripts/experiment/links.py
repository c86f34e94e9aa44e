"""A WAN in user space: TCP relays that delay, jitter, rate-limit and (as TCP sees it) lose
the bytes they forward, for kernels without the netem qdisc.

A relay listens on 127.0.0.1:0 and forwards every connection to one upstream address. The
bytes the client sends go through the relay's *forward* path, the upstream's replies through
its *reverse* path. A path is a list of stages (site i's uplink, then site j's downlink, as
in netns mode); per chunk of bytes read from a socket, in order:

1. Each stage serializes the chunk at its rate: it leaves at
   ``max(arrival, stage busy until) + bytes / rate``. A stage's transmitter (``Serializer``)
   is shared by every connection over the same access link, like one HTB class.
2. It then adds its one-way delay plus N(0, jitter²), truncated at 0 (netem's
   ``delay D J distribution normal``).
3. A chunk of k packets (1448-byte MSS) is "lost" with probability 1 - (1 - p)^k: TCP would
   retransmit it, so it arrives one retransmission timeout later (``LinkPath.loss_delay``).
4. Release = max(that, the previous chunk's release): TCP delivers in order, so a late chunk
   holds back the ones behind it (head-of-line blocking).
5. With probability 1 - (1 - r)^k the relay instead resets the connection (RST both ends).

The delay line is a pipe, not store-and-forward: chunks are small (about 5 ms of the
stage's rate, at most 64 KiB), so a large message has a bandwidth-delay product in flight.
The bytes a direction holds are bounded (bandwidth-delay product plus a 256 KiB queue); past
that the relay stops reading and TCP's flow control pushes back on the sender. Writes are
timed early by the loop's recent timer lateness (at most a quarter of the path's delay), so
a loaded machine's scheduling delay does not add to the emulated delay on average.

Why asyncio: a swarm of n sites needs n(n-1) relays, each connection two directions and a
timer per chunk. One event loop in one thread serves them all, with timers accurate to about
a millisecond (epoll); threads per direction would mean hundreds of OS threads contending
for the GIL with no better timing. One loop is also one place to cancel everything on close,
and its thread's CPU time (``LinkEmulator.cpu_seconds``) is the emulator's whole cost.

    with LinkEmulator() as emu:
        relay = emu.add("0->1", "127.0.0.1:5000", [Stage(delay=0.02)], [Stage(delay=0.02)])
        sock = socket.create_connection(relay.address_tuple)   # 40 ms RTT to :5000

``python -m gossipgrad.experiment.links --to HOST:PORT --delay 20ms`` runs one relay until
Ctrl-C. ``SwarmRelays`` builds the relays of a whole ``[network]`` spec section.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gossipgrad.experiment.spec import LinkProfile, NetworkSection, rate_bits, time_seconds
from pydantic import ValidationError

log = logging.getLogger(__name__)

MSS_BYTES = 1448
MAX_CHUNK_BYTES = 64 * 1024
# Chunks carry about this much of a stage's serialization time (pipe granularity).
CHUNK_SECONDS = 0.005
QUEUE_SLACK_BYTES = 256 * 1024
# Chunks due within this much of each other leave in one write.
RELEASE_SLACK_S = 0.0005
# Timer wake-up compensation: at most this much early, adapting with this gain per wake-up.
MAX_WAKE_LEAD_S = 0.010
WAKE_LEAD_SHARE = 0.25
WAKE_LEAD_GAIN = 0.1
# Past this many bytes unsent in the socket's user-space buffer, wait for it to drain.
WRITE_BUFFER_BYTES = 256 * 1024
UNSHAPED_QUEUE_BYTES = 16 << 20
UPSTREAM_WAIT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
# Linux's TCP_RTO_MIN: the least a retransmission timeout waits.
DEFAULT_RTO_S = 0.2
# Loopback addresses of the sites in local mode: site i listens on 127.1.0.(i + 1).
SITE_HOST = "127.1.0.{}"

Upstream = str | Callable[[], str | None]


class LinkReset(ConnectionError):
    """The emulated link reset the connection (``Stage.reset``)."""


class Serializer:
    """A link's transmitter: bytes leave at ``rate`` bytes/s, one chunk after another.

    Shared by every direction that crosses the same access link, so connections compete for
    its rate as flows do for an HTB class.
    """

    def __init__(self, rate: float | None = None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be positive bytes/s, got {rate}")
        self.rate = rate
        self.busy_until = 0.0

    def depart(self, t: float, nbytes: int) -> float:
        """When a chunk offered at ``t`` has been transmitted."""
        if not self.rate:
            return t
        self.busy_until = max(t, self.busy_until) + nbytes / self.rate
        return self.busy_until


@dataclass
class Stage:
    """One hop of a path (seconds, probabilities per packet, bytes/s)."""

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    """Probability that a packet is lost (and so retransmitted)."""
    reset: float = 0.0
    """Probability, per packet's worth of bytes, that the connection is reset."""
    serializer: Serializer = field(default_factory=Serializer)

    @classmethod
    def from_profile(cls, p: LinkProfile, serializer: Serializer | None = None) -> Stage:
        """A stage from a spec profile (percent -> probability, tc units -> SI)."""
        return cls(
            delay=time_seconds(p.delay) if p.delay else 0.0,
            jitter=time_seconds(p.jitter) if p.jitter else 0.0,
            loss=p.loss / 100.0,
            reset=p.reset / 100.0,
            serializer=serializer or Serializer(rate_bits(p.rate) / 8 if p.rate else None),
        )


@dataclass
class PathStats:
    """What one path did (all connections through it)."""

    bytes: int = 0
    chunks: int = 0
    lost_chunks: int = 0
    resets: int = 0
    writes: int = 0
    release_error_seconds: float = 0.0
    """Sum over writes of |time written - release time|: the emulator's own timing error."""
    max_late_seconds: float = 0.0


class LinkPath:
    """The stages one direction of traffic crosses, with its seeded randomness and counters.

    Args:
        stages: hops in order.
        seed: seeds jitter, loss and reset draws.
        loss_delay: extra seconds a lost chunk waits (None: ``max(rto, 2 * one-way delay)``).
        rto: minimum retransmission timeout used for ``loss_delay``'s default.
    """

    def __init__(
        self,
        stages: list[Stage],
        seed: int = 0,
        loss_delay: float | None = None,
        rto: float = DEFAULT_RTO_S,
    ) -> None:
        self.stages = list(stages)
        self.rng = random.Random(seed)
        one_way = sum(s.delay for s in self.stages)
        spread = sum(s.jitter for s in self.stages)
        # RFC 6298: RTO = SRTT + 4 RTTVAR, at least the kernel's minimum.
        rto_estimate = max(rto, 2 * one_way + 4 * spread)
        self.loss_delay = rto_estimate if loss_delay is None else loss_delay
        self.stats = PathStats()
        # How late the loop thread wakes from a timer, lately (EWMA); writes are timed that
        # much early, so a loaded machine's scheduling delay does not add to the link's. At
        # most a quarter of the path's delay, so no chunk ever leaves without its delay.
        self.wake_lead = 0.0
        self.max_wake_lead = min(MAX_WAKE_LEAD_S, WAKE_LEAD_SHARE * one_way)
        rates = [s.serializer.rate for s in self.stages if s.serializer.rate]
        rate = min(rates) if rates else None
        self.chunk_bytes = (
            int(min(MAX_CHUNK_BYTES, max(MSS_BYTES, rate * CHUNK_SECONDS)))
            if rate
            else MAX_CHUNK_BYTES
        )
        self.queue_bytes = (
            int(rate * (one_way + spread)) + QUEUE_SLACK_BYTES if rate else UNSHAPED_QUEUE_BYTES
        )

    def adapt_wake_lead(self, woke_late: float) -> None:
        """Move the wake-up lead towards the lateness of the latest timer wake-up."""
        sample = min(max(woke_late, 0.0), self.max_wake_lead)
        self.wake_lead += WAKE_LEAD_GAIN * (sample - self.wake_lead)

    def release(self, t: float, nbytes: int, previous: float) -> float:
        """When a chunk read at ``t`` reaches the other end (after ``previous``, the release
        of the chunk before it on the same connection).

        Raises:
            LinkReset: the link resets the connection instead.
        """
        packets = max(1, math.ceil(nbytes / MSS_BYTES))
        for s in self.stages:
            if s.reset and self.rng.random() < 1.0 - (1.0 - s.reset) ** packets:
                self.stats.resets += 1
                raise LinkReset("emulated connection reset")
            t = s.serializer.depart(t, nbytes)
            t += max(0.0, s.delay + (self.rng.gauss(0.0, s.jitter) if s.jitter else 0.0))
            if s.loss and self.rng.random() < 1.0 - (1.0 - s.loss) ** packets:
                self.stats.lost_chunks += 1
                t += self.loss_delay
        self.stats.bytes += nbytes
        self.stats.chunks += 1
        return max(t, previous)


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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: LinkPath) -> None:
    """Forward one direction until EOF: read, cut into chunks, release each at its time in
    order (chunks due together leave in one write)."""
    loop = asyncio.get_running_loop()
    stats = path.stats
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    held_bytes = 0
    eof = False
    has_data, has_room = asyncio.Event(), asyncio.Event()
    has_room.set()

    async def pump_in() -> None:
        nonlocal held_bytes, eof
        last = 0.0
        while True:
            await has_room.wait()
            data = await reader.read(MAX_CHUNK_BYTES)
            if not data:
                eof = True
                has_data.set()
                return
            now = loop.time()
            for k in range(0, len(data), path.chunk_bytes):
                piece = data[k : k + path.chunk_bytes]
                last = path.release(now, len(piece), last)
                held.append((last, piece))
            held_bytes += len(data)
            if held_bytes >= path.queue_bytes:
                has_room.clear()
            has_data.set()

    async def pump_out() -> None:
        nonlocal held_bytes
        while True:
            if not held:
                if eof:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                has_data.clear()
                await has_data.wait()
                continue
            release = held[0][0]
            wait = release - path.wake_lead - loop.time()
            if wait > 0:
                target = loop.time() + wait
                await asyncio.sleep(wait)
                path.adapt_wake_lead(loop.time() - target)
            else:
                path.adapt_wake_lead(0.0)  # nothing to learn from: let the lead decay
            now = loop.time()
            stats.writes += 1
            stats.release_error_seconds += abs(now - release)
            stats.max_late_seconds = max(stats.max_late_seconds, now - release)
            due = max(now, release) + RELEASE_SLACK_S
            out = []
            while held and held[0][0] <= due:
                out.append(held.popleft()[1])
            n = sum(len(b) for b in out)
            held_bytes -= n
            if held_bytes < path.queue_bytes:
                has_room.set()
            writer.write(b"".join(out) if len(out) > 1 else out[0])
            if writer.transport.get_write_buffer_size() > WRITE_BUFFER_BYTES:
                await writer.drain()

    await _run_pipes(pump_in(), pump_out())


class LinkEmulator:
    """Relays served by one asyncio loop in a background thread; ``with LinkEmulator() as e``.

    ``close()`` (also on an exception or Ctrl-C in the ``with`` body) stops every relay,
    aborts its connections, stops the loop and joins the thread: no thread or socket is left.
    """

    def __init__(self) -> None:
        self.relays: list[Relay] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cpu_seconds = 0.0

    def add(
        self, name: str, upstream: Upstream, forward: list[Stage] | LinkPath,
        reverse: list[Stage] | LinkPath, seed: int = 0,
    ) -> Relay:  # fmt: skip
        """A relay to ``upstream``; bound now if the emulator runs, else by ``start()``."""
        fwd = forward if isinstance(forward, LinkPath) else LinkPath(forward, seed)
        rev = reverse if isinstance(reverse, LinkPath) else LinkPath(reverse, seed + 1)
        relay = Relay(name, upstream, fwd, rev)
        self.relays.append(relay)
        if self._loop is not None:
            self._call(relay.start())
        return relay

    def _call(self, coro: Any, timeout: float = CLOSE_TIMEOUT_S) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> LinkEmulator:
        """Start the loop thread and bind every relay added so far."""
        if self._loop is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="link-emulator")
        self._thread.start()
        try:
            for relay in self.relays:
                self._call(relay.start())
        except BaseException:
            self.close()
            raise
        log.info("link emulator: %d relays", len(self.relays))
        return self

    def _serve(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._cpu_seconds = time.thread_time()

    def cpu_seconds(self) -> float:
        """CPU seconds the emulator's thread has used (its whole cost)."""
        if self._loop is None:
            return self._cpu_seconds

        async def read() -> float:
            return time.thread_time()

        return self._call(read())

    def stats(self) -> dict[str, Any]:
        return {r.name: r.stats() for r in self.relays}

    def close(self) -> None:
        """Stop every relay and the loop thread (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            if thread.is_alive():
                with contextlib.suppress(Exception):
                    self._call(self._shutdown())
                loop.call_soon_threadsafe(loop.stop)
                thread.join(CLOSE_TIMEOUT_S)
        finally:
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    async def _shutdown(self) -> None:
        await asyncio.gather(*(r.close() for r in self.relays), return_exceptions=True)
        await asyncio.get_running_loop().shutdown_default_executor()

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a spec's [network] as relays --------------------------------------------------------------


def site_host(i: int) -> str:
    """Loopback address site i listens on in local mode (all of 127/8 is loopback on Linux)."""
    return SITE_HOST.format(i + 1)


class SwarmRelays:
    """One relay per directed site pair i->j of a local swarm, shaped as netns mode would.

    Path i->j: site i's uplink (its profile, or the ``[[network.links]]`` entry of {i, j}
    merged over it, with its own transmitter like an HTB class), then site j's downlink (its
    profile; one transmitter for all traffic into j). A relay i->j carries i's connections to
    j: i's bytes on path i->j, j's replies on path j->i, sharing transmitters with relay j->i.

    Args:
        network: the spec's [network] section.
        n: number of sites.
        seed: seeds every path's randomness (path i->j gets its own stream).
        upstream: ``j -> site j's real address`` once known (None before).
    """

    def __init__(
        self, network: NetworkSection, n: int, seed: int, upstream: Callable[[int], str | None]
    ) -> None:
        self.network = network
        self.n = n
        self.emulator = LinkEmulator()
        rto = time_seconds(network.rto)
        down = {j: Serializer(_bytes_per_s(network.site(j))) for j in range(n)}
        up: dict[tuple[int, int], Serializer] = {}
        uplink: dict[tuple[int, int], LinkProfile] = {}
        for i in range(n):
            default = Serializer(_bytes_per_s(network.site(i)))
            for j in range(n):
                pair = network.pair(i, j) if i != j else None
                uplink[i, j] = network.site(i).merged(pair) if pair else network.site(i)
                up[i, j] = Serializer(_bytes_per_s(uplink[i, j])) if pair else default
        self.paths: dict[tuple[int, int], LinkPath] = {}
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                stages = [
                    Stage.from_profile(uplink[i, j], up[i, j]),
                    Stage.from_profile(network.site(j), down[j]),
                ]
                self.paths[i, j] = LinkPath(stages, seed=seed * 1_000_003 + i * 1009 + j, rto=rto)
        self.relay: dict[tuple[int, int], Relay] = {}
        for (i, j), path in self.paths.items():
            relay = Relay(f"{i}->{j}", _bind(upstream, j), path, self.paths[j, i])
            self.relay[i, j] = relay
            self.emulator.relays.append(relay)

    def start(self) -> SwarmRelays:
        self.emulator.start()
        return self

    def close(self) -> None:
        self.emulator.close()

    def dial_via(self, i: int) -> list[str]:
        """Site i's ``transport.dial_via`` entries: every other site's host -> its relay."""
        return [f"{site_host(j)}={self.relay[i, j].address}" for j in range(self.n) if j != i]

    def peer_overrides(self, i: int) -> dict[str, str]:
        """Daemon keys of peer i: listen on its site address, dial the others via relays."""
        return {
            "peer.listen": f"{site_host(i)}:0",
            "transport.dial_via": ",".join(self.dial_via(i)),
        }

    def one_way_seconds(self, i: int, j: int) -> float:
        """Configured mean one-way delay i->j (no queueing, jitter or loss)."""
        return sum(s.delay for s in self.paths[i, j].stages)

    def report(self) -> dict[str, Any]:
        """Counters per directed path (i->j: every byte site i sent to site j, on i's
        connections and as replies on j's), per relay, and the emulator's CPU cost."""
        paths = {f"{i}->{j}": vars(p.stats).copy() for (i, j), p in self.paths.items()}
        total = sum(p["bytes"] for p in paths.values())
        cpu = self.emulator.cpu_seconds()
        return {
            "emulator": "relay",
            "cpu_seconds": cpu,
            "relayed_bytes": total,
            "cpu_seconds_per_gb": cpu / (total / 1e9) if total else None,
            "paths": paths,
            "relays": {
                r.name: {k: v for k, v in r.stats().items() if k not in ("forward", "reverse")}
                for r in self.emulator.relays
            },
        }

    def __enter__(self) -> SwarmRelays:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_per_s(p: LinkProfile) -> float | None:
    return rate_bits(p.rate) / 8 if p.rate else None


def _bind(upstream: Callable[[int], str | None], j: int) -> Callable[[], str | None]:
    return lambda: upstream(j)


# -- one relay from the command line -----------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gossipgrad.experiment.links",
        description="Run one emulated WAN link: a TCP relay on 127.0.0.1 that forwards to "
        "--to with the given one-way delay, jitter, rate and loss in each direction, until "
        "Ctrl-C. Prints its address as JSON on the first line.",
    )
    p.add_argument("--to", required=True, metavar="HOST:PORT", help="upstream address")
    p.add_argument("--delay", default=None, help="one-way delay each way, e.g. 20ms")
    p.add_argument("--jitter", default=None, help="delay variation each way, e.g. 5ms")
    p.add_argument("--rate", default=None, help="bandwidth each way, e.g. 20mbit")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss in percent each way")
    p.add_argument("--reset", type=float, default=0.0, help="reset chance in percent per packet")
    p.add_argument("--seed", type=int, default=0, help="seed of jitter, loss and resets")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        profile = LinkProfile(
            rate=args.rate, delay=args.delay, jitter=args.jitter, loss=args.loss, reset=args.reset
        )
    except ValidationError as err:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        sys.stderr.write(f"links: {problems}\n")
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stop = threading.Event()
    emu = LinkEmulator()
    relay = emu.add(
        "relay", args.to, [Stage.from_profile(profile)], [Stage.from_profile(profile)],
        seed=args.seed,
    )  # fmt: skip
    with emu:
        sys.stdout.write(json.dumps({"address": relay.address}) + "\n")
        sys.stdout.flush()
        try:
            while not stop.wait(3600):
                pass
        except KeyboardInterrupt:
            log.info("stopping relay %s", relay.address)
        stats = relay.stats()
    log.info("relay stats: %s", json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
