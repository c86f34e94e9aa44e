"""The daemon config the real-process swarm tests share: digits, a ring, topk:0.01+int8,
fast membership (a death is noticed in seconds)."""

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
