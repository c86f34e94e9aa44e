#!/usr/bin/env python3
"""A diloco round's tensor work, in copies of the model: one process, one thread, no network.

What a peer of a ring does with its tensors at a phase end, with diloco's defaults (its
pseudo-gradient's codec with error feedback, sign anchors over float16 copies), each step
timed against a ``copy_`` of the model measured in the same run:

1. the pseudo-gradient a − θ compressed with error feedback (``ErrorFeedback.compress_difference``);
2. each neighbour's message checked on arrival (``Codec.receive``: its envelope, CRC and
   sections; our own message stands in for theirs: the same size and layout);
3. the average into the anchor: its own message as the encoder built it and each
   neighbour's as its receipt kept it (``Codec.add_all_``, as ``Average.add_to_``);
4. the anchors' CHOCO round: a − x̂ encoded with x̂ += q folded in (``encode_difference``),
   each neighbour's update decoded into its mirror, the consensus step (θ = a written in
   its pass) and the copies' checksums.

The figures say how many memory passes the round's CPU costs, without the threads, sockets
and contention of ``bench_scale.py``'s swarm (which measures the whole process). The minimum
over ``--repeat`` runs is printed per step.

    python scripts/bench_round.py --size 100M
    python scripts/bench_round.py --size 10M --codec topk:0.05+int2 --repeat 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from gossipgrad.compression import ErrorFeedback, from_spec
from gossipgrad.experiment.bench.sizes import parse_size
from gossipgrad.peer.algorithms.mixing import Pair, consensus_step
from gossipgrad.peer.config.recommended import recommended
from gossipgrad.peer.flat import tensor_checksum

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def best_of(repeat: int, step: Callable[[], object]) -> float:
    """The shortest of ``repeat`` timed calls of ``step``, seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def copy_time(t: torch.Tensor) -> float:
    """The time of one ``copy_`` of ``t`` into a tensor already touched, seconds."""
    target = torch.empty_like(t)
    return best_of(3, lambda: target.copy_(t))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("100M"))
    parser.add_argument("--codec", default=recommended("diloco", "codec"))
    parser.add_argument("--anchor-codec", default=recommended("diloco", "anchor_codec"))
    parser.add_argument(
        "--copy-dtype", choices=sorted(DTYPES), default=recommended("diloco", "copy_dtype")
    )
    parser.add_argument("--neighbours", type=int, default=2, help="a ring: 2")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, repeat = args.size, max(1, args.repeat)
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(n, generator=gen)
    anchor = theta + 0.01 * torch.randn(n, generator=gen)
    copy_s = copy_time(theta)
    feedback = ErrorFeedback(from_spec(args.codec))
    anchors_codec = from_spec(args.anchor_codec)
    copy_dtype = DTYPES[args.copy_dtype]
    # Per edge, as the edges hold them: its public copy of our anchor, its mirror of theirs.
    publics = [anchor.to(copy_dtype) for _ in range(args.neighbours)]
    mirrors = [anchor.to(copy_dtype) for _ in range(args.neighbours)]
    own = publics[0]
    seeds = iter(range(1, 1 << 30))
    feedback.compress_difference("v", anchor, theta, next(seeds))  # the residual exists
    message, built = feedback.compress_difference_parts("v", anchor, theta, next(seeds))
    received = feedback.codec.receive(message)
    weight = 1.0 / (1 + args.neighbours)
    update = anchors_codec.encode_difference(anchor, own.clone(), next(seeds))[0]
    pairs = [Pair(mirror=m, public=p, weight=weight) for p, m in zip(publics, mirrors, strict=True)]
    steps: list[tuple[str, int, Callable[[], object]]] = [
        (
            f"{args.codec} encode, error feedback",
            1,
            lambda: feedback.compress_difference("v", anchor, theta, next(seeds)),
        ),
        (
            f"{args.codec} a message checked on arrival",
            args.neighbours,
            lambda: feedback.codec.receive(message),
        ),
        (
            f"{args.codec} average into the anchor (own + {args.neighbours})",
            1,
            lambda: feedback.codec.add_all_(
                [(message if built is None else built, -weight)]
                + [(received, -weight)] * args.neighbours,
                anchor,
            ),
        ),
        (
            f"{args.anchor_codec} encode, x̂ += q",
            1,
            lambda: anchors_codec.encode_difference(anchor, own, next(seeds), fold=True),
        ),
        (
            f"{args.anchor_codec} decode into a mirror",
            args.neighbours,
            lambda: anchors_codec.decode_add_(update, mirrors[0], cast=True),
        ),
        ("consensus step, θ = a", 1, lambda: consensus_step(anchor, pairs, 0.5, also_into=theta)),
        ("checksum of a copy", 1 + args.neighbours, lambda: tensor_checksum(own)),
    ]
    print(f"{n:,} parameters, copy_ {copy_s * 1e3:.1f} ms; copies of the model per step")
    total = 0.0
    for label, times, step in steps:
        copies_each = best_of(repeat, step) / copy_s
        total += times * copies_each
        print(f"  {label:42s} {copies_each:6.2f} x {times}")
    print(f"round: {total:.1f} copies of the model")


if __name__ == "__main__":
    main()
