"""``reap``: whatever a phase started is gone when it ends, its children included -- a parent
that ignores SIGTERM is killed at the deadline, and so is a child that outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from gossipgrad.experiment.launch import LocalSwarm, reap, terminate

pytestmark = pytest.mark.timeout(60)

# A parent that starts a SIGTERM-ignoring child (its pid written to argv[1]), then either
# leaves on SIGTERM (argv[2] == "leave") or ignores it too.
PARENT = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "stay":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_parent(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int]:
    pid_file = tmp_path / f"child-{mode}.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file), mode])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the parent did not start its child"
        time.sleep(0.05)
    return parent, int(pid_file.read_text())


def stopped(parent: subprocess.Popen, child: int, stop) -> None:
    """Stop ``parent`` with ``stop()``; then neither it nor its child may be running."""
    try:
        assert alive(child)
        t0 = time.monotonic()
        stop()
        assert time.monotonic() - t0 < 15, "stopping overran its deadline by far"
        assert parent.returncode is not None
        assert not alive(child), "the child outlived its parent's stop"
    finally:
        for pid in (parent.pid, child):
            if alive(pid):
                psutil.Process(pid).kill()
        parent.wait()


@pytest.mark.parametrize("mode", ["leave", "stay"])
def test_terminate_leaves_nothing_running(tmp_path: Path, mode: str) -> None:
    parent, child = start_parent(tmp_path, mode)
    stopped(parent, child, lambda: terminate([parent], timeout=2.0))
    # "leave": it exited on SIGTERM (its child then found all the same); "stay": killed.
    assert parent.returncode == (-signal.SIGTERM if mode == "leave" else -signal.SIGKILL)


def test_reap_kills_a_parent_that_ignores_sigterm_and_its_child(tmp_path: Path) -> None:
    parent, child = start_parent(tmp_path, "stay")

    def signal_then_reap() -> None:
        parent.send_signal(signal.SIGTERM)
        reap([parent], timeout=2.0)

    stopped(parent, child, signal_then_reap)
    assert parent.returncode == -signal.SIGKILL


def test_reap_waits_for_a_clean_exit_without_killing(tmp_path: Path) -> None:
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    reap([quick], timeout=20.0)
    assert quick.returncode == 0


def test_a_swarm_needs_a_peer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one peer"):
        LocalSwarm(tmp_path, 0, {})
    swarm = LocalSwarm(tmp_path, 2, {"train.task": "digits"})
    cmd = swarm.command(1, "127.0.0.1:7070")
    opts = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert cmd[1:3] == ["-m", "gossipgrad.peer"]
    assert opts["--peer.bootstrap"] == "127.0.0.1:7070" and opts["--train.shard_index"] == "1"
    # Before its first write a peer reads as starting, under its own id.
    assert swarm.status(1).id == "peer1" and swarm.status(1).state == "starting"


@pytest.mark.timeout(180)
def test_a_swarm_confined_to_cpus_runs_every_process_and_thread_on_them(tmp_path: Path) -> None:
    """``LocalSwarm(cpus=...)`` (bench_churn.py --side-by-side): peers and warm spares, and
    every thread they start, run on the CPUs named and no other."""
    with pytest.raises(ValueError, match="at least one CPU"):
        LocalSwarm(tmp_path, 1, {}, cpus=[])
    cpu = max(os.sched_getaffinity(0))
    swarm = LocalSwarm(
        tmp_path, 1, {"train.task": "digits", "train.steps": "100000"}, spares=1, cpus=[cpu]
    )
    try:
        swarm.start()
        swarm._wait_for_address(0)  # serving: its gRPC and training threads are up
        assert len(psutil.Process(swarm.procs[0].pid).threads()) > 1
        for pid in [swarm.procs[0].pid, *swarm.spare_pids]:
            threads = psutil.Process(pid).threads()
            assert {t.id: os.sched_getaffinity(t.id) for t in threads} == {
                t.id: {cpu} for t in threads
            }
    finally:
        swarm.stop(timeout=20)
    assert f"taskset --cpu-list {cpu} " in (tmp_path / "commands.sh").read_text()
