"""What relaying costs a relay: its own training with two peers direct and with both relayed.

Issue 45 asks that a relay's own training slow down by at most 5 % when it relays for two
peers. This runs the same three-peer swarm (a ring: every peer a neighbour of the other two)
twice on this machine's loopback: once with every peer reachable, once with peer1 and peer2
advertising an address where nothing listens (as an outbound-only peer's is: the dial-back
finds them unreachable), so that both attach to peer0, the only reachable member, and every
call to either of them, their calls to each other included, goes through peer0's tunnels.
peer0's step time (seconds per step between 25 % and 90 % of its steps, read from its
status.json), its compute utilization and its process CPU per step are printed for both runs
with their ratio, and the bytes peer0 forwarded (``gossipgrad_relay_forwarded_bytes_total``)
and those the attached peers' tunnels carried (``gossipgrad_relayed_bytes_total``), scraped
from their metrics endpoints.

By default every step also waits ``--accelerator-ms`` with the CPU free
(:mod:`gossipgrad.experiment.bench.emulated_accelerator`), as a site's host does while its
accelerator computes: the three peers then do not fill this host's cores with training, and
what the relay's tunnels take from its own training shows in its steps (the GIL, its threads)
rather than the other peers' training. ``--pairs`` runs alternate (direct first, then relayed
first) so that the host's drift cancels out; the median ratio is printed last.

    python scripts/bench_relay.py --steps 600 --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gossipgrad.experiment.bench.emulated_accelerator import BASE_TASK_ENV, TASK_NAME, WAIT_ENV
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.records import PeerSummary, read_record
from gossipgrad.peer.tasks.registry import BUILTIN_TASKS
from prometheus_client.parser import text_string_to_metric_families

#: The peers that cannot be dialled in the relayed run; peer0 relays for both.
RELAYED = (1, 2)
#: The window of peer0's steps its step time is measured over (start-up and the relays'
#: attaching before it, the end and the others' finishing after it).
WINDOW = (0.25, 0.90)
FORWARDED = "gossipgrad_relay_forwarded_bytes_total"
CARRIED = "gossipgrad_relayed_bytes_total"


@dataclass
class RunFigures:
    """One run: peer0's training and the bytes through relays."""

    relayed: bool
    step_s: float
    compute_utilization: float
    cpu_per_step_s: float
    steps: int
    wall_s: float
    relays: dict[str, str] = field(default_factory=dict)
    forwarded: dict[str, float] = field(default_factory=dict)
    carried: dict[str, float] = field(default_factory=dict)


def closed_port() -> str:
    """A 127.0.0.1 address where nothing listens (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def counters(port: int, name: str) -> dict[str, float]:
    """The series of counter ``name`` on 127.0.0.1:``port``/metrics, by their one label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[next(iter(sample.labels.values()), "")] = sample.value
    return out


def window_step_s(samples: list[tuple[float, int]], steps: int) -> float:
    """Seconds per step between the first samples at WINDOW's two fractions of ``steps``."""
    lo, hi = (int(f * steps) for f in WINDOW)
    start = next(((t, s) for t, s in samples if s >= lo), None)
    end = next(((t, s) for t, s in samples if s >= hi), None)
    if start is None or end is None or end[1] <= start[1]:
        raise RuntimeError(f"peer0's status never showed steps {lo}..{hi}: {samples[-3:]}")
    return (end[0] - start[0]) / (end[1] - start[1])


def peer_keys(i: int, advertised: dict[int, str]) -> dict[str, str]:
    """Peer i's own keys: the address it advertises if it is to be unreachable."""
    return {"peer.advertise": advertised[i]} if i in advertised else {}


def run_once(out: Path, overrides: dict[str, str], steps: int, relayed: bool) -> RunFigures:
    """Start the swarm, sample peer0's progress and the relay counters until it ends."""
    advertised = {i: closed_port() for i in RELAYED} if relayed else {}
    swarm = LocalSwarm(
        out,
        3,
        overrides,
        peer_overrides=lambda i: peer_keys(i, advertised),
    )
    samples: list[tuple[float, int]] = []
    forwarded: dict[str, float] = {}
    carried: dict[str, float] = {}
    relays: dict[str, str] = {}
    started = time.monotonic()
    try:
        swarm.start()
        while swarm.running():
            if time.monotonic() - started > 600:
                raise RuntimeError(f"the swarm did not finish in 600 s: see {out}")
            statuses = swarm.statuses()
            if statuses[0].time is not None:
                samples.append((statuses[0].time, statuses[0].step))
            for i, status in enumerate(statuses):
                if status.relay:
                    relays[status.id] = status.relay
                if not status.metrics_port or not swarm.alive(i):
                    continue
                try:
                    if i == 0:
                        forwarded.update(counters(status.metrics_port, FORWARDED))
                    else:
                        got = counters(status.metrics_port, CARRIED)
                        carried[status.id] = sum(got.values())
                except OSError:
                    pass  # not serving yet, or gone: the last scrape stands
            time.sleep(0.5)
    finally:
        swarm.stop(timeout=30)
    if swarm.failed():
        raise RuntimeError(f"peers {swarm.failed()} failed: see {out}")
    summary = read_record(swarm.peer_dir(0) / "summary.json", PeerSummary)
    if summary is None or summary.cpu_seconds is None or summary.compute_utilization is None:
        raise RuntimeError(f"peer0 wrote no summary with its CPU and utilization: see {out}")
    return RunFigures(
        relayed=relayed,
        step_s=window_step_s(samples, steps),
        compute_utilization=summary.compute_utilization,
        cpu_per_step_s=summary.cpu_seconds / max(summary.steps, 1),
        steps=summary.steps,
        wall_s=time.monotonic() - started,
        relays=relays,
        forwarded=forwarded,
        carried=carried,
    )


