#!/usr/bin/env python3
"""Loopback throughput of the gossip transport against a raw TCP socket, in one run.

Starts the receivers as separate processes on 127.0.0.1 -- a GossipServer whose handler
only acknowledges, and a plain TCP receiver reading into a reused buffer (the physical limit
of loopback on this machine) -- then pushes payloads of each size through both, alternating
TCP and gRPC repeats so that both see the same background load, and prints GB/s and the
gRPC/TCP ratio. A push counts as done when the sender has the receiver's reply, i.e. after
the whole payload sits in the receiver's buffer; 1 GB = 1e9 bytes of payload.

Variants (``--variants``): ``fast`` is PeerClient as shipped; ``protobuf`` wraps every chunk
in a protobuf ``UpdateChunk`` with the generated stub; ``nopool`` allocates a fresh receive
buffer per push (``recv_pool_bytes=0``). ``--no-tune-malloc`` runs everything with glibc's
default malloc thresholds (see ``gossipgrad.peer.network.malloc.tune_malloc``).

Example::

    .venv/bin/python scripts/bench_transport.py --sizes-mb 1,16,100,400 --repeats 3
    .venv/bin/python scripts/bench_transport.py --sizes-mb 100 --chunk-kib 256,1024,4096 \\
        --variants fast,protobuf,nopool
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import psutil
from gossipgrad.peer.network import GossipServer, PeerClient, TransportOptions
from gossipgrad.proto import gossip_pb2 as pb
from gossipgrad.proto import gossip_pb2_grpc as pb_grpc

MB = 1_000_000
MiB = 1 << 20
_LEN = struct.Struct("<Q")


# ------------------------------------------------------------------------------ receivers


class _Sink:
    """Handler that acknowledges every update without looking at it."""

    def handle_update(self, header, payload, context_peer):
        return pb.PushReply(status=pb.PushReply.ACCEPTED, expected_seq=header.seq + 1)

    def handle_heartbeat(self, request):
        return pb.HeartbeatReply()

    def handle_state_request(self, request):
        return pb.StateHeader(), b""


def serve_grpc(max_bytes: int, pool: bool, tune: bool) -> None:
    pool_bytes = 2 * max_bytes + 2 * MiB if pool else 0  # room for the granule rounding
    opts = TransportOptions(
        max_payload_bytes=max_bytes, recv_pool_bytes=pool_bytes, tune_malloc=tune
    )
    server = GossipServer(_Sink(), bind="127.0.0.1:0", options=opts)
    server.start()
    print(server.address, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(grace=1.0)


def serve_tcp(max_bytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()
    buf = bytearray(max_bytes)  # one reused buffer, like the pooled gRPC receiver
    view = memoryview(buf)
    while True:
        head = conn.recv(_LEN.size, socket.MSG_WAITALL)
        if len(head) < _LEN.size:
            return
        (size,) = _LEN.unpack(head)
        got = 0
        while got < size:
            n = conn.recv_into(view[got:size])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


def _spawn(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    address = proc.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"receiver {args} did not start")
    return proc, address


# ------------------------------------------------------------------------------ senders


def _tcp_push(sock: socket.socket, payload: memoryview) -> float:
    t = time.perf_counter()
    sock.sendall(_LEN.pack(payload.nbytes))
    sock.sendall(payload)
    if sock.recv(1) != b"k":
        raise RuntimeError("tcp receiver failed")
    return time.perf_counter() - t


def _fast_push(client: PeerClient, payload: memoryview) -> float:
    t = time.perf_counter()
    reply = client.push(pb.UpdateHeader(sender="bench"), payload, timeout=600)
    if reply.status != pb.PushReply.ACCEPTED:
        raise RuntimeError(f"push refused: {reply}")
    return time.perf_counter() - t


def _protobuf_push(stub: pb_grpc.GossipStub, payload: memoryview, chunk: int) -> float:
    def chunks():
        yield pb.UpdateChunk(header=pb.UpdateHeader(sender="bench", payload_size=payload.nbytes))
        for off in range(0, payload.nbytes, chunk):
            yield pb.UpdateChunk(data=payload[off : off + chunk].tobytes())

    t = time.perf_counter()
    stub.PushUpdate(chunks(), timeout=600)
    return time.perf_counter() - t


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid``."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _measure(push: Callable[[], float], server_pid: int, repeats: int) -> tuple[list[float], float]:
    """Wall seconds of each push, and CPU seconds (sender + receiver) of all of them."""
    push()  # warm-up: connections, receive buffers, page faults
    cpu0 = time.process_time() + _cpu_seconds(server_pid)
    walls = [push() for _ in range(repeats)]
    return walls, time.process_time() + _cpu_seconds(server_pid) - cpu0


def _kind(variant: str) -> str:
    """The receiver process a variant pushes to."""
    return "grpc-nopool" if variant == "nopool" else "grpc"


def _start_receivers(
    args: argparse.Namespace, max_bytes: int, procs: dict[str, subprocess.Popen]
) -> tuple[socket.socket, dict[str, str]]:
    """Start the TCP receiver and each gRPC receiver the variants need (into ``procs``, so
    the caller stops them whatever happens); the TCP connection and the gRPC addresses."""
    procs["tcp"], tcp_addr = _spawn("--serve", "tcp", "--max-bytes", str(max_bytes))
    host, port = tcp_addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    addresses = {}
    for kind in sorted({_kind(v) for v in args.variants.split(",")}):
        extra = ["--no-tune-malloc"] if args.no_tune_malloc else []
        procs[kind], addresses[kind] = _spawn(
            "--serve", kind, "--max-bytes", str(max_bytes), *extra
        )
    return sock, addresses


def _stop_receivers(procs: dict[str, subprocess.Popen]) -> None:
    """Close each receiver's stdin (its signal to exit); kill one that lingers."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _print_header(args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(
        f"# {os.cpu_count()} CPUs, load {load[0]:.2f}; "
        f"malloc tuned: {not args.no_tune_malloc}; "
        f"{args.rounds}x{args.repeats} timed pushes per cell, "
        "TCP and gRPC alternating; GB/s of payload (1 GB = 1e9 B), median [best]; "
        "CPU = sender + receiver CPU seconds per GB"
    )
    print(
        "| variant | chunk | size MB | raw TCP GB/s | gRPC GB/s | gRPC / TCP "
        "| TCP CPU s/GB | gRPC CPU s/GB |"
    )
    print("|---|---|---|---|---|---|---|---|")


