"""``gossipgrad-peer --standby PATH``: a warm spare does its start-up work, makes ``PATH`` a
named pipe, does nothing more until keys are written to it, then starts with them (real
processes, as an operator's failover script drives them)."""

from __future__ import annotations

import contextlib
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record

pytestmark = pytest.mark.timeout(120)

BASE = [
    "--set", "train.task=digits",
    "--set", "train.steps=5",
    "--set", "train.eval_every=0",
    "--set", "metrics.enabled=false",
    "--set", "peer.expected_peers=1",
]  # fmt: skip


@contextlib.contextmanager
def started_spare(trigger: Path) -> Iterator[subprocess.Popen]:
    """A spare on ``trigger``, SIGKILLed at the end if it still runs."""
    cmd = [sys.executable, "-m", "gossipgrad.peer", *BASE, "--standby", str(trigger)]
    spare = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=trigger.parent
    )
    try:
        yield spare
    finally:
        if spare.poll() is None:
            spare.kill()
            spare.wait()


def is_pipe(path: Path) -> bool:
    return path.exists() and stat.S_ISFIFO(path.stat().st_mode)


def wait_warm(spare: subprocess.Popen, trigger: Path) -> None:
    deadline = time.monotonic() + 90
    while not is_pipe(trigger):
        assert spare.poll() is None, spare.communicate()[0]
        assert time.monotonic() < deadline, "the spare never got warm"
        time.sleep(0.05)


def pull(trigger: Path, lines: list[str]) -> None:
    """Write the keys as a failover script does: in one go."""
    trigger.write_text("".join(f"{line}\n" for line in lines))


def test_a_warm_spare_waits_then_starts_with_the_keys_of_its_trigger(tmp_path: Path) -> None:
    trigger, run_dir = tmp_path / "go", tmp_path / "site-a"
    with started_spare(trigger) as spare:
        wait_warm(spare, trigger)
        time.sleep(1.0)
        assert spare.poll() is None, "the spare did not wait for its trigger"
        assert not run_dir.exists(), "the spare started before its trigger"
        assert psutil.Process(spare.pid).status() == psutil.STATUS_SLEEPING
        pull(trigger, ["# failover of site-a", "", "peer.id=site-a", f"peer.run_dir={run_dir}"])
        out, _ = spare.communicate(timeout=90)
    assert spare.returncode == 0, out
    assert not trigger.exists(), "the spare left its pipe behind"
    status = read_record(run_dir / "status.json", PeerStatus)
    summary = read_record(run_dir / "summary.json", PeerSummary)
    assert status is not None and status.id == "site-a" and status.pid == spare.pid
    assert summary is not None and summary.steps == 5 and not summary.stopped_early


def test_a_file_already_at_the_path_is_refused_and_left_alone(tmp_path: Path) -> None:
    """Issue 40: a regular file at the trigger path was applied as the spare's keys (one left
    from another run, or put there by anyone who can write the folder). It is refused now:
    exit 2, one line, the file untouched, no peer started."""
    trigger, run_dir = tmp_path / "go", tmp_path / "site-a"
    pull(trigger, ["peer.id=site-a", f"peer.run_dir={run_dir}"])
    planted = trigger.read_text()
    with started_spare(trigger) as spare:
        out, _ = spare.communicate(timeout=90)
    assert spare.returncode == 2, out
    assert trigger.read_text() == planted and not is_pipe(trigger)
    assert not run_dir.exists(), "a peer started from the planted file"
    assert "standby: 2 keys on" not in out, out


def test_a_bad_key_in_the_pipe_is_one_line(tmp_path: Path) -> None:
    trigger = tmp_path / "go"
    with started_spare(trigger) as spare:
        wait_warm(spare, trigger)
        pull(trigger, ["peer.id=site-a", "train.stepz=3"])
        out, _ = spare.communicate(timeout=90)
    assert spare.returncode == 2, out
    assert "standby: 2 keys on" in out, out
    errors = [line for line in out.splitlines() if "config error" in line]
    assert errors == [
        f"gossipgrad-peer: config error (from {trigger}): --set train.stepz: unknown key "
        "(see --config-reference)"
    ], out
    assert not trigger.exists(), "the spare left its pipe behind"