def table(direct: RunFigures, relayed: RunFigures) -> str:
    """Both runs' rows and the ratios, relayed against direct."""
    rows = [
        f"{'run':<10}{'step ms':>9}{'util':>7}{'CPU ms/step':>13}{'forwarded MB':>14}  relays",
    ]
    for name, r in (("direct", direct), ("relayed", relayed)):
        mb = sum(r.forwarded.values()) / 1e6
        who = ", ".join(f"{k}->{v}" for k, v in sorted(r.relays.items())) or "-"
        rows.append(
            f"{name:<10}{1000 * r.step_s:>9.2f}{r.compute_utilization:>7.3f}"
            f"{1000 * r.cpu_per_step_s:>13.2f}{mb:>14.2f}  {who}"
        )
    rows.append(
        f"{'ratio':<10}{relayed.step_s / direct.step_s:>8.3f}x"
        f"{relayed.compute_utilization / direct.compute_utilization:>6.3f}x"
        f"{relayed.cpu_per_step_s / direct.cpu_per_step_s:>12.3f}x"
    )
    per = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(relayed.forwarded.items()))
    rows.append(f"peer0 forwarded for {per or 'nobody'}")
    per = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(relayed.carried.items()))
    rows.append(f"tunnels carried {per or 'nothing'}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="training steps per peer")
    p.add_argument("--pairs", type=int, default=2, help="direct/relayed pairs, alternating")
    p.add_argument("--task", default="digits", help="built-in task the peers train")
    p.add_argument("--codec", default="int8", help="gossip.codec (dense int8: bytes to relay)")
    p.add_argument("--local-steps", type=int, default=1, help="gossip.local_steps")
    p.add_argument(
        "--accelerator-ms",
        type=float,
        default=20.0,
        help="every step also waits this many ms with the CPU free (0: off)",
    )
    p.add_argument("--out", type=Path, default=Path("bench_relay"), help="run directories")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config key")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 20:
        parser.error("--pairs must be at least 1 and --steps at least 20")
    if args.task not in BUILTIN_TASKS:
        parser.error(f"--task must be a built-in task: {', '.join(BUILTIN_TASKS)}")
    if not args.accelerator_ms >= 0:
        parser.error("--accelerator-ms must be >= 0")
    overrides = {
        "train.task": args.task,
        "train.batch_size": "32",
        "train.eval_every": "0",
        "train.steps": str(args.steps),
        "gossip.codec": args.codec,
        "gossip.topology": "ring",
        "gossip.local_steps": str(args.local_steps),
        "checkpoint.every": "0",
        "metrics.enabled": "true",
        "metrics.port": "0",
        "membership.heartbeat_interval": "0.2",
        "membership.suspect_after": "2",
        "membership.dead_after": "4",
        "peer.relay_capacity": "2",
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        overrides[key] = value
    if args.accelerator_ms > 0:
        os.environ[BASE_TASK_ENV] = overrides["train.task"]
        os.environ[WAIT_ENV] = repr(args.accelerator_ms)
        overrides["train.task"] = TASK_NAME
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: list[tuple[RunFigures, RunFigures]] = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {}
        for relayed in order:
            name = f"{'relayed' if relayed else 'direct'}{i}"
            runs[relayed] = run_once(args.out / name, overrides, args.steps, relayed)
            if relayed and set(runs[True].relays) != {f"peer{j}" for j in RELAYED}:
                raise RuntimeError(f"{name}: not every unreachable peer had a relay")
        pairs.append((runs[False], runs[True]))
        print(f"pair {i} ({'direct' if i % 2 == 0 else 'relayed'} first):")
        print(table(*pairs[-1]), flush=True)
    ratios = [r.step_s / d.step_s for d, r in pairs]
    each = " ".join(f"{x:.3f}" for x in ratios)
    print(
        f"relay step time relayed / direct by pair {each}; median {statistics.median(ratios):.3f}"
    )
    (args.out / "relay.json").write_text(
        json.dumps(
            {
                "pairs": [{"direct": asdict(d), "relayed": asdict(r)} for d, r in pairs],
                "config": overrides,
                "accelerator_ms": args.accelerator_ms,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
