"""What the real-process swarm tests share: the daemon config (digits, a ring,
topk:0.01+int8, fast membership: a death is noticed in seconds) and how a donor's served
states are read from its log."""

from __future__ import annotations

from gossipgrad.experiment.launch import LocalSwarm

BATCH = 32

BASE = {
    "train.task": "digits",
    "train.batch_size": str(BATCH),
    "train.eval_every": "0",
    "gossip.codec": "topk:0.01+int8",
    "gossip.topology": "ring",
    "metrics.enabled": "false",
    "membership.heartbeat_interval": "0.2",
    "membership.suspect_after": "2",
    "membership.dead_after": "4",
    "gossip.round_timeout": "3",
}


def served_states(swarm: LocalSwarm, peers: range) -> list[tuple[int, str]]:
    """(step, params digest) of every state the given peers logged serving to a joiner."""
    served = []
    for i in peers:
        for line in (swarm.out / f"peer{i}.log").read_text().splitlines():
            if "serving state at step " in line:
                step = int(line.split("serving state at step ")[1].split()[0])
                served.append((step, line.rsplit("params ", 1)[1].strip()))
    return served
