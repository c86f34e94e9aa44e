"""``gossipgrad-swarm``: run a local swarm of peer daemons on this machine and summarize it.

Starts N ``gossipgrad-peer`` processes on 127.0.0.1 (peer0 first, the others bootstrapping from
it), shows one live table of all peers, and ends with a summary: final evaluation per peer,
bytes each peer sent against what dense exchanges would have cost, and the true consensus
distance computed from the peers' final parameters. Ctrl-C stops every peer cleanly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from rich.console import Console
from rich.live import Live
from rich.table import Table


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def _ratio(dense: int, sent: int) -> str:
    return f"{dense / sent:,.0f}x" if sent else "-"


def progress_table(statuses: list[PeerStatus], steps: int) -> Table:
    """One row per peer: state, step, loss and bytes so far."""
    table = Table(title="gossipgrad swarm", expand=False)
    for col in ("peer", "state", "step", "loss", "sent MB", "dense MB", "ratio"):
        table.add_column(col, justify="right")
    for s in statuses:
        table.add_row(
            s.id,
            s.state,
            f"{s.step}/{steps}",
            f"{s.loss:.4f}" if s.loss is not None else "-",
            _mb(s.sent_bytes),
            _mb(s.dense_bytes),
            _ratio(s.dense_bytes, s.sent_update_bytes),
        )
    return table


def summarize(swarm: LocalSwarm) -> dict[str, Any]:
    """Every peer's summary.json plus swarm-level figures, also written to DIR/swarm.json."""
    peers = [read_record(swarm.peer_dir(i) / "summary.json", PeerSummary) for i in range(swarm.n)]
    done = [p for p in peers if p]
    result: dict[str, Any] = {
        "peers": [p.model_dump(mode="json") if p else None for p in peers],
        "num_peers": swarm.n,
    }
    if done:
        params = done[0].params
        steps = max(p.steps for p in done)
        # Dense data-parallel reference: ring all-reduce sends 2(n-1)/n * 4P bytes per step.
        ddp = 2 * (swarm.n - 1) / swarm.n * 4 * params * steps if swarm.n > 1 else 0
        result.update(
            params=params,
            steps=steps,
            mean_sent_bytes=sum(p.sent_bytes for p in done) / len(done),
            ddp_allreduce_bytes_per_peer=ddp,
        )
        cd = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in range(swarm.n)])
        if cd is not None:
            result["consensus_distance"], result["relative_consensus_distance"] = cd
    (swarm.out / "swarm.json").write_text(json.dumps(result, indent=1))
    return result


def final_table(peers: list[PeerSummary | None]) -> Table:
    """One row per peer: steps, final metric, last training loss and bytes."""
    table = Table(title="final")
    for col in ("peer", "steps", "metric", "value", "train loss", "sent MB", "dense MB", "ratio"):
        table.add_column(col, justify="right")
    for i, p in enumerate(peers):
        if p is None:
            table.add_row(f"peer{i}", "failed", *["-"] * 6)
            continue
        table.add_row(
            p.id,
            str(p.steps),
            p.metric,
            f"{p.final[p.metric]:.4f}",
            f"{p.train_loss:.4f}",
            _mb(p.sent_bytes),
            _mb(p.dense_bytes),
            _ratio(p.dense_bytes, p.sent_update_bytes),
        )
    return table


def print_summary(console: Console, result: dict[str, Any]) -> None:
    """The final table and the swarm's bytes and consensus distance (from ``summarize``)."""
    peers = [PeerSummary.model_validate(p) if p else None for p in result["peers"]]
    console.print(final_table(peers))
    if "params" not in result:
        return
    ddp, sent = result["ddp_allreduce_bytes_per_peer"], result["mean_sent_bytes"]
    console.print(
        f"model: {result['params']:,} parameters; mean bytes sent per peer "
        f"{_mb(sent)} MB vs {_mb(ddp)} MB for dense all-reduce ({ddp / sent:,.0f}x fewer)"
        if sent
        else "no bytes sent"
    )
    if "consensus_distance" in result:
        console.print(
            f"consensus distance (1/n) Σ||x_i - x̄||²: {result['consensus_distance']:.3e} "
            f"({result['relative_consensus_distance']:.2e} of ||x̄||²)"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gossipgrad-swarm",
        description="Run a local swarm of gossipgrad peers on 127.0.0.1 and summarize it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--peers", type=int, default=4, help="number of peer processes")
    p.add_argument("--task", default="digits", help="built-in task or package.module:factory")
    p.add_argument("--steps", type=int, default=300, help="local steps per peer")
    p.add_argument(
        "--codec",
        help="compression spec (gossip.codec; default: the algorithm's, e.g. choco's "
        "topk:0.01+int8)",
    )
    p.add_argument(
        "--topology",
        help="gossip topology (gossip.topology; default: the algorithm's, e.g. choco's ring)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/swarm"), help="output directory")
    p.add_argument("--config", type=Path, help="base TOML config every peer reads first")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config key for every peer, e.g. --set gossip.gamma=0.3 (repeatable)",
    )
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of a live table")
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, str]:
    """Every peer's config overrides from the command line. ``--codec`` and ``--topology``
    left out leave their keys to the chosen algorithm (peer/config/recommended.py), so
    ``--set gossip.algorithm=diloco`` alone runs diloco's codec and graph. Raises ValueError
    for a ``--set`` without ``=``."""
    overrides = {"train.task": args.task, "train.steps": str(args.steps)}
    for key, value in (("gossip.codec", args.codec), ("gossip.topology", args.topology)):
        if value is not None:
            overrides[key] = value
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = value
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        overrides = overrides_from(args)
    except ValueError as err:
        console.print(f"[red]{err}")
        return 2
    # Validate once here, so a typo fails before any process starts.
    from gossipgrad.peer.config import ConfigError, load_config

    try:
        cfg = load_config(
            args.config, {k: v for k, v in overrides.items() if k != "peer.bootstrap"}
        )
    except ConfigError as err:
        console.print(f"[red]config error: {err}")
        return 2
    swarm = LocalSwarm(args.out, args.peers, overrides, args.config)
    console.print(
        f"starting {args.peers} peers: task={args.task} algorithm={cfg.gossip.algorithm} "
        f"codec={cfg.gossip.codec} topology={cfg.gossip.topology} steps={args.steps} "
        f"-> {args.out}"
    )
    interrupted = False
    try:
        swarm.start()
        if args.no_live:
            while swarm.running():
                time.sleep(2.0)
                steps = [s.step for s in swarm.statuses()]
                console.print(f"steps {steps}")
        else:
            with Live(progress_table(swarm.statuses(), args.steps), console=console) as live:
                while swarm.running():
                    time.sleep(0.5)
                    live.update(progress_table(swarm.statuses(), args.steps))
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: stopping peers (they checkpoint and leave)")
    finally:
        swarm.stop()
    failed = swarm.failed()
    result = summarize(swarm)
    print_summary(console, result)
    for i in failed:
        console.print(f"[red]peer{i} failed; see {swarm.out / f'peer{i}.log'}")
    return 1 if failed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
