"""``gossipgrad-swarm``: run a local swarm of peer daemons on this machine and summarize it.

Starts N ``gossipgrad-peer`` processes on 127.0.0.1 (peer0 first, the others bootstrapping from
it), shows one live table of all peers, and ends with a summary: final evaluation per peer,
bytes each peer sent against what dense exchanges would have cost, and the true consensus
distance computed from the peers' final parameters. Ctrl-C stops every peer cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

ADDRESS_TIMEOUT_S = 60.0


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file, or None while it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


class LocalSwarm:
    """N peer processes on 127.0.0.1, each with its own run directory and log file.

    Args:
        out: directory for peer run dirs, logs and the swarm summary.
        n: number of peers.
        overrides: dotted config keys applied to every peer (``train.task`` etc.).
        config: optional base TOML file every peer reads first.
        command_prefix: optional ``i -> argv prefix`` run before peer i's python, e.g.
            ``["ip", "netns", "exec", NS]`` to start it inside a network namespace.
        peer_overrides: optional ``i -> {key: value}`` applied to peer i after
            ``overrides``, e.g. its own ``peer.listen`` address.
    """

    def __init__(
        self,
        out: Path,
        n: int,
        overrides: dict[str, str],
        config: Path | None = None,
        *,
        command_prefix: Callable[[int], list[str]] | None = None,
        peer_overrides: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"need at least one peer, got {n}")
        self.out = Path(out)
        self.n = n
        self.overrides = overrides
        self.config = config
        self.command_prefix = command_prefix
        self.peer_overrides = peer_overrides
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list[Any] = []
        self.bootstrap: str | None = None

    def peer_dir(self, i: int) -> Path:
        return self.out / f"peer{i}"

    def command(self, i: int, bootstrap: str | None) -> list[str]:
        """The command line of peer i (also written to DIR/commands.sh)."""
        opts = {
            "peer.id": f"peer{i}",
            "peer.run_dir": str(self.peer_dir(i)),
            "peer.expected_peers": str(self.n),
            "train.shard_index": str(i),
            "train.num_shards": str(self.n),
            "train.threads": "1",
            **self.overrides,
        }
        if self.peer_overrides is not None:
            opts.update(self.peer_overrides(i))
        if bootstrap:
            opts["peer.bootstrap"] = bootstrap
        cmd = [*(self.command_prefix(i) if self.command_prefix else []), sys.executable]
        cmd += ["-m", "gossipgrad.peer"]
        if self.config is not None:
            cmd += ["--config", str(self.config)]
        for k, v in opts.items():
            cmd += [f"--{k}", v]
        return cmd

    def spawn(self, i: int) -> None:
        """Start (or restart) peer i, bootstrapping from peer0 unless it is peer0."""
        bootstrap = None if i == 0 else self.bootstrap
        cmd = self.command(i, bootstrap)
        self.peer_dir(i).mkdir(parents=True, exist_ok=True)
        with open(self.out / "commands.sh", "a") as f:
            f.write(" ".join(cmd) + " &\n")
        log = open(self.out / f"peer{i}.log", "a")  # noqa: SIM115 - closed in stop()
        self.logs.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self, count: int | None = None) -> None:
        """Start peer0, wait for its address, then peers 1..count-1 bootstrapping from it."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "commands.sh").write_text("#!/usr/bin/env bash\n")
        for i in range(self.n):
            for name in ("status.json", "summary.json", "params.pt", "checkpoint.pt"):
                (self.peer_dir(i) / name).unlink(missing_ok=True)
            (self.out / f"peer{i}.log").unlink(missing_ok=True)
        self.spawn(0)
        deadline = time.monotonic() + ADDRESS_TIMEOUT_S
        address = None
        while address is None:
            status = read_json(self.peer_dir(0) / "status.json")
            address = status.get("address") if status else None
            if self.procs[0].poll() is not None:
                raise RuntimeError(f"peer0 exited early; see {self.out / 'peer0.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer0 did not start in {ADDRESS_TIMEOUT_S}s")
            time.sleep(0.1)
        self.bootstrap = address
        for i in range(1, self.n if count is None else count):
            self.spawn(i)

    def kill(self, i: int) -> None:
        """SIGKILL peer i (a crash: no checkpoint, no goodbye)."""
        self.procs[i].kill()
        self.procs[i].wait()

    def statuses(self) -> list[dict[str, Any]]:
        return [read_json(self.peer_dir(i) / "status.json") or {} for i in range(self.n)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def failed(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() not in (None, 0)]

    def wait(self, timeout: float) -> bool:
        """Wait for every peer to exit; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every peer (they checkpoint and leave), SIGKILL what is left after timeout."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        reap(self.procs.values(), timeout)
        for log in self.logs:
            log.close()


def reap(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """Wait for processes already told to stop; SIGKILL those still running at the deadline."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def progress_table(statuses: list[dict[str, Any]], steps: int) -> Table:
    table = Table(title="gossipgrad swarm", expand=False)
    for col in ("peer", "state", "step", "loss", "sent MB", "dense MB", "ratio"):
        table.add_column(col, justify="right")
    for i, s in enumerate(statuses):
        sent, dense = s.get("sent_update_bytes", 0), s.get("dense_bytes", 0)
        table.add_row(
            s.get("id", f"peer{i}"),
            s.get("state", "starting"),
            f"{s.get('step', 0)}/{steps}",
            f"{s['loss']:.4f}" if "loss" in s else "-",
            _mb(s.get("sent_bytes", 0)),
            _mb(dense),
            f"{dense / sent:,.0f}x" if sent else "-",
        )
    return table


def consensus_distance(param_files: list[Path]) -> tuple[float, float] | None:
    """True consensus distance (1/n) Σ_i ||x_i − x̄||² from the peers' final parameters,
    and the same relative to ||x̄||² (scale-free, comparable across models)."""
    import torch

    xs = [torch.load(p, weights_only=True) for p in param_files if p.exists()]
    if len(xs) < 2:
        return None
    stacked = torch.stack(xs).double()
    mean = stacked.mean(dim=0)
    dist = float(((stacked - mean) ** 2).sum(dim=1).mean())
    return dist, dist / max(float((mean**2).sum()), 1e-30)


def summarize(swarm: LocalSwarm) -> dict[str, Any]:
    """Collect summary.json of every peer plus swarm-level figures into DIR/swarm.json."""
    peers = [read_json(swarm.peer_dir(i) / "summary.json") for i in range(swarm.n)]
    done = [p for p in peers if p]
    result: dict[str, Any] = {"peers": peers, "num_peers": swarm.n}
    if done:
        params = done[0]["params"]
        steps = max(p["steps"] for p in done)
        # Dense data-parallel reference: ring all-reduce sends 2(n-1)/n * 4P bytes per step.
        ddp = 2 * (swarm.n - 1) / swarm.n * 4 * params * steps if swarm.n > 1 else 0
        sent = [p.get("sent_bytes", 0) for p in done]
        result.update(
            params=params,
            steps=steps,
            mean_sent_bytes=sum(sent) / len(sent),
            ddp_allreduce_bytes_per_peer=ddp,
        )
        cd = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in range(swarm.n)])
        if cd is not None:
            result["consensus_distance"], result["relative_consensus_distance"] = cd
    (swarm.out / "swarm.json").write_text(json.dumps(result, indent=1))
    return result


