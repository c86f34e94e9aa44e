"""Races between the threads of one peer, and between the ranks of one site.

The membership-change handler runs on server, push and membership threads; a site's ranks
must take every decision that ends their loop together (stop, a non-finite loss).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from support.peers import start_peers

pytestmark = pytest.mark.timeout(120)


class _SnapshotTogether(dict):
    """A dict of incarnations whose iteration waits until two threads both took their
    snapshot (or a second passed): it opens the window between reading who is known and
    dropping those who left as wide as a scheduler can."""

    def __init__(self, *args, barrier: threading.Barrier) -> None:
        super().__init__(*args)
        self.barrier = barrier

    def __iter__(self):
        keys = list(super().__iter__())
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait(timeout=1.0)
        return iter(keys)


def test_two_threads_dropping_one_peer_drop_it_once() -> None:
    """Two threads run the membership handler while a peer is gone: neither raises, the
    peer is dropped (and its edge forgotten) once."""
    p0, _p1 = start_peers(2)
    forgotten: list[str] = []
    real_forget = p0.algorithm.forget

    def counting_forget(peer: str) -> None:
        forgotten.append(peer)
        real_forget(peer)

    p0.algorithm.forget = counting_forget
    known = dict(p0._incarnations)
    assert "p1" in known
    p0._incarnations = _SnapshotTogether({**known, "ghost": 1}, barrier=threading.Barrier(2))
    errors: list[BaseException] = []

    def handler() -> None:
        try:
            p0._on_membership_change()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=handler) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert "ghost" not in p0._incarnations and "p1" in p0._incarnations
    assert forgotten.count("ghost") == 1


def _site_rank(rank: int, port: int, run_dir: Path, task: str) -> subprocess.Popen:
    """One rank of a two-rank site (gloo on 127.0.0.1, launched as srun or mpirun would:
    nothing kills one rank when the other leaves)."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    args = {
        "peer.id": "site-a",
        "peer.run_dir": str(run_dir),
        "peer.listen": "127.0.0.1:0",
        "train.task": task,
        "train.steps": "100000",
        "train.eval_every": "0",
        "train.threads": "1",
        "checkpoint.resume": "false",
        "metrics.enabled": "false",
    }
    cmd = [sys.executable, "-m", "gossipgrad.peer"]
    for key, value in args.items():
        cmd += [f"--{key}", value]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Both ranks' output once both exited (within ``timeout`` seconds, or the test fails
    and both are killed)."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail("a rank of the site did not exit: it waits in a collective")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return outs


@pytest.mark.timeout(240)
def test_a_signal_to_one_rank_stops_the_whole_site_at_one_step(
    tmp_path: Path, support_on_path
) -> None:
    """SIGTERM reaches the follower rank only: both ranks stop at the same step, exit 0 and
    say they stopped early (not: the follower leaves, the leader waits in its next
    all-reduce)."""
    port = _free_port()
    procs = [_site_rank(r, port, tmp_path, "support.tiny_user_task:make_task") for r in range(2)]
    follower_status = tmp_path / "rank1" / "status.json"
    deadline = time.monotonic() + 120
    while True:
        status = read_record(follower_status, PeerStatus)
        if status is not None and (status.step or 0) >= 20:
            break
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _finish(procs, 1)
            pytest.fail("the site did not reach step 20")
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    outs = _finish(procs, 90)
    assert [p.returncode for p in procs] == [0, 0], outs
    summaries = [
        read_record(d / "summary.json", PeerSummary) for d in (tmp_path, tmp_path / "rank1")
    ]
    assert all(s is not None for s in summaries), outs
    assert summaries[0].stopped_early and summaries[1].stopped_early
    assert summaries[0].steps == summaries[1].steps < 100000


@pytest.mark.timeout(240)
def test_a_non_finite_loss_on_one_rank_fails_every_rank_at_that_step(
    tmp_path: Path, support_on_path
) -> None:
    """Shard 1's loss turns NaN at step 15, the leader's is finite: both ranks raise the
    FloatingPointError at that one step (not: the follower leaves and the leader fails later
    in a collective with nobody on the other end)."""
    port = _free_port()
    task = "support.tiny_user_task:make_shard_diverging_task"
    procs = [_site_rank(r, port, tmp_path, task) for r in range(2)]
    outs = _finish(procs, 150)
    assert all(p.returncode not in (0, None) for p in procs), outs
    steps = [re.findall(r"FloatingPointError: loss is .* at step (\d+)", out) for out in outs]
    assert all(steps), outs
    assert steps[0][-1] == steps[1][-1], steps
