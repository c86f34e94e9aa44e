"""The user-space link emulator (gossipgrad.experiment.links) on real sockets on 127.0.0.1.

A ping-pong over a 20 ms + 20 ms link measures 40 ms; a bulk transfer over 20 mbit/s takes
the time the rate implies; loss shows up as retransmission-sized tail delays and resets as
RSTs; and no relay thread or socket survives a run, an exception in its body, or SIGINT to a
child process running one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from gossipgrad.experiment.link_path import WAKE_LEAD_SHARE
from gossipgrad.experiment.links import (
    LinkEmulator,
    LinkPath,
    Relay,
    Serializer,
    Stage,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ROOT

PING = 32


def open_fds() -> dict[str, str]:
    """fd -> what it is; without the directory listing's own descriptor, gone by then."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class EchoServer:
    """A threaded TCP server on 127.0.0.1:0: echoes what it gets, or (sink) answers the
    byte count once the client half-closes."""

    def __init__(self, sink: bool = False) -> None:
        self.sink = sink
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        self.received_at: list[float] = []
        self._accept = threading.Thread(target=self._serve, name="echo-accept")
        self._accept.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), name="echo-conn")
            t.start()
            self.threads.append(t)

    def _handle(self, conn: socket.socket) -> None:
        # As gRPC does: without it, Nagle's algorithm and delayed ACKs can hold a small reply
        # for up to 200 ms, which would look like an emulated loss.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            n = 0
            with contextlib.suppress(OSError):
                while data := conn.recv(1 << 16):
                    n += len(data)
                    if not self.sink:
                        conn.sendall(data)
                self.received_at.append(time.monotonic())
                if self.sink:
                    conn.sendall(str(n).encode())

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would not.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._accept.join(5)
        for t in self.threads:
            t.join(5)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def sink() -> Iterator[EchoServer]:
    server = EchoServer(sink=True)
    yield server
    server.close()


@contextlib.contextmanager
def leaves_nothing() -> Iterator[None]:
    """Assert that the body leaves no thread and no file descriptor behind (the echo
    servers' own connection threads included, once their clients are gone)."""
    threads, fds = set(threading.enumerate()), open_fds()
    yield
    assert wait_for(lambda: set(threading.enumerate()) <= threads), threading.enumerate()
    assert wait_for(lambda: open_fds().items() <= fds.items()), open_fds().items() - fds.items()