def print_summary(console: Console, result: dict[str, Any]) -> None:
    table = Table(title="final")
    for col in ("peer", "steps", "metric", "value", "train loss", "sent MB", "dense MB", "ratio"):
        table.add_column(col, justify="right")
    for i, p in enumerate(result["peers"]):
        if not p:
            table.add_row(f"peer{i}", "failed", *["-"] * 6)
            continue
        metric = p["metric"]
        sent, dense = p.get("sent_update_bytes", 0), p.get("dense_bytes", 0)
        table.add_row(
            p["id"],
            str(p["steps"]),
            metric,
            f"{p['final'][metric]:.4f}",
            f"{p['train_loss']:.4f}",
            _mb(p.get("sent_bytes", 0)),
            _mb(dense),
            f"{dense / sent:,.0f}x" if sent else "-",
        )
    console.print(table)
    if "params" in result:
        ddp = result["ddp_allreduce_bytes_per_peer"]
        sent = result["mean_sent_bytes"]
        console.print(
            f"model: {result['params']:,} parameters; mean bytes sent per peer "
            f"{_mb(sent)} MB vs {_mb(ddp)} MB for dense all-reduce "
            f"({ddp / sent:,.0f}x fewer)"
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
    p.add_argument("--codec", default="topk:0.01+int8", help="compression spec")
    p.add_argument("--topology", default="ring", help="gossip topology")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    overrides = {
        "train.task": args.task,
        "train.steps": str(args.steps),
        "gossip.codec": args.codec,
        "gossip.topology": args.topology,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            console.print(f"[red]--set expects KEY=VALUE, got {item!r}")
            return 2
        overrides[key] = value
    # Validate once here, so a typo fails before any process starts.
    from gossipgrad.peer.config import ConfigError, load_config

    try:
        load_config(args.config, {k: v for k, v in overrides.items() if k != "peer.bootstrap"})
    except ConfigError as err:
        console.print(f"[red]config error: {err}")
        return 2
    swarm = LocalSwarm(args.out, args.peers, overrides, args.config)
    console.print(
        f"starting {args.peers} peers: task={args.task} codec={args.codec} "
        f"topology={args.topology} steps={args.steps} -> {args.out}"
    )
    interrupted = False
    try:
        swarm.start()
        if args.no_live:
            while swarm.running():
                time.sleep(2.0)
                steps = [s.get("step", 0) for s in swarm.statuses()]
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
