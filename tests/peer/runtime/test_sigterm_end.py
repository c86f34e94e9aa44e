"""A daemon stopped by SIGTERM ends its gossip symmetric (issue 41, finding 1): it still sends
FINAL and settles the exchanges under way, so its neighbour mixes no exchange it did not.

Two real peer processes on 127.0.0.1 (the digits task, as the other swarm tests). The witness
is ``exchanges`` in each summary.json: the CHOCO exchanges each end completed with the other,
which a symmetric end makes equal. Before the fix the stopped peer skipped ``finish()``: the
exchange its last round opened was answered and acknowledged by its server until it closed,
and mixed by the neighbour alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.records import PeerSummary, read_record
from support.swarms import BASE


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_a_sigterm_mid_run_leaves_no_exchange_mixed_at_one_end(tmp_path: Path) -> None:
    swarm = LocalSwarm(
        tmp_path / "swarm",
        2,
        {**BASE, "train.steps": "400", "gossip.local_steps": "1", "gossip.max_staleness": "1"},
    )
    try:
        swarm.start()
        wait_for(lambda: swarm.status(1).step >= 60, 150, "peer1 to train")
        assert swarm.terminate(1) == 0
        assert swarm.wait(150), "peer0 did not finish"
        assert swarm.failed() == []
        stopped = read_record(swarm.peer_dir(1) / "summary.json", PeerSummary)
        other = read_record(swarm.peer_dir(0) / "summary.json", PeerSummary)
    finally:
        swarm.stop(timeout=10)
    assert stopped is not None and stopped.stopped_early
    assert other is not None and not other.stopped_early and other.steps == 400
    # peer0's count for peer1 sits under "(departed)" once peer1 left its view.
    mine, theirs = sum(stopped.exchanges.values()), sum(other.exchanges.values())
    print(f"exchanges: peer1 (stopped at step {stopped.steps}) {mine}, peer0 {theirs}")
    assert mine == theirs > 10, f"peer1 {stopped.exchanges}, peer0 {other.exchanges}"
