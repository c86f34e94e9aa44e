"""Multi-process swarms: real peer processes gossiping over gRPC on 127.0.0.1.

Sized for a 2-core machine: the digits task, a few hundred steps, one torch thread per peer.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.experiment.swarm import summarize
from gossipgrad.peer.config import build_config
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from gossipgrad.peer.runtime.checkpoint import params_digest
from gossipgrad.peer.tasks import TaskContext, train_centralized
from gossipgrad.peer.tasks.schedule import lr_factor
from support.swarms import BASE, BATCH, served_states

STEPS = 300
# Tolerances stated by the peer issue's test: every peer within 3 points of one model trained
# on all the data with the same sample budget, and the peers' models close together.
ACCURACY_TOLERANCE = 0.03
RELATIVE_CONSENSUS_BOUND = 1e-3  # (1/n) Σ||x_i - x̄||² over ||x̄||²; peers that never mix: 0.036


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def step_of(swarm: LocalSwarm, i: int) -> int:
    return swarm.status(i).step


def scheduled_lr(swarm: LocalSwarm, step: int) -> float:
    """The learning rate the peers' schedule gives optimizer step ``step`` (0-based)."""
    train = build_config({}, swarm.overrides).train
    return train.lr * lr_factor(step, train)


@pytest.fixture
def swarm_factory(tmp_path: Path):
    made: list[LocalSwarm] = []

    def make(n: int, spares: int = 0, **overrides: str) -> LocalSwarm:
        s = LocalSwarm(tmp_path / f"swarm{len(made)}", n, {**BASE, **overrides}, spares=spares)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_peer_ring_matches_centralized_accuracy(swarm_factory) -> None:
    swarm = swarm_factory(4, **{"train.steps": str(STEPS)})
    swarm.start()
    assert swarm.wait(240), "swarm did not finish"
    assert swarm.failed() == []
    result = summarize(swarm)
    central = train_centralized("digits", STEPS, TaskContext(num_peers=4, seed=0, batch_size=BATCH))
    accs = [p["final"]["accuracy"] for p in result["peers"]]
    print(f"swarm accuracies {accs}, centralized {central['accuracy']:.4f}")
    print(f"relative consensus distance {result['relative_consensus_distance']:.3e}")
    for acc in accs:
        assert acc >= central["accuracy"] - ACCURACY_TOLERANCE
    for p in result["peers"]:  # rounds block the training thread, but not all the time
        assert p["gossip_blocking_seconds"] > 0.0 and 0.0 < p["compute_utilization"] < 1.0, p
        # The process's CPU time: all its threads, at most every core all the time.
        assert 0.0 < p["cpu_seconds"] <= len(os.sched_getaffinity(0)) * p["wall_seconds"], p
    assert result["relative_consensus_distance"] < RELATIVE_CONSENSUS_BOUND
    for p in result["peers"]:
        assert p["steps"] == STEPS
        # Compressed updates: at least 50x fewer bytes than the same updates dense.
        assert p["dense_bytes"] > 50 * p["sent_update_bytes"] > 0
    (swarm.out / "figures.json").write_text(json.dumps({"central": central, "accs": accs}))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_peer_others_go_on_and_it_resumes_from_checkpoint(swarm_factory) -> None:
    # The others go 150 steps on while it is down: with the default join_after_steps it
    # would rejoin from their state (tests/experiment/test_churn.py); here it resumes its
    # checkpoint. The restart goes to a warm spare: cold, on a loaded host, it came up after
    # the others had finished (a resumed peer that finds no swarm exits with an error).
    swarm = swarm_factory(
        4,
        spares=1,
        **{"train.steps": "700", "checkpoint.every": "50", "peer.join_after_steps": "100000"},
    )
    swarm.start()
    wait_for(lambda: step_of(swarm, 2) >= 150, 120, "peer2 to reach step 150")
    swarm.kill(2)
    killed_at = step_of(swarm, 2)
    saved = torch.load(swarm.peer_dir(2) / "checkpoint.pt", weights_only=True)
    others = [step_of(swarm, i) for i in (0, 1, 3)]
    # Nobody blocks on the dead peer: the others make real progress without it.
    wait_for(
        lambda: all(step_of(swarm, i) >= s + 150 for i, s in zip((0, 1, 3), others, strict=True)),
        120,
        "the others to go on without peer2",
    )
    swarm.spawn(2)
    assert swarm.wait(240), "swarm did not finish"
    assert swarm.failed() == []
    assert swarm.procs[2].pid in swarm.spare_pids, "the restart did not take the spare"
    log = swarm.log_path[2].read_text()
    assert "resumed from checkpoint at step" in log
    resumed_at = int(log.split("resumed from checkpoint at step ")[1].split()[0])
    assert resumed_at % 50 == 0 and 0 < resumed_at <= killed_at
    # It went on from the checkpoint itself: its step, its parameters bit for bit (not a
    # re-initialised model), and the learning-rate schedule fast-forwarded to that step (the
    # optimizer's state alone restores the first step's LR, not the schedule's position).
    status = read_record(swarm.peer_dir(2) / "status.json", PeerStatus)
    assert status is not None
    assert status.start_step == resumed_at == saved["local_step"]
    assert status.start_params == params_digest(saved["params"])
    assert status.start_lr == pytest.approx(scheduled_lr(swarm, resumed_at), rel=1e-9)
    assert status.start_schedule_step == resumed_at
    assert "lr_scheduler.step()" not in log, "torch warned about the schedule's fast-forward"
    result = summarize(swarm)
    for p in result["peers"]:
        assert p["steps"] == 700
        assert p["final"]["accuracy"] > 0.85


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_late_joiner_downloads_state_and_catches_up(swarm_factory) -> None:
    # Long enough that the first three are still training when the fourth has started (it
    # starts in ~10 s on a loaded 2-core machine, while they train ~20 steps a second).
    swarm = swarm_factory(4, **{"train.steps": "1000", "peer.expected_peers": "3"})
    swarm.start(count=3)
    wait_for(lambda: step_of(swarm, 0) >= 150, 120, "the first peers to train")
    swarm.spawn(3)
    assert swarm.wait(240), "swarm did not finish"
    assert swarm.failed() == []
    status = read_record(swarm.peer_dir(3) / "status.json", PeerStatus)
    assert status is not None and (status.joined_at_step or 0) >= 150
    # What it trained from is the snapshot a donor logged serving: same step, same parameters
    # bit for bit (the download was applied), and its first step ran at the schedule's
    # learning rate for that step (fast-forwarded, not restarted at step 0).
    assert status.start_step == status.joined_at_step
    assert (status.start_step, status.start_params) in served_states(swarm, range(3))
    assert status.start_lr == pytest.approx(scheduled_lr(swarm, status.start_step), rel=1e-9)
    assert status.start_schedule_step == status.start_step
    assert "lr_scheduler.step()" not in (swarm.out / "peer3.log").read_text()
    result = summarize(swarm)
    late = result["peers"][3]
    assert late["received_state_bytes"] > 0
    # It trained only the remaining steps yet ends as good as the others.
    best = max(p["final"]["accuracy"] for p in result["peers"][:3])
    assert late["final"]["accuracy"] >= best - 0.05


