#!/usr/bin/env python3
"""Chunked top-k against plain top-k: wire bytes per kept element, and time.

For each size (default 1M and 10M float32 elements of a Student-t(3), heavy-tailed like real
gradients) and each spec it prints the kept count, the index and total wire bytes per kept
element (as stored, zstd included), the selection time alone and the encode and decode_add_
times (best of ``--repeat``, after a warm-up, on ``--threads`` torch threads).

Example::

    python scripts/bench_sparsifiers.py                       # ~1-2 minutes on one core
    python scripts/bench_sparsifiers.py --sizes 1M --repeat 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from gossipgrad.compression import from_spec
from gossipgrad.compression.envelope_pb2 import TensorEnvelope
from gossipgrad.experiment.bench.sizes import parse_size
from rich.console import Console
from rich.table import Table

DEFAULT_SPECS = [
    "topk:0.01",
    "chunktopk:0.01",
    "chunktopk:0.01:block=256",
    "topk:0.01+int2",
    "chunktopk:0.01+int2",
    "topk:0.001",
    "chunktopk:0.001",
    "chunktopk:0.001:block=65536",
]


def gradient_like(n: int, seed: int = 0) -> torch.Tensor:
    """n float32 samples of a Student-t(3) distribution."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=g)
    chi2 = torch.randn(n, 3, generator=g).pow_(2).sum(1)
    return normal / (chi2 / 3).sqrt_()


def best_time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time of ``fn`` over ``repeat`` runs after one warm-up, and its result."""
    result = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def measure(spec: str, x: torch.Tensor, repeat: int) -> dict[str, Any]:
    codec = from_spec(spec)
    sp, _ = codec.stages()
    t_select, _ = best_time(lambda: sp.select(x, 1), repeat)
    t_encode, data = best_time(lambda: codec.encode(x, seed=1), repeat)
    out = torch.zeros_like(x)
    t_add, _ = best_time(lambda: codec.decode_add_(data, out), repeat)
    env = TensorEnvelope.FromString(data)
    return {
        "spec": spec,
        "numel": x.numel(),
        "kept": env.count,
        "index_bits": env.index_bits,
        "index_bytes_per_kept": len(env.indices.data) / env.count,
        "wire_bytes_per_kept": len(data) / env.count,
        "select_ms": 1e3 * t_select,
        "encode_ms": 1e3 * t_encode,
        "decode_add_ms": 1e3 * t_add,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1M,10M", help="comma-separated element counts")
    p.add_argument("--specs", default=",".join(DEFAULT_SPECS), help="comma-separated specs")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best of)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    for s in specs:
        if from_spec(s).stages()[0] is None:
            p.error(f"{s!r} has no sparsifier")
    table = Table(title=f"top-k vs chunked top-k, Student-t(3) fp32, {args.threads} thread(s)")
    for col in ("n", "spec", "kept", "idx bits", "idx B/kept", "wire B/kept", "select ms",
                "encode ms", "decode_add_ ms"):  # fmt: skip
        table.add_column(col, justify="left" if col == "spec" else "right")
    for n in (parse_size(s) for s in args.sizes.split(",") if s.strip()):
        x = gradient_like(n)
        for spec in specs:
            r = measure(spec, x, args.repeat)
            table.add_row(
                f"{n:,}",
                spec,
                f"{r['kept']:,}",
                str(r["index_bits"]),
                f"{r['index_bytes_per_kept']:.3f}",
                f"{r['wire_bytes_per_kept']:.3f}",
                f"{r['select_ms']:.1f}",
                f"{r['encode_ms']:.1f}",
                f"{r['decode_add_ms']:.1f}",
            )
    Console(width=150).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
