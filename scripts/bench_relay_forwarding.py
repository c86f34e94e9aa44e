#!/usr/bin/env python3
"""CPU a relay spends per byte it forwards: its process CPU seconds per GB through tunnels.

Starts a relay peer in a process of its own (plaintext, loopback), an outbound-only peer x
attached to it (x advertises a closed port: the dial-back finds it unreachable) and a peer j
that downloads x's state (``--mb`` megabytes) ``--downloads`` times: every byte crosses the
relay's tunnel from x to j, and j's requests the other way. The relay process's CPU time
over the downloads, less what it spends idle for as long (heartbeats), is divided by the
bytes it forwarded (``gossipgrad_relay_forwarded_bytes_total``, both directions), and the
frames it forwarded (calls of the hub's byte counter: a frame of a tunnel in calls, a read
of a spliced one) give the mean frame size. ``--tunnels calls`` turns the relay's raw tunnel
listener off (``peer.relay_port = -1``): the tunnels then go in Relay and Accept calls.

    python scripts/bench_relay_forwarding.py --mb 64 --downloads 4
    python scripts/bench_relay_forwarding.py --mb 64 --downloads 4 --tunnels calls
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import time
from typing import Any

import torch
from gossipgrad.peer.config import build_config
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.runtime.node import Peer
from torch import nn

MEMBERSHIP = {"metrics.enabled": False, "membership.heartbeat_interval": 0.5}
FORWARDED = "gossipgrad_relay_forwarded_bytes_total"


def _peer(pid: str, overrides: dict[str, Any], state=None) -> Peer:
    torch.manual_seed(0)
    flat = FlatParameters(nn.Sequential(nn.Linear(8, 4)))
    cfg = build_config({}, {"peer.id": pid, **MEMBERSHIP, **overrides})
    peer = Peer(cfg, flat, state_source=state)
    peer.start()
    return peer


#: ``--tunnels`` -> the relay's ``peer.relay_port``.
RELAY_PORT = {"spliced": 0, "calls": -1}


def _relay(conn, relay_port: int) -> None:
    """The relay's process: serve, and answer ``"cpu"`` with (CPU s, bytes, frames)."""
    relay = _peer("r", {"peer.relay_capacity": 2, "peer.relay_port": relay_port})
    conn.send(relay.address)
    while (msg := conn.recv()) != "stop":
        assert msg == "cpu"
        forwarded = relay.metrics.registry.get_sample_value(FORWARDED, {"attached": "x"})
        conn.send((time.process_time(), forwarded or 0.0, relay.relays.forwarded_frames))
    relay.close()


def closed_port() -> str:
    """A 127.0.0.1 address where nothing listens (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def bench(mb: float, downloads: int, tunnels: str = "spliced") -> dict[str, float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_relay, args=(there, RELAY_PORT[tunnels]), daemon=True)
    proc.start()
    peers: list[Peer] = []
    try:
        address = here.recv()
        blob = bytes(range(256)) * int(mb * 1e6 / 256)
        x = _peer(
            "x",
            {"peer.bootstrap": [address], "peer.advertise": closed_port()},
            lambda: (50, 5, blob),
        )
        peers.append(x)
        x.update_progress(50, 5)
        if x.check_reachability().status != "unreachable" or x.start_relaying() != "r":
            raise RuntimeError(f"x did not attach to the relay: {x.relay_refusals}")
        j = _peer("j", {"peer.bootstrap": [address]})
        peers.append(j)
        deadline = time.monotonic() + 30
        while not j.donors() or j.membership.record("x").info.relay != "r":
            if time.monotonic() > deadline:
                raise RuntimeError("j never saw x as a donor behind the relay")
            time.sleep(0.1)

        def cpu() -> tuple[float, float, int]:
            here.send("cpu")
            return here.recv()

        c0, t0 = cpu(), time.monotonic()
        for _ in range(downloads):
            _, state = j.download_state(timeout=120)
            if bytes(state) != blob:
                raise RuntimeError("the state came through altered")
        c1, t1 = cpu(), time.monotonic()
        time.sleep(min(t1 - t0, 10.0))  # idle: what heartbeats alone cost
        c2, t2 = cpu(), time.monotonic()
        idle_rate = (c2[0] - c1[0]) / (t2 - t1)
        busy = (c1[0] - c0[0]) - idle_rate * (t1 - t0)
        forwarded = c1[1] - c0[1]
        frames = c1[2] - c0[2]
        return {
            "tunnels": tunnels,
            "mb_per_download": mb,
            "downloads": downloads,
            "forwarded_mb": forwarded / 1e6,
            "wall_s": t1 - t0,
            "relay_cpu_s": busy,
            "relay_cpu_s_per_gb": busy / (forwarded / 1e9),
            "frames": frames,
            "mean_frame_kib": forwarded / max(frames, 1) / 1024,
            "cpu_us_per_frame": 1e6 * busy / max(frames, 1),
            "idle_cpu_share": idle_rate,
        }
    finally:
        for p in peers:
            p.close()
        here.send("stop")
        proc.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=64.0, help="state size per download, MB")
    p.add_argument("--downloads", type=int, default=4, help="downloads through the relay")
    p.add_argument(
        "--tunnels", choices=sorted(RELAY_PORT), default="spliced", help="how tunnels go"
    )
    args = p.parse_args(argv)
    if args.mb <= 0 or args.downloads < 1:
        p.error("--mb must be positive and --downloads at least 1")
    r = bench(args.mb, args.downloads, args.tunnels)
    print(
        f"forwarded {r['forwarded_mb']:.0f} MB in {r['wall_s']:.2f} s: relay CPU "
        f"{r['relay_cpu_s_per_gb']:.2f} s/GB, {r['frames']} frames of "
        f"{r['mean_frame_kib']:.1f} KiB on average, {r['cpu_us_per_frame']:.0f} us/frame"
    )
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
