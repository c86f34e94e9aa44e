"""Is compressed gossip stable on its own? CHOCO consensus rounds with no training.

Starts ``--peers`` real peers in this process (gRPC on 127.0.0.1), each with a small MLP
initialised from a different seed, and runs gossip rounds only, printing the relative
consensus distance (1/n) Σ‖x_i − x̄‖² / ‖x̄‖² every ``--every`` rounds for each γ. A stable
setting drives it towards 0; an unstable one grows it. CHOCO-SGD converges only for a consensus
step γ small enough for the compressor's quality δ (Koloskova, Stich, Jaggi, ICML 2019,
Theorem 2): with top-1% copies lag x by ~1/δ rounds, so γ must be small.

    python scripts/bench_consensus.py --gammas 0.03,0.1 --rounds 2500
"""

from __future__ import annotations

import argparse
import logging
import threading

import torch
from gossipgrad.peer.config import build_config
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.runtime.node import Peer
from torch import nn


def start_swarm(n: int, overrides: dict) -> list[Peer]:
    peers: list[Peer] = []
    for i in range(n):
        torch.manual_seed(100 + i)
        flat = FlatParameters(nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10)))
        boot = [peers[0].address] if peers else []
        cfg = build_config(
            {}, {"peer.id": f"p{i}", "peer.bootstrap": boot, "metrics.enabled": False, **overrides}
        )
        peers.append(Peer(cfg, flat))
        peers[-1].start()
    for p in peers:
        if not p.membership.wait_for(n, 30):
            raise RuntimeError("peers did not meet")
    return peers


def rounds(peers: list[Peer], count: int) -> None:
    threads = [
        threading.Thread(target=lambda p=p: [p.algorithm.step_round() for _ in range(count)])
        for p in peers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def relative_distance(peers: list[Peer]) -> float:
    xs = torch.stack([p.flat.data for p in peers])
    mean = xs.mean(0)
    return float(((xs - mean) ** 2).sum(1).mean() / (mean**2).sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gammas", default="0.03,0.1", help="comma-separated consensus steps γ")
    ap.add_argument("--codec", default="topk:0.01+int8")
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2500)
    ap.add_argument("--every", type=int, default=250, help="print every N rounds")
    ap.add_argument("--staleness", type=int, default=1, help="gossip.max_staleness")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    print(f"codec {args.codec}, {args.topology}, {args.peers} peers, staleness {args.staleness}")
    print("gamma  rounds  rel. consensus distance")
    for gamma in (float(g) for g in args.gammas.split(",")):
        overrides = {
            "gossip.gamma": gamma,
            "gossip.codec": args.codec,
            "gossip.topology": args.topology,
            "gossip.max_staleness": args.staleness,
            "membership.heartbeat_interval": 0.1,
        }
        peers = start_swarm(args.peers, overrides)
        try:
            print(f"{gamma:<6} {0:>6}  {relative_distance(peers):.3e}", flush=True)
            done = 0
            while done < args.rounds:
                step = min(args.every, args.rounds - done)
                rounds(peers, step)
                done += step
                print(f"{gamma:<6} {done:>6}  {relative_distance(peers):.3e}", flush=True)
        finally:
            for p in peers:
                p.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
