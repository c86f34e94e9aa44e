"""Bring your own training loop: one gossipgrad peer around a plain PyTorch loop.

Every peer trains the same model on its own data; ``GossipOptimizer`` wraps the model and any
``torch.optim`` optimizer, and each ``step()`` also gossips compressed updates (with error
feedback) with the neighbours over gRPC, with the daemon's config keys and metrics.

Two peers on one machine, in two terminals (data: scikit-learn's bundled digits)::

    python examples/own_loop.py --shard 0 --listen 127.0.0.1:29400
    python examples/own_loop.py --shard 1 --bootstrap 127.0.0.1:29400

Add ``--config site.toml`` to read the same TOML file as ``gossipgrad-peer`` (the command-line
flags here override it), or ``--set gossip.algorithm=ef-gradient`` for any single key.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from gossipgrad.peer import GossipOptimizer, load_config
from sklearn.datasets import load_digits
from torch import nn


def digits(shard: int, num_shards: int) -> tuple[torch.Tensor, ...]:
    """This peer's training shard and the shared held-out set (360 images, same on all)."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(y, dtype=torch.long)[order]
    train_x, train_y, test_x, test_y = x[:-360], y[:-360], x[-360:], y[-360:]
    return train_x[shard::num_shards], train_y[shard::num_shards], test_x, test_y


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", type=int, default=0, help="this peer's data shard")
    p.add_argument("--peers", type=int, default=2, help="peers in the swarm (= data shards)")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address to serve gossip on")
    p.add_argument("--bootstrap", default="", help="address of any peer already running")
    p.add_argument("--config", type=Path, help="optional TOML config, as for gossipgrad-peer")
    p.add_argument("--set", action="append", default=[], help="any config key, KEY=VALUE")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--checkpoint", type=Path, help="save the final state_dict here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)  # every peer starts from the same model
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    train_x, train_y, test_x, test_y = digits(args.shard, args.peers)

    overrides = {
        "peer.id": f"peer{args.shard}",
        "peer.listen": args.listen,
        "peer.bootstrap": [args.bootstrap] if args.bootstrap else [],
        **dict(kv.split("=", 1) for kv in args.set),
    }
    config = load_config(args.config, overrides)

    with GossipOptimizer(model, optimizer, config) as gopt:
        peer = gopt.peer
        print(f"gossip on {peer.address}, metrics on port {peer.metrics_port}", flush=True)
        gopt.wait_for_peers(args.peers, timeout=60)
        gen = torch.Generator().manual_seed(1 + args.shard)
        for _step in range(args.steps):
            gopt.zero_grad()
            for _ in range(args.accumulate):  # gradient accumulation: gossip only in step()
                idx = torch.randint(len(train_x), (args.batch,), generator=gen)
                loss = F.cross_entropy(model(train_x[idx]), train_y[idx]) / args.accumulate
                loss.backward()
            gopt.step()
            scheduler.step()  # schedulers drive the wrapped optimizer, as usual
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        if args.checkpoint is not None:
            torch.save(gopt.state_dict(), args.checkpoint)
        result = {
            "id": gopt.peer.id,
            "steps": gopt.local_step,
            "rounds": gopt.round,
            "accuracy": accuracy,
            "loss": loss.item() * args.accumulate,
        }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
