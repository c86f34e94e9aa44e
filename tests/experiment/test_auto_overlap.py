"""diloco's ``gossip.overlap = "auto"`` turns on where the measured round trip would stall a
phase end. Two digits peers over relayed 600 ms RTT links (local mode, no root) turn it on and
say so in status.json. What it buys and costs is measured in BENCHMARKS.md: on a shared 2-core
host two runs differ by more than the one-way trip a phase end saves."""

from __future__ import annotations

from pathlib import Path

import pytest
from gossipgrad.experiment.bench.emulated_accelerator import WAIT_ENV
from gossipgrad.experiment.report import load_report
from gossipgrad.peer.records import PeerStatus, read_record
from support.experiment import run_spec

SPEC = """
[experiment]
name = "auto-overlap"
peers = 2
mode = "local"
timeout = 200
sample_every = 0.5

[network]
delay = "150ms"   # per access link: 300 ms one-way between the sites, 600 ms RTT

[train]
task = "gossipgrad.experiment.bench.emulated_accelerator:task"
steps = 100
batch_size = 32
lr = 0.05
eval_every = 0

[gossip]
algorithm = "diloco"   # H = 10 from its defaults: 150 ms phases against a 600 ms RTT
overlap = "auto"

[membership]
heartbeat_interval = 0.2
suspect_after = 2.0
dead_after = 4.0

[checkpoint]
every = 0

[baselines]
run = []
"""

# Each step waits this long with the CPU free, as on an accelerator: a site's step time.
STEP_MS = 15


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_overlap_turns_on_over_a_600ms_round_trip(tmp_path: Path) -> None:
    out = run_spec(SPEC, tmp_path / "auto", env={WAIT_ENV: str(STEP_MS)})
    report = load_report(out)
    assert report.ok and all(p.steps == 100 for p in report.swarm.peers)
    for i in range(2):
        status = read_record(out / "swarm" / f"peer{i}" / "status.json", PeerStatus)
        assert status is not None and status.state == "done"
        # 600 ms against 150 ms phases (up to 1.3 s on a loaded host): over a quarter.
        assert status.overlap is True, status
