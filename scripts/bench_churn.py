"""Churn all through a run: the same local swarm trained twice, without and with churn.

Both runs use the same peers, seeds and config (digits, a ring, topk:0.01+int8, one torch
thread per peer, ``--set`` keys on top). In the second, every ``--every-rounds`` rounds of the
swarm one peer is SIGKILLed, SIGTERMed, restarted from its checkpoint or a brand-new peer joins
(gossipgrad.experiment.bench.churn), the live count kept within ``--min-live`` and ``--peers``.
Printed for each run, over its steady window (every first peer training -> the first peer at
``--steps``):

* goodput: useful swarm steps per second with churn / without. Useful steps are the steps
  every peer took in the window, less those a restarted peer takes twice because its crash
  lost them (since its last checkpoint). On one machine the peers share the cores, so this is
  what the swarm as a whole got done; the rate per live peer-second is printed beside it.
* max stall: the longest time no peer advanced a step (0.5 s resolution: status.json).
* the final relative consensus distance (1/n) Σ||x_i - x̄||² / ||x̄||² over the peers that
  trained to the end, with and without churn, and the ratio.
* survivors' CPU: the median CPU seconds of the peers that trained from start to end in one
  life (their whole process: training, gRPC, heartbeats), what churn costs the peers it spares.
* per restarted or joined peer: seconds from its gRPC server start to its first mixed
  exchange (the peer's own gossipgrad_first_mix_seconds), its rounds by then, and how many
  rounds behind the swarm's median it started.

With ``--spares K``, K warm spares (``gossipgrad-peer --standby``) are started and warm before
the run with churn, and the first K restarts and joins take one: what peers on machines of
their own see, where a process's start-up (about 3 s of CPU: torch) does not slow the others.

With ``--side-by-side`` the two runs of a pair go at the same time, each confined to its own
half of the CPUs (``taskset``; the halves swap from pair to pair, and the churn run's spares are
warm before either swarm starts). Runs one after the other see the shared host's speed drift
by more than the goodput margin between them; side by side both see the same host.

With ``--accelerator-ms MS`` every training step also waits MS milliseconds with the CPU free
(:mod:`gossipgrad.experiment.bench.emulated_accelerator`), as a site's host does while its
accelerator computes: the swarm is no longer CPU-bound, so churn's own CPU work (a new life's
start, a donor serving its state, dense resyncs) stops slowing the peers it does not touch,
and goodput measures what the protocol loses (waits, rewires, peers down).

    python scripts/bench_churn.py --peers 16 --every-rounds 10 --steps 300 --out runs/churn
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from gossipgrad.experiment.bench.churn import ChurnDriver, ChurnTrace
from gossipgrad.experiment.bench.churn_figures import ChurnFigures, figures
from gossipgrad.experiment.bench.churn_schedule import ChurnSchedule
from gossipgrad.experiment.bench.emulated_accelerator import BASE_TASK_ENV, TASK_NAME, WAIT_ENV
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.tasks.registry import BUILTIN_TASKS

BASE = {
    "train.task": "digits",
    "train.batch_size": "32",
    "train.eval_every": "0",
    "gossip.codec": "topk:0.01+int8",
    "gossip.topology": "ring",
    "metrics.enabled": "true",
    "metrics.port": "0",
    # Sixteen peers starting together on two cores take minutes to import torch.
    "peer.start_timeout": "600",
}


def prepare_run(
    out: Path,
    args: argparse.Namespace,
    overrides: dict[str, str],
    churn: bool,
    cpus: list[int] | None = None,
) -> tuple[LocalSwarm, ChurnDriver]:
    """The swarm of one run, with or without churn, and the driver that will record it."""
    swarm = LocalSwarm(out, args.peers, overrides, spares=args.spares if churn else 0, cpus=cpus)
    schedule = (
        ChurnSchedule(
            every_rounds=args.every_rounds,
            min_live=args.min_live,
            max_live=args.peers,
            order=args.order,
            seed=args.seed,
            # After the first checkpoint: a peer killed before it restarts as a fresh one.
            first_round=max(args.every_rounds, args.checkpoint_every // args.local_steps + 1),
            last_round=args.steps // args.local_steps - args.every_rounds,
        )
        if churn
        else None
    )
    driver = ChurnDriver(
        swarm,
        schedule,
        steps=args.steps,
        local_steps=args.local_steps,
        join_extra={"peer.expected_peers": "1"},
    )
    return swarm, driver


def start_and_drive(swarm: LocalSwarm, driver: ChurnDriver, timeout: float) -> ChurnTrace:
    swarm.start()
    return driver.run(timeout=timeout)


def run_once(
    out: Path, args: argparse.Namespace, overrides: dict[str, str], churn: bool
) -> ChurnFigures:
    """One run of the swarm, with or without churn; its figures."""
    swarm, driver = prepare_run(out, args, overrides, churn)
    try:
        trace = start_and_drive(swarm, driver, args.timeout)
    finally:
        swarm.stop(timeout=60)
    return figures(trace, out)


def run_side_by_side(
    out: Path,
    suffix: str,
    args: argparse.Namespace,
    overrides: dict[str, str],
    cpus: tuple[list[int], list[int]],
) -> tuple[ChurnFigures, ChurnFigures]:
    """Both runs at once, the one without churn on ``cpus[0]``, the other on ``cpus[1]``.

    The churn run's spares are warm before either swarm starts (their start-up would
    otherwise fall in the other run's window).
    """
    runs = [
        prepare_run(out / f"steady{suffix}", args, overrides, False, cpus[0]),
        prepare_run(out / f"churn{suffix}", args, overrides, True, cpus[1]),
    ]
    try:
        runs[1][0].start_spares()
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(start_and_drive, s, d, args.timeout) for s, d in runs]
            traces = [f.result() for f in futures]
    finally:
        for swarm, _ in runs:
            swarm.stop(timeout=60)
    return figures(traces[0], runs[0][0].out), figures(traces[1], runs[1][0].out)


def cpu_halves() -> tuple[list[int], list[int]]:
    """This process's CPUs in two halves (``--side-by-side``)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--side-by-side needs at least 2 CPUs")
    return cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(steady: ChurnFigures, churned: ChurnFigures) -> str:
    """The printed comparison."""
    lines = [
        f"{'':22}{'no churn':>14}{'churn':>14}",
        f"{'window s':22}{steady.window_s:14.1f}{churned.window_s:14.1f}",
        f"{'events':22}{steady.events:14d}{churned.events:14d}",
        f"{'useful steps':22}{steady.useful_steps:14d}{churned.useful_steps:14d}",
        f"{'redone steps':22}{steady.redone_steps:14d}{churned.redone_steps:14d}",
        f"{'swarm steps/s':22}{steady.throughput:14.1f}{churned.throughput:14.1f}",
        f"{'steps/s per live peer':22}{steady.per_peer_rate:14.2f}{churned.per_peer_rate:14.2f}",
        f"{'max stall s':22}{steady.max_stall_s:14.2f}{churned.max_stall_s:14.2f}",
        f"{'survivors CPU s':22}{_fmt(steady.survivor_cpu_s, '14.1f')}"
        f"{_fmt(churned.survivor_cpu_s, '14.1f')}",
        f"{'peers at the end':22}{steady.final_peers:14d}{churned.final_peers:14d}",
        f"{'rel. consensus dist.':22}"
        f"{_fmt(steady.relative_consensus_distance, '14.2e')}"
        f"{_fmt(churned.relative_consensus_distance, '14.2e')}",
    ]
    goodput = churned.throughput / steady.throughput if steady.throughput else float("nan")
    per_peer = churned.per_peer_rate / steady.per_peer_rate if steady.per_peer_rate else 0.0
    lines.append(f"goodput {goodput:.1%} (per live peer-second {per_peer:.1%})")
    a, b = steady.relative_consensus_distance, churned.relative_consensus_distance
    if a and b:
        lines.append(f"consensus distance ratio churn / no churn {b / a:.2f}")
    lines.append(
        "restarts and joins: peer how start_step lag_rounds first_exchange_s rounds [spare]"
    )
    for life in churned.new_lives:
        lines.append(
            f"  peer{life.peer} {life.how} {life.start_step} {_fmt(life.lag_rounds, '.1f')} "
            f"{_fmt(life.first_exchange_s, '.2f')} {life.first_exchange_rounds}"
            + (" spare" if life.spare else "")
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a local swarm without and with churn (peers killed, stopped, "
        "restarted, joining all through the run) and compare goodput, stalls and consensus.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--peers", type=int, default=16, help="peers at the start (and at most)")
    p.add_argument("--min-live", type=int, default=None, help="fewest live peers (peers - 3)")
    p.add_argument("--every-rounds", type=int, default=10, help="swarm rounds between events")
    p.add_argument("--steps", type=int, default=300, help="train.steps of every peer")
    p.add_argument("--local-steps", type=int, default=1, help="gossip.local_steps (H)")
    p.add_argument("--algorithm", default="choco", help="gossip.algorithm (choco, diloco)")
    p.add_argument("--order", default="cycle", choices=("cycle", "random"), help="event order")
    p.add_argument("--seed", type=int, default=0, help="seeds events, victims, bootstraps")
    p.add_argument("--checkpoint-every", type=int, default=25, help="checkpoint.every")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more config keys"
    )
    p.add_argument("--out", type=Path, default=Path("runs/churn"), help="output directory")
    p.add_argument("--only-churn", action="store_true", help="skip the run without churn")
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="make the two runs this many times, alternately (OUT/steadyI, OUT/churnI), and "
        "print each pair's goodput and the median",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="warm spare processes (gossipgrad-peer --standby) started and warm before the "
        "run with churn; restarts and joins take one while any is left, so a process's "
        "start-up (seconds of CPU) is not charged to the swarm's shared cores",
    )
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the two swarms of a pair at the same time, each confined to its own half "
        "of this process's CPUs (the halves swap from pair to pair): both see the host as it "
        "is at that time, so its drift between runs falls out of the goodput",
    )
    p.add_argument(
        "--accelerator-ms",
        type=float,
        default=0.0,
        help="every training step also waits this many ms with the CPU free, as a site's "
        "host does while its accelerator computes "
        "(gossipgrad.experiment.bench.emulated_accelerator; 0: off): churn's CPU work then "
        "no longer comes out of the other peers' steps",
    )
    return p


