"""Issue 42: what a peer took from its algorithm's recommended values is on record in
status.json (the daemon's whole code path, one peer alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gossipgrad.peer.config import build_config
from gossipgrad.peer.records import PeerStatus, read_record

pytestmark = pytest.mark.timeout(120)


def run_alone(run_dir: Path, overrides: dict[str, str]) -> PeerStatus:
    from gossipgrad.peer.runtime.daemon import Daemon

    cfg = build_config(
        {},
        {
            "peer.run_dir": str(run_dir),
            "train.task": "digits",
            "train.steps": "4",
            "train.eval_every": "0",
            "checkpoint.every": "0",
            "metrics.port": "0",
            **overrides,
        },
    )
    Daemon(cfg).run()
    status = read_record(run_dir / "status.json", PeerStatus)
    assert status is not None and status.state == "done"
    return status


def test_status_records_the_keys_diloco_chose_and_not_those_set(tmp_path: Path) -> None:
    status = run_alone(
        tmp_path / "diloco", {"gossip.algorithm": "diloco", "gossip.local_steps": "2"}
    )
    assert status.algorithm == "diloco"
    assert status.algorithm_defaults == {
        "topology": "exponential",
        "anchor_topology": "ring",
        "codec": "topk:0.2+int4",
        "anchor_codec": "sign",
        "anchor_gamma": 0.5,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "copy_dtype": "float16",
    }


def test_status_of_a_choco_peer_records_choco_s_values(tmp_path: Path) -> None:
    status = run_alone(tmp_path / "choco", {"gossip.codec": "int8"})
    assert status.algorithm == "choco"
    assert status.algorithm_defaults == {
        "local_steps": 1,
        "topology": "ring",
        "copy_dtype": "float32",
    }
