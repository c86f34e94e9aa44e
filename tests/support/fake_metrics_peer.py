"""A stand-in peer process for the Prometheus end-to-end test: real PeerMetrics, made-up training.

It serves PeerMetrics on 127.0.0.1 (port 0), writes ``READY <port>`` on stdout, then plays
gossip rounds with realistic numbers -- top-1% + int8 updates of a ``--params`` model (so the
compression ratio is ~170x), pushes and round latencies drawn from log-normal distributions,
a decaying loss and consensus distance, rising accuracy, a resync every 25 rounds, a stale
update now and then, the updates of the peers it relays for (``--relay-for``) -- until
SIGTERM or ``--max-seconds``. Heartbeats are counted without
a neighbour (``UNATTRIBUTED``), as the daemon's membership layer does.

tests/peer/runtime/test_prometheus_e2e.py scrapes a swarm of these next to a swarm of real
daemons: the fake one is deterministic in shape (every series moves) and starts in a second.
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import sys
import time

from gossipgrad.peer.metrics import UNATTRIBUTED, PeerMetrics

HEARTBEAT_BYTES = 48
HEADER_BYTES = 96


def update_wire_bytes(params: int, density: float, rng: random.Random) -> int:
    """Bytes of one top-k + int8 update: 1 byte per value, ~1.3 bytes per delta-varint index."""
    k = max(1, int(params * density * rng.uniform(0.95, 1.05)))
    return HEADER_BYTES + k + int(1.3 * k) + 4 * (k // 64 + 1)  # values, indices, block scales


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--id", required=True)
    ap.add_argument("--neighbors", required=True, help="comma-separated neighbour ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--round-seconds", type=float, default=0.05)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument(
        "--relay-for", default="", help="comma-separated ids of peers it relays for (their updates)"
    )
    return ap.parse_args(argv)


def joined_metrics(neighbors: list[str]) -> PeerMetrics:
    """PeerMetrics of a peer that has just joined a ring with ``neighbors``, all alive."""
    m = PeerMetrics()
    m.set_build_info(version="0.1.0", algorithm="choco", codec="topk:0.01+int8", topology="ring")
    m.mark_serving()  # as the daemon does once its gossip server is bound
    for n in neighbors:
        m.add_neighbor(n)
    m.set_neighbors(len(neighbors))
    m.set_peers(alive=len(neighbors), suspect=0, dead=0)
    return m


def play_round(
    m: PeerMetrics, r: int, neighbors: list[str], args: argparse.Namespace, rng: random.Random
) -> None:
    """Round ``r``'s metrics (all but its duration): a step, an update each way per
    neighbour, heartbeats, and now and then a resync, a rejected update or an evaluation."""
    dense = 4 * args.params
    loss = 2.3 * math.exp(-r / 60) + 0.1 + rng.uniform(0, 0.05)
    m.record_step(loss=loss, samples=32)
    m.observe_compress(rng.lognormvariate(math.log(0.004), 0.3))
    for n in neighbors:
        m.record_sent(n, "update", update_wire_bytes(args.params, args.density, rng), dense)
        m.record_received(n, "update", update_wire_bytes(args.params, args.density, rng))
        m.observe_push(n, rng.lognormvariate(math.log(0.02), 0.5))
    m.record_sent(UNATTRIBUTED, "heartbeat", HEARTBEAT_BYTES * len(neighbors))
    m.record_received(UNATTRIBUTED, "heartbeat", HEARTBEAT_BYTES * len(neighbors))
    if r % 25 == 24:
        n = neighbors[r // 25 % len(neighbors)]
        m.record_resync(n)
        m.record_sent(n, "resync", dense // 2 + HEADER_BYTES)
    if r % 40 == 7:
        m.record_rejected("stale")
    if r % 10 == 0:
        acc = 0.95 - 0.85 * math.exp(-r / 80)
        m.set_eval({"accuracy": acc, "loss": loss * 1.1})
    m.set_consensus_distance(math.exp(-r / 40) + rng.uniform(0, 0.01))
    m.set_error_feedback_norm(5.0 + rng.uniform(-0.5, 0.5))
    m.record_blocking(0.01 * len(neighbors))
    for attached in filter(None, args.relay_for.split(",")):  # both ways, to two neighbours
        m.record_relay_forwarded(attached, 4 * update_wire_bytes(args.params, args.density, rng))
        if r % 50 == 0:  # a neighbour's connection to it (re)opened
            m.record_relay_tunnel("spliced")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    neighbors = [n for n in args.neighbors.split(",") if n]
    rng = random.Random(f"{args.id}:{args.seed}")
    m = joined_metrics(neighbors)
    port = m.serve(host="127.0.0.1", port=0)

    stopping = False

    def on_term(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()

    dense = 4 * args.params
    start = time.monotonic()
    # A joining peer downloads state once.
    for n in neighbors[:1]:
        m.record_received(n, "state", dense // 2 + HEADER_BYTES)
        m.record_sent(n, "state", HEADER_BYTES)

    r = 0
    while not stopping and time.monotonic() - start < args.max_seconds:
        t0 = time.monotonic()
        play_round(m, r, neighbors, args, rng)
        time.sleep(max(0.0, args.round_seconds - (time.monotonic() - t0)))
        m.observe_round(time.monotonic() - t0)
        r += 1
    m.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