def connect(relay: Relay) -> socket.socket:
    s = socket.create_connection(relay.address_tuple, timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def round_trips(s: socket.socket, n: int) -> list[float]:
    """Seconds of n ping-pongs of PING bytes."""
    out = []
    for _ in range(n):
        t = time.monotonic()
        s.sendall(b"p" * PING)
        got = 0
        while got < PING:
            chunk = s.recv(PING - got)
            assert chunk, "relay closed the connection"
            got += len(chunk)
        out.append(time.monotonic() - t)
    return out


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end closed ``s`` (FIN or RST)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.timeout(60)
def test_ping_pong_over_a_40ms_rtt_link_measures_40ms(echo: EchoServer) -> None:
    """Median of 25 round trips within 10 % of 40 ms. On a shared machine a burst of load can
    delay any thread's wake-up, so up to three rounds of 25 are measured; a relay whose delay
    is wrong fails all three."""
    medians = []
    with leaves_nothing():
        with LinkEmulator() as emu:
            relay = emu.add("0->1", echo.address, [Stage(delay=0.02)], [Stage(delay=0.02)])
            unshaped = emu.add("plain", echo.address, [Stage()], [Stage()])
            with connect(relay) as s, connect(unshaped) as p:
                for _ in range(3):
                    rtts, base = [], []
                    for _ in range(25):  # interleaved: both see the same background load
                        rtts += round_trips(s, 1)
                        base += round_trips(p, 1)
                    medians.append(statistics.median(rtts))
                    # Writes are timed early by at most the wake-up lead, never more.
                    assert min(rtts) >= 0.040 * (1 - WAKE_LEAD_SHARE), sorted(rtts)
                    assert statistics.median(base) < 0.005, sorted(base)
                    if medians[-1] == pytest.approx(0.040, rel=0.10):
                        break
        assert refused(relay.address_tuple)
    assert medians[-1] == pytest.approx(0.040, rel=0.10), (medians, relay.stats())
    stats = relay.stats()
    assert stats["connections"] == 1
    assert stats["forward"]["bytes"] == stats["reverse"]["bytes"] == 25 * PING * len(medians)


@pytest.mark.timeout(60)
def test_bulk_transfer_takes_the_time_the_rate_implies(sink: EchoServer) -> None:
    nbytes, rate_bits, delay = 2_500_000, 20e6, 0.02
    with leaves_nothing(), LinkEmulator() as emu:
        fwd = [Stage(delay=delay, serializer=Serializer(rate_bits / 8))]
        relay = emu.add("0->1", sink.address, fwd, [Stage()])
        with connect(relay) as s:
            t0 = time.monotonic()
            s.sendall(b"x" * nbytes)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(64)
        assert wait_for(lambda: bool(sink.received_at))
    assert int(reply) == nbytes
    elapsed = sink.received_at[0] - t0
    assert elapsed == pytest.approx(nbytes * 8 / rate_bits + delay, rel=0.10)
    # A pipe: in-flight bytes are bounded by the bandwidth-delay product plus the queue, so
    # the sender was held back (it could not hand everything over at once).
    assert relay.forward.queue_bytes < nbytes


def test_release_times_serialize_delay_and_keep_fifo_order() -> None:
    path = LinkPath(
        [Stage(delay=0.01, jitter=0.005, serializer=Serializer(1000.0))], seed=3, rto=0.2
    )
    last, times = 0.0, []
    for k in range(200):
        last = path.release(k * 0.001, 10, last)
        times.append(last)
    assert times == sorted(times)  # in order, whatever the jitter drew
    # 200 chunks of 10 bytes at 1000 B/s leave by 2 s; the last arrives ~10 ms later.
    assert times[-1] == pytest.approx(2.0 + 0.01, abs=0.02)
    assert path.loss_delay == pytest.approx(0.2)  # max(rto, 2*10 ms + 4*5 ms)
    slow = LinkPath([Stage(delay=0.1)], rto=0.2)
    assert slow.loss_delay == pytest.approx(0.2) and LinkPath([Stage(delay=0.2)]).loss_delay == 0.4


@pytest.mark.timeout(60)
def test_loss_shows_up_as_retransmission_tail_delays(echo: EchoServer) -> None:
    lost_rtts, clean_rtts = [], []
    with leaves_nothing(), LinkEmulator() as emu:
        lossy = LinkPath([Stage(delay=0.005, loss=0.05)], seed=11, rto=0.2)
        relay = emu.add("0->1", echo.address, lossy, [Stage(delay=0.005)])
        with connect(relay) as s:
            for _ in range(80):
                before = lossy.stats.lost_chunks
                rtt = round_trips(s, 1)[0]
                (lost_rtts if lossy.stats.lost_chunks > before else clean_rtts).append(rtt)
    # 5 % of one-packet pings are lost; each then waits one RTO (200 ms) on top of the RTT.
    assert 1 <= len(lost_rtts) <= 12 and len(lost_rtts) == lossy.stats.lost_chunks
    assert all(r >= 0.2 + 0.010 * (1 - WAKE_LEAD_SHARE) for r in lost_rtts), lost_rtts
    assert 0.010 * (1 - WAKE_LEAD_SHARE) <= statistics.median(clean_rtts) < 0.1, clean_rtts
    assert min(lost_rtts) > max(statistics.quantiles(clean_rtts, n=10))  # the tail is the loss


@pytest.mark.timeout(60)
def test_resets_close_the_connection_with_an_rst_and_are_counted(echo: EchoServer) -> None:
    with leaves_nothing(), LinkEmulator() as emu:
        relay = emu.add("0->1", echo.address, [Stage(reset=0.2)], [Stage()], seed=5)
        survived = 0
        for _ in range(20):
            with connect(relay) as s:
                try:
                    round_trips(s, 5)
                    survived += 1
                except (OSError, AssertionError):
                    pass
        assert wait_for(lambda: relay.stats()["forward"]["resets"] == 20 - survived)
    assert 0 < survived < 20  # P(5 pings survive) = 0.8^5 = 0.33


@pytest.mark.timeout(60)
def test_an_exception_in_the_body_leaves_no_thread_or_socket(echo: EchoServer) -> None:
    with leaves_nothing():
        with pytest.raises(RuntimeError, match="boom"), LinkEmulator() as emu:
            relay = emu.add("0->1", echo.address, [Stage(delay=0.01)], [Stage(delay=0.01)])
            s = connect(relay)  # an open connection through the relay when the body fails
            round_trips(s, 2)
            raise RuntimeError("boom")
        assert refused(relay.address_tuple)
        assert closed_by_peer(s)  # the relay closed our connection
        s.close()


@pytest.mark.timeout(60)
def test_sigint_stops_a_relay_process_and_closes_its_port(echo: EchoServer) -> None:
    cmd = [sys.executable, "-m", "gossipgrad.experiment.links", "--to", echo.address,
           "--delay", "10ms"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        host, port = json.loads(proc.stdout.readline())["address"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert statistics.median(round_trips(s, 5)) >= 0.020
            proc.send_signal(signal.SIGINT)  # with a connection still open
            assert proc.wait(timeout=15) == 0, proc.stderr.read()
            assert closed_by_peer(s)
        assert refused((host, int(port)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.timeout(60)
def test_a_relay_waits_for_an_upstream_learnt_later(echo: EchoServer) -> None:
    known: list[str] = []
    with leaves_nothing(), LinkEmulator() as emu:
        relay = emu.add("0->1", lambda: known[0] if known else None, [Stage()], [Stage()])
        threading.Timer(0.3, known.append, [echo.address]).start()
        with connect(relay) as s:
            t0 = time.monotonic()
            round_trips(s, 1)
            assert time.monotonic() - t0 >= 0.25


def test_swarm_paths_shape_as_netns_mode_does() -> None:
    from gossipgrad.experiment.links import SwarmRelays, site_host
    from gossipgrad.experiment.spec import NetworkSection

    net = NetworkSection.model_validate(
        {
            "delay": "10ms",
            "rate": "20mbit",
            "sites": [{"peers": [2], "delay": "30ms", "rate": "5mbit"}],
            "links": [{"a": 0, "b": 1, "rate": "2mbit", "delay": "50ms"}],
        }
    )
    relays = SwarmRelays(net, 3, seed=0, upstream=lambda j: None)
    # Uplink of the sender (or the pair's override merged over it), then the receiver's
    # downlink: delays add up.
    assert relays.one_way_seconds(0, 2) == pytest.approx(0.010 + 0.030)
    assert relays.one_way_seconds(2, 0) == pytest.approx(0.030 + 0.010)
    assert relays.one_way_seconds(0, 1) == pytest.approx(0.050 + 0.010)
    p01, p02, p21 = relays.paths[0, 1], relays.paths[0, 2], relays.paths[2, 1]
    assert [s.serializer.rate for s in p01.stages] == [2e6 / 8, 20e6 / 8]
    assert [s.serializer.rate for s in p02.stages] == [20e6 / 8, 5e6 / 8]
    # Site 1's downlink is one transmitter for everything into site 1; the pair 0-1 has its
    # own uplink class, apart from site 0's default uplink.
    assert p01.stages[1].serializer is p21.stages[1].serializer
    assert p01.stages[0].serializer is not p02.stages[0].serializer
    # Relay i->j forwards on path i->j and carries the replies on path j->i.
    r = relays.relay[0, 1]
    assert r.forward is p01 and r.reverse is relays.paths[1, 0]
    assert relays.dial_via(0) == [
        f"{site_host(1)}={relays.relay[0, 1].address}",
        f"{site_host(2)}={relays.relay[0, 2].address}",
    ]


def test_dial_via_maps_addresses_and_hosts_and_rejects_junk() -> None:
    from gossipgrad.peer.cli import build_parser, overrides_from_args
    from gossipgrad.peer.config import ConfigError, build_config

    args = build_parser().parse_args(
        ["--transport.dial_via", "127.1.0.2=127.0.0.1:4000,10.0.0.1:5=10.0.0.9:6"]
    )
    t = build_config({}, overrides_from_args(args)).transport
    assert t.dial_target("127.1.0.2:7070") == "127.0.0.1:4000"  # bare host: any port
    assert t.dial_target("10.0.0.1:5") == "10.0.0.9:6"
    assert t.dial_target("10.0.0.1:7") == "10.0.0.1:7"  # not mapped: itself
    with pytest.raises(ConfigError, match=r"transport\.dial_via"):
        build_config({}, {"transport.dial_via": ["127.0.0.1:1"]})


@pytest.mark.timeout(60)
def test_bytes_arrive_intact_and_in_order_through_jitter_loss_and_a_rate(echo: EchoServer) -> None:
    import random

    payload = random.Random(7).randbytes(600_000)
    with leaves_nothing(), LinkEmulator() as emu:
        stages = [Stage(delay=0.005, jitter=0.004, loss=0.03, serializer=Serializer(4e6))]
        forward = LinkPath(stages, seed=2, rto=0.05)
        relay = emu.add("0->1", echo.address, forward, [Stage(delay=0.005, jitter=0.004)])
        with connect(relay) as s:
            sender = threading.Thread(target=s.sendall, args=(payload,))
            sender.start()
            got = bytearray()
            while len(got) < len(payload):
                chunk = s.recv(1 << 16)
                assert chunk, "relay closed the connection"
                got += chunk
            sender.join()
    assert bytes(got) == payload
    # ~5 ms of the rate per chunk (20 kB here); about 1 in 3 such chunks holds a lost packet.
    assert forward.stats.chunks >= len(payload) // forward.chunk_bytes
    assert forward.stats.lost_chunks > 0


@given(
    reads=st.lists(
        st.tuples(st.floats(0.0, 0.01), st.integers(1, 70_000)), min_size=1, max_size=60
    ),
    rate=st.floats(1e4, 1e8),
    delay=st.floats(0.0, 0.2),
    jitter=st.floats(0.0, 0.05),
)
@settings(max_examples=200, deadline=None)
def test_release_law_in_order_no_earlier_than_the_rate_allows(reads, rate, delay, jitter) -> None:
    path = LinkPath([Stage(delay=delay, jitter=jitter, serializer=Serializer(rate))], seed=1)
    t, last, total, releases = 0.0, 0.0, 0, []
    for gap, nbytes in reads:
        t += gap
        last = path.release(t, nbytes, last)
        total += nbytes
        releases.append(last)
        # Never before it has been transmitted (and, without jitter, propagated).
        assert last >= t + nbytes / rate - 1e-9
        if not jitter:
            assert last >= t + nbytes / rate + delay - 1e-9
    assert releases == sorted(releases)
    # The link never carried more than its rate: everything needs total / rate seconds.
    assert releases[-1] >= total / rate - 1e-9
    assert path.stats.bytes == total and path.stats.chunks == len(reads)


def test_dry_run_plans_relays_and_dial_maps(tmp_path) -> None:

    from gossipgrad.experiment.runner import Experiment
    from gossipgrad.experiment.spec import load_spec

    spec = load_spec(ROOT / "scripts" / "experiments" / "digits-wan-local.toml")
    assert spec.network.uses_relay(spec.experiment.mode)
    lines = Experiment(spec, tmp_path / "run").plan()
    assert any(line.startswith("links: 12 user-space relays") for line in lines)
    peer1 = next(line for line in lines if line.startswith("peer 1:"))
    assert "--peer.listen 127.1.0.2:0" in peer1
    dial = peer1.split("--transport.dial_via ")[1].split()[0].split(",")
    assert [d.split("=")[0] for d in dial] == ["127.1.0.1", "127.1.0.3", "127.1.0.4"]
    assert not (tmp_path / "run").exists()  # a plan starts nothing


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"network": {"rto": "2 seconds"}}, "network.rto"),
        ({"network": {"reset": 101}}, "network.reset"),
        ({"experiment": {"mode": "ssh"}, "network": {"delay": "5ms"}}, "ssh mode runs over real"),
    ],
)
def test_link_keys_are_validated(raw: dict, fragment: str) -> None:
    from gossipgrad.experiment.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match=fragment):
        parse_spec(raw)


def test_which_emulator_shapes_what() -> None:
    from gossipgrad.experiment.spec import parse_spec

    local = parse_spec({"network": {"delay": "5ms", "reset": 0.5}})
    assert local.network.uses_relay("local") and local.network.resets()
    assert not parse_spec({}).network.uses_relay("local")  # nothing to shape: no relays
    netns = parse_spec({"experiment": {"mode": "netns"}, "network": {"rate": "10mbit"}})
    assert not netns.network.uses_relay("netns")  # tc shapes netns mode
