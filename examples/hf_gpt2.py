"""A Hugging Face ``transformers`` model in a gossipgrad swarm: a small GPT-2, own loop.

The model is built from a ``GPT2Config`` (random initialisation, nothing downloaded) and
trained as a byte-level language model on the Zen of Python (``import this``), which every
Python ships. GPT-2 ties its output layer to the token embedding; the tied weight is one
parameter and stays one through gossip. The algorithm here is ``exact-diloco`` (local AdamW
phases; every peer's compressed pseudo-gradient reaches every peer, and all take the same
outer step, so the replicas stay identical): for a few sites it reached a lower loss than
``diloco``'s neighbourhood averages at fewer bytes on both transformer tasks measured
(BENCHMARKS.md). Needs the optional extra: ``pip install 'gossipgrad[hf]'``.

Two peers on one machine, in two terminals::

    python examples/hf_gpt2.py --shard 0 --listen 127.0.0.1:29500
    python examples/hf_gpt2.py --shard 1 --bootstrap 127.0.0.1:29500

``--set KEY=VALUE`` sets any config key (e.g. ``--set gossip.local_steps=20``), ``--config
site.toml`` reads a ``gossipgrad-peer`` config file first.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import io
import json
from pathlib import Path

import torch
from gossipgrad.peer import GossipOptimizer, load_config

CONTEXT = 32


def zen_bytes() -> torch.Tensor:
    """The Zen of Python as bytes (``this.s`` is stored ROT13-encoded; importing ``this``
    prints it, so the import is silenced)."""
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    return torch.tensor(list(codecs.decode(this.s, "rot13").encode()), dtype=torch.long)


def windows(data: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(len(data) - CONTEXT, (count,), generator=gen)
    return torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])


def gpt2(layers: int, width: int) -> torch.nn.Module:
    """A GPT-2 with a byte vocabulary; the same on every peer (same seed)."""
    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel  # slow to import: not for --help

    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=width, n_layer=layers, n_head=2)
    return GPT2LMHeadModel(config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", type=int, default=0, help="this peer's data shard")
    p.add_argument("--peers", type=int, default=2, help="peers in the swarm (= data shards)")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address to serve gossip on")
    p.add_argument("--bootstrap", default="", help="address of any peer already running")
    p.add_argument("--config", type=Path, help="optional TOML config, as for gossipgrad-peer")
    p.add_argument("--set", action="append", default=[], help="any config key, KEY=VALUE")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint", type=Path, help="save the final state_dict here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    model = gpt2(args.layers, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = zen_bytes()
    # Shard by halves of the text: peers see different parts, the held-out set is all of it.
    shard = data.chunk(args.peers)[args.shard]
    overrides = {
        "peer.id": f"peer{args.shard}",
        "peer.listen": args.listen,
        "peer.bootstrap": [args.bootstrap] if args.bootstrap else [],
        "gossip.algorithm": "exact-diloco",  # its codec and H: peer/config/recommended.py
        **dict(kv.split("=", 1) for kv in args.set),
    }
    config = load_config(args.config, overrides)
    gen = torch.Generator().manual_seed(1 + args.shard)
    held_out = windows(data, 64, torch.Generator().manual_seed(99))
    with GossipOptimizer(model, optimizer, config) as gopt:
        print(
            f"gossip on {gopt.peer.address}, metrics on port {gopt.peer.metrics_port}", flush=True
        )
        gopt.wait_for_peers(args.peers, timeout=60)
        model.train()
        for _ in range(args.steps):
            batch = windows(shard, args.batch, gen)
            gopt.zero_grad()
            model(input_ids=batch, labels=batch).loss.backward()
            gopt.step()
        gopt.finish()
        model.eval()
        with torch.no_grad():
            loss = float(model(input_ids=held_out, labels=held_out).loss)
        result = {
            "id": gopt.peer.id,
            "steps": gopt.local_step,
            "rounds": gopt.round,
            "held_out_loss": loss,
            "tied": model.lm_head.weight is model.transformer.wte.weight,
            "params": gopt.flat.numel,
        }
        if args.checkpoint is not None:
            torch.save(gopt.state_dict(), args.checkpoint)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
