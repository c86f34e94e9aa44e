"""CPU a peer process spends leaving: from its SIGTERM to its exit.

A peer that leaves finishes its step, checkpoints, says goodbye, evaluates and writes its
summary; then its interpreter ends. With torch loaded, Python's own teardown (torch's
operator-library finalizers and the rest) costs more CPU than all the peer's own leaving work,
and on a machine whose cores a swarm shares, every leave takes that from the peers still
training. ``gossipgrad-peer`` therefore ends with a fast exit once its files are written
(``gossipgrad.peer.cli.run``).

This measures it: one peer alone on the digits task, started ``--repeats`` times each way --
as ``python -m gossipgrad.peer`` (the fast exit) and as a plain ``sys.exit(main())`` (the
interpreter's teardown, the baseline) -- and SIGTERMed once it has trained ``--steps`` steps.
The CPU seconds from the signal to the exit (the process's rusage less its CPU just before the
signal) are printed for each, with the medians and their ratio.

    python scripts/bench_leave.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from gossipgrad.peer.records import PeerStatus, read_record

#: The two ways to run the same daemon: the command as installed, and main() with the
#: interpreter's normal exit.
WAYS = {
    "fast exit": ["-m", "gossipgrad.peer"],
    "teardown": ["-c", "import sys; from gossipgrad.peer.cli import main; sys.exit(main())"],
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def leave_once(way: str, run_dir: Path, steps: int, timeout: float) -> float:
    """Start one peer, SIGTERM it at ``steps``; the CPU seconds it spent after the signal."""
    command = [
        sys.executable,
        *WAYS[way],
        "--peer.id=leaver",
        f"--peer.run_dir={run_dir}",
        "--train.task=digits",
        "--train.steps=100000000",
        "--train.eval_every=0",
        "--train.threads=1",
        "--metrics.enabled=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while (read_record(run_dir / "status.json", PeerStatus) or PeerStatus()).step < steps:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{way}: the peer did not reach step {steps}: see {log.name}")
            time.sleep(0.05)
        before = cpu_seconds(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{way}: exit status {proc.returncode}: see {log.name}")
    return usage.ru_utime + usage.ru_stime - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="CPU seconds a peer process spends from SIGTERM to exit: the fast exit of "
        "gossipgrad-peer against the interpreter's normal teardown, in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=3, help="peers started each way")
    parser.add_argument("--steps", type=int, default=50, help="steps before the SIGTERM")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to reach --steps")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-leave-") as tmp:
        for i in range(args.repeats):
            for way in WAYS:  # alternated, so a change in the host's load hits both
                run_dir = Path(tmp) / f"{way.replace(' ', '-')}-{i}"
                seconds[way].append(leave_once(way, run_dir, args.steps, args.timeout))
                print(f"{way:10} run {i}: {seconds[way][-1]:.2f} CPU s from SIGTERM to exit")
    fast, slow = (statistics.median(seconds[w]) for w in WAYS)
    print(f"median: fast exit {fast:.2f} s, teardown {slow:.2f} s")
    print(f"ratio teardown / fast exit: {slow / fast:.1f}x" if fast > 0 else "fast exit: 0 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