def _alternate(
    tcp_push: Callable[[], float], tcp_pid: int, grpc_push: Callable[[], float], grpc_pid: int,
    args: argparse.Namespace,
) -> tuple[list[float], list[float], float, float]:  # fmt: skip
    """TCP and gRPC push times and CPU seconds, measured in alternating rounds so both paths
    see the same background load."""
    tcp_t, grpc_t, tcp_cpu, grpc_cpu = [], [], 0.0, 0.0
    for _ in range(args.rounds):
        walls, cpu = _measure(tcp_push, tcp_pid, args.repeats)
        tcp_t += walls
        tcp_cpu += cpu
        walls, cpu = _measure(grpc_push, grpc_pid, args.repeats)
        grpc_t += walls
        grpc_cpu += cpu
    return tcp_t, grpc_t, tcp_cpu, grpc_cpu


def _bench_chunk(
    variant: str, chunk: int, sizes: list[int], max_bytes: int, sock: socket.socket,
    address: str, procs: dict[str, subprocess.Popen], args: argparse.Namespace,
    totals: dict[str, float],
) -> None:  # fmt: skip
    """One table row per payload size for ``variant`` with ``chunk``-byte chunks; adds the
    times and bytes to ``totals``."""
    opts = TransportOptions(
        chunk_size=chunk, max_payload_bytes=max_bytes, tune_malloc=not args.no_tune_malloc
    )
    client = PeerClient(address, options=opts)
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.max_receive_message_length", opts.max_message_bytes),
    ])  # fmt: skip
    stub = pb_grpc.GossipStub(channel)
    pattern = bytes(range(256)) * 4096
    for size in sizes:
        payload = memoryview((pattern * (size // len(pattern) + 1))[:size])
        if variant == "protobuf":
            grpc_push = functools.partial(_protobuf_push, stub, payload, chunk)
        else:
            grpc_push = functools.partial(_fast_push, client, payload)
        tcp_push = functools.partial(_tcp_push, sock, payload)
        tcp_t, grpc_t, tcp_cpu, grpc_cpu = _alternate(
            tcp_push, procs["tcp"].pid, grpc_push, procs[_kind(variant)].pid, args
        )
        totals["tcp"] += sum(tcp_t)
        totals["grpc"] += sum(grpc_t)
        totals["bytes"] += size * len(tcp_t)
        gb = size * len(tcp_t) / 1e9
        tcp_med = size / statistics.median(tcp_t) / 1e9
        grpc_med = size / statistics.median(grpc_t) / 1e9
        print(
            f"| {variant} | {chunk // 1024} KiB | {size / MB:g} "
            f"| {tcp_med:.2f} [{size / min(tcp_t) / 1e9:.2f}] "
            f"| {grpc_med:.2f} [{size / min(grpc_t) / 1e9:.2f}] "
            f"| {grpc_med / tcp_med:.2f} | {tcp_cpu / gb:.2f} | {grpc_cpu / gb:.2f} |",
            flush=True,
        )
    client.close()
    channel.close()


def run(args: argparse.Namespace) -> int:
    sizes = [int(float(s) * MB) for s in args.sizes_mb.split(",")]
    chunks = [int(c) * 1024 for c in args.chunk_kib.split(",")]
    max_bytes = max(sizes)
    procs: dict[str, subprocess.Popen] = {}
    try:
        sock, addresses = _start_receivers(args, max_bytes, procs)
        _print_header(args)
        totals = {"tcp": 0.0, "grpc": 0.0, "bytes": 0}
        for variant in args.variants.split(","):
            for chunk in chunks:
                address = addresses[_kind(variant)]
                _bench_chunk(variant, chunk, sizes, max_bytes, sock, address, procs, args, totals)
        print(
            f"# overall: raw TCP {totals['bytes'] / totals['tcp'] / 1e9:.2f} GB/s, "
            f"gRPC {totals['bytes'] / totals['grpc'] / 1e9:.2f} GB/s, "
            f"ratio {totals['tcp'] / totals['grpc']:.2f}"
        )
        sock.close()
    finally:
        _stop_receivers(procs)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="1,16,100", help="payload sizes, MB (1e6 B)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternations of TCP and gRPC per cell"
    )
    parser.add_argument("--chunk-kib", default="1024", help="chunk sizes to try, KiB")
    parser.add_argument("--variants", default="fast", help="fast,protobuf,nopool")
    parser.add_argument(
        "--no-tune-malloc", action="store_true", help="leave glibc malloc thresholds alone"
    )
    parser.add_argument("--serve", choices=["grpc", "grpc-nopool", "tcp"], help=argparse.SUPPRESS)
    parser.add_argument("--max-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "tcp":
        serve_tcp(args.max_bytes)
        return 0
    if args.serve:
        serve_grpc(args.max_bytes, pool=args.serve == "grpc", tune=not args.no_tune_malloc)
        return 0
    unknown = set(args.variants.split(",")) - {"fast", "protobuf", "nopool"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
