"""Time per step against the number of sites, under latency: gossip against ring all-reduce.

For each swarm size N, runs ``gossipgrad-experiment`` on a netns spec (default:
scripts/experiments/digits-wan-latency.toml, every site 10 ms each way, so 40 ms RTT between
sites) with the swarm and the DDP baseline over the same emulated links, and reads each
phase's training seconds per step from its report. Ring all-reduce pays 2(N - 1) one-way
latencies per step, so DDP's time per step grows with N; a gossip round waits one round trip
to its neighbours (overlapped with the next step at ``gossip.max_staleness`` 1), whatever N.

Prints one row per N (gossip and DDP seconds per step, DDP / gossip) and writes
``OUT/latency_scaling.json`` and ``OUT/latency_scaling.png`` (both curves). Needs root and
iproute2 (netns mode); each size is one experiment run, kept under ``OUT/nN``.

    sudo python scripts/bench_latency_scaling.py --peers 4,8,16 --steps 60 --out runs/scaling
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from gossipgrad.experiment.report import load_report
from gossipgrad.peer.config.base import list_from_text

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "scripts" / "experiments" / "digits-wan-latency.toml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Seconds per training step of a gossip swarm and of DDP (ring "
        "all-reduce) over the same emulated WAN, for several swarm sizes (netns mode: root).",
    )
    p.add_argument("--peers", default="4,8,16", help="swarm sizes, A,B,... (default 4,8,16)")
    p.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    p.add_argument("--spec", type=Path, default=SPEC, help="netns experiment spec to run")
    p.add_argument("--out", type=Path, default=Path("runs/latency-scaling"), help="output dir")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="extra spec key for every run, as gossipgrad-experiment --set (repeatable)",
    )  # fmt: skip
    return p


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One experiment run with n sites; the swarm's and DDP's seconds per step."""
    out = args.out / f"n{n}"
    keys = [
        f"experiment.peers={n}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        'baselines.run=["ddp"]',
        *args.sets,
    ]
    cmd = [sys.executable, "-m", "gossipgrad.experiment", str(args.spec), "--out", str(out),
           "--no-live"]  # fmt: skip
    for key in keys:
        cmd += ["--set", key]
    print(f"n = {n}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    report = load_report(out)
    ddp = report.baselines["ddp"]
    if not (report.swarm.ok and ddp.ok and report.swarm.wall_seconds and ddp.wall_seconds):
        raise SystemExit(f"n = {n}: the run failed; see {out}")
    gossip = report.swarm.wall_seconds / report.steps
    allreduce = ddp.wall_seconds / (ddp.steps or report.steps)
    return {"peers": n, "gossip_s_per_step": gossip, "ddp_s_per_step": allreduce}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [r["peers"] for r in rows]
    ax.plot(sizes, [r["ddp_s_per_step"] for r in rows], "o-", color="tab:red", label="DDP")
    ax.plot(sizes, [r["gossip_s_per_step"] for r in rows], "o-", color="tab:blue",
            label="gossipgrad")  # fmt: skip
    ax.set_xlabel("sites")
    ax.set_ylabel("seconds per training step")
    ax.set_xticks(sizes)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = [int(x) for x in list_from_text(args.peers)]
    except ValueError:
        raise SystemExit(f"--peers: {args.peers!r} is not a list of sizes, e.g. 4,8,16") from None
    if any(n < 2 for n in sizes):
        raise SystemExit("--peers: every swarm size must be at least 2")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run_size(n, args) for n in sizes]
    print(f"{'sites':>5}  {'gossip s/step':>13}  {'DDP s/step':>10}  {'DDP / gossip':>12}")
    for r in rows:
        ratio = r["ddp_s_per_step"] / r["gossip_s_per_step"]
        print(f"{r['peers']:>5}  {r['gossip_s_per_step']:>13.4f}  {r['ddp_s_per_step']:>10.4f}"
              f"  {ratio:>12.1f}")  # fmt: skip
    (args.out / "latency_scaling.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "latency_scaling.png", f"{args.spec.stem}, {args.steps} steps")
    print(f"wrote {args.out / 'latency_scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
