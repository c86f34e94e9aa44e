#!/usr/bin/env python3
"""CPU cost of the user-space link emulator: process CPU seconds per GB it relays.

Starts one relay (``gossipgrad.experiment.links``) in front of a TCP sink on 127.0.0.1 and
pushes ``--mb`` megabytes through it over ``--connections`` parallel connections, with the
given one-way delay and rate on the forward path. It prints the relay's throughput, the CPU
time of the emulator's event-loop thread (all of the relay's work: nothing else runs in it),
that time per GB (1 GB = 1e9 bytes), and the share of one core the relay would use at the
rate it reached. The sender and the sink run in other threads, so their CPU is not counted.

Example::

    .venv/bin/python scripts/bench_links.py --mb 1000
    .venv/bin/python scripts/bench_links.py --mb 200 --rate 100mbit --delay 20ms --connections 4
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

from gossipgrad.experiment.links import LinkEmulator, Serializer, Stage
from gossipgrad.experiment.spec import rate_bits, time_seconds

BLOCK = 1 << 20


def _sink(server: socket.socket, n: int, done: list[int]) -> None:
    """Accept n connections and count what they deliver (in threads)."""

    def drain(conn: socket.socket) -> None:
        total, buf = 0, bytearray(BLOCK)
        with conn:
            while got := conn.recv_into(buf):
                total += got
        done.append(total)

    threads = []
    for _ in range(n):
        conn, _ = server.accept()
        t = threading.Thread(target=drain, args=(conn,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def _send(address: tuple[str, int], nbytes: int) -> None:
    block = b"\0" * BLOCK
    with socket.create_connection(address) as s:
        left = nbytes
        while left > 0:
            s.sendall(block[: min(left, BLOCK)])
            left -= BLOCK
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


def bench(mb: float, rate: str | None, delay: str | None, connections: int) -> dict[str, float]:
    nbytes = int(mb * 1e6)
    per_conn = nbytes // connections
    server = socket.create_server(("127.0.0.1", 0))
    upstream = f"127.0.0.1:{server.getsockname()[1]}"
    got: list[int] = []
    sink = threading.Thread(target=_sink, args=(server, connections, got))
    sink.start()
    stage = Stage(
        delay=time_seconds(delay) if delay else 0.0,
        serializer=Serializer(rate_bits(rate) / 8 if rate else None),
    )
    with server, LinkEmulator() as emu:
        relay = emu.add("bench", upstream, [stage], [Stage()])
        cpu0, t0 = emu.cpu_seconds(), time.monotonic()
        senders = [
            threading.Thread(target=_send, args=(relay.address_tuple, per_conn))
            for _ in range(connections)
        ]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        sink.join()
        wall, cpu = time.monotonic() - t0, emu.cpu_seconds() - cpu0
    relayed = sum(got)
    if relayed != per_conn * connections:
        raise RuntimeError(f"relayed {relayed} bytes, expected {per_conn * connections}")
    return {
        "mb": relayed / 1e6,
        "rate": rate or "unshaped",
        "delay": delay or "0",
        "connections": connections,
        "wall_seconds": wall,
        "throughput_mbit_s": relayed * 8 / wall / 1e6,
        "cpu_seconds": cpu,
        "cpu_seconds_per_gb": cpu / (relayed / 1e9),
        "cpu_share_of_one_core": cpu / wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=500.0, help="megabytes to relay (1e6 bytes)")
    p.add_argument("--rate", default=None, help="forward rate, e.g. 100mbit (default unshaped)")
    p.add_argument("--delay", default=None, help="forward one-way delay, e.g. 20ms")
    p.add_argument("--connections", type=int, default=1, help="parallel connections")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    r = bench(args.mb, args.rate, args.delay, args.connections)
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"relayed {r['mb']:.0f} MB over {r['connections']} connection(s), rate {r['rate']}, "
            f"delay {r['delay']}: {r['wall_seconds']:.2f} s, {r['throughput_mbit_s']:.0f} "
            f"mbit/s; emulator CPU {r['cpu_seconds']:.2f} s = {r['cpu_seconds_per_gb']:.2f} "
            f"CPU s/GB, {100 * r['cpu_share_of_one_core']:.1f}% of one core"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