@pytest.mark.timeout(200)
def test_sigterm_checkpoints_and_leaves_cleanly(swarm_factory) -> None:
    swarm = swarm_factory(3, **{"train.steps": "100000"})
    swarm.start()
    wait_for(lambda: step_of(swarm, 1) >= 50, 120, "peer1 to train")
    swarm.procs[1].send_signal(signal.SIGTERM)
    assert swarm.procs[1].wait(timeout=30) == 0
    summary = read_record(swarm.peer_dir(1) / "summary.json", PeerSummary)
    assert summary is not None and summary.stopped_early is True
    state = torch.load(swarm.peer_dir(1) / "checkpoint.pt", weights_only=True)
    assert state["local_step"] == summary.steps >= 50
    # The others see it leave at once (no dead_after wait) and keep training.
    before = step_of(swarm, 0)
    wait_for(lambda: "peer peer1 left" in (swarm.out / "peer0.log").read_text(), 10, "leave")
    wait_for(lambda: step_of(swarm, 0) >= before + 100, 60, "peer0 to go on")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_final_rounds_bring_the_peers_together(swarm_factory) -> None:
    """gossip.final_rounds: gossip-only rounds after the last step shrink the disagreement."""
    short = {"train.steps": "40", "train.schedule": "constant", "train.lr": "0.1"}
    results = {}
    for rounds in (0, 60):
        swarm = swarm_factory(3, **short, **{"gossip.final_rounds": str(rounds)})
        swarm.start()
        assert swarm.wait(150), "swarm did not finish"
        assert swarm.failed() == []
        results[rounds] = summarize(swarm)
    plain, merged = results[0], results[60]
    print(
        f"relative consensus distance {plain['relative_consensus_distance']:.2e} without, "
        f"{merged['relative_consensus_distance']:.2e} after 60 final rounds"
    )
    assert merged["relative_consensus_distance"] < plain["relative_consensus_distance"] / 4
    for p in merged["peers"]:
        assert p["steps"] == 40 and p["rounds"] == 100
        assert p["final_before_final_rounds"]["accuracy"] > 0.5  # evaluated before the rounds
    assert all(p["final_before_final_rounds"] is None for p in plain["peers"])