def emulate_accelerator(overrides: dict[str, str], ms: float) -> None:
    """Make the peers train ``overrides``' task on an emulated accelerator taking ``ms`` per
    step: the task becomes the emulated one and the environment, which every peer and spare
    inherits, names the built-in task and the wait."""
    os.environ[BASE_TASK_ENV] = overrides["train.task"]
    os.environ[WAIT_ENV] = repr(ms)
    overrides["train.task"] = TASK_NAME


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.side_by_side and args.only_churn:
        parser.error("--side-by-side runs both swarms; it does not go with --only-churn")
    if not args.accelerator_ms >= 0:
        parser.error("--accelerator-ms must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.min_live is None:
        args.min_live = max(2, args.peers - 3)
    overrides = {
        **BASE,
        "train.steps": str(args.steps),
        "gossip.local_steps": str(args.local_steps),
        "gossip.algorithm": args.algorithm,
        "checkpoint.every": str(args.checkpoint_every),
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
        overrides[key] = value
    if args.accelerator_ms > 0:
        if overrides["train.task"] not in BUILTIN_TASKS:
            parser.error(
                f"--accelerator-ms runs a built-in task, not train.task={overrides['train.task']!r}"
            )
        emulate_accelerator(overrides, args.accelerator_ms)
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: list[tuple[ChurnFigures, ChurnFigures]] = []
    halves = cpu_halves() if args.side_by_side else None
    for i in range(args.pairs):
        suffix = str(i) if args.pairs > 1 else ""
        if halves is not None:
            # The halves swap from pair to pair: a core busier than the other cancels out.
            cpus = halves if i % 2 == 0 else (halves[1], halves[0])
            print(f"pair {i}: no churn on CPUs {cpus[0]}, churn on CPUs {cpus[1]}", flush=True)
            pairs.append(run_side_by_side(args.out, suffix, args, overrides, cpus))
        else:
            steady = None
            if not args.only_churn:
                steady = run_once(args.out / f"steady{suffix}", args, overrides, churn=False)
            churned = run_once(args.out / f"churn{suffix}", args, overrides, churn=True)
            pairs.append((steady or churned, churned))
        if args.pairs > 1:
            print(f"pair {i}:")
        print(report(*pairs[-1]), flush=True)
    if args.pairs > 1:
        rates = [c.throughput / s.throughput if s.throughput else 0.0 for s, c in pairs]
        each = " ".join(f"{r:.1%}" for r in rates)
        print(f"goodput by pair {each}; median {statistics.median(rates):.1%}")
    steady, churned = pairs[0]
    (args.out / "churn.json").write_text(
        json.dumps(
            {
                "steady": asdict(steady),
                "churn": asdict(churned),
                "pairs": [{"steady": asdict(s), "churn": asdict(c)} for s, c in pairs],
                "config": overrides,
                "side_by_side": args.side_by_side,
                "accelerator_ms": args.accelerator_ms,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
