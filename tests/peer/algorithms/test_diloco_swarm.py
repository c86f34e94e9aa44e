"""diloco with real peer processes on 127.0.0.1: a tiny transformer trained with AdamW.

The bounds are checked against a control run in the same test, the same peers with gossip
cut off (each in a swarm of its own): the control must fail them clearly, so the test cannot
pass for a swarm that does not gossip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.experiment.swarm import summarize
from gossipgrad.peer.tasks import TaskContext, train_centralized

PEERS, STEPS, BATCH = 3, 150, 16
BASE = {
    "train.task": "support.tiny_lm_task:make_task",
    "train.batch_size": str(BATCH),
    "train.steps": str(STEPS),
    "train.optimizer": "adamw",
    "train.lr": "0.003",
    "train.eval_every": "0",
    "gossip.algorithm": "diloco",
    "gossip.local_steps": "10",
    "gossip.codec": "topk:0.1+int8",
    "gossip.topology": "ring",
    "metrics.enabled": "false",
    "membership.heartbeat_interval": "0.2",
    "gossip.round_timeout": "10",
}


def run(out: Path, alone: bool) -> dict:
    def own_swarm(i: int) -> dict[str, str]:
        # No bootstrap: a peer whose bootstrap never answers (here: another swarm) exits.
        alone_keys = {"peer.swarm": f"alone{i}", "peer.expected_peers": "1", "peer.bootstrap": ""}
        return alone_keys if alone else {}

    swarm = LocalSwarm(out, PEERS, BASE, peer_overrides=own_swarm)
    try:
        swarm.start()
        assert swarm.wait(400), "swarm did not finish"
        assert swarm.failed() == []
        return summarize(swarm)
    finally:
        swarm.stop(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("support_on_path")  # the peers import support.tiny_lm_task
def test_diloco_swarm_trains_a_transformer_near_centralized(tmp_path: Path) -> None:
    central = train_centralized(
        "support.tiny_lm_task:make_task",
        STEPS,
        TaskContext(num_peers=PEERS, seed=0, batch_size=BATCH),
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.003),
    )["loss"]
    swarm, control = run(tmp_path / "diloco", False), run(tmp_path / "alone", True)
    losses = [p["final"]["loss"] for p in swarm["peers"]]
    alone = [p["final"]["loss"] for p in control["peers"]]
    print(
        f"diloco peers {losses}, alone {alone}, centralized {central:.4f}; relative "
        f"consensus {swarm['relative_consensus_distance']:.2e} vs "
        f"{control['relative_consensus_distance']:.2e} alone"
    )
    # Within 2 % of one model trained on all the data with the same samples and optimizer
    # (measured with the default outer step, lr 1 without momentum: +1.6 %); each peer alone
    # on its shard misses it (measured: +2.3 to +3.8 %).
    for loss in losses:
        assert loss < 1.02 * central
    assert min(alone) > 1.02 * central
    # The peers end on (nearly) one model; trained alone they end far apart.
    assert swarm["relative_consensus_distance"] < 1e-3
    assert control["relative_consensus_distance"] > 10 * swarm["relative_consensus_distance"]
    for p in swarm["peers"]:
        assert p["steps"] == STEPS and p["rounds"] == STEPS // 10
        assert p["dense_bytes"] > 2 * p["sent_update_bytes"] > 0
