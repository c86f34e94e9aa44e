"""Comparisons over the same links or none: a local run whose swarm goes through delaying
relays refuses the baselines (their gloo connections cannot be relayed) and prints no
speed-up; a run whose baselines share the swarm's links carries every system's compute
utilization in report.json and the summary; an older report whose DDP ran over other links
redraws without a speed-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gossipgrad.experiment.analysis import time_to_target
from gossipgrad.experiment.markdown import markdown
from gossipgrad.experiment.records import Report
from gossipgrad.experiment.report import load_report
from support.experiment import processes_mentioning

SPEC = """
[experiment]
name = "fair"
peers = 2
mode = "local"
timeout = 200
sample_every = 0.25

[train]
task = "digits"
steps = 30
batch_size = 16
lr = 0.05
eval_every = 10

[gossip]
topology = "ring"

[membership]
heartbeat_interval = 0.2
suspect_after = 2.0
dead_after = 4.0

[checkpoint]
every = 0
"""


def run_experiment(tmp_path: Path, extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    spec, out = tmp_path / "spec.toml", tmp_path / "run"
    spec.write_text(SPEC + extra)
    proc = subprocess.run(
        [sys.executable, "-m", "gossipgrad.experiment", str(spec), "--out", str(out), "--no-live"],
        capture_output=True, text=True, timeout=250, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert processes_mentioning(str(out)) == []
    return proc, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_relayed_swarm_refuses_the_baselines_and_prints_no_speedup(tmp_path: Path) -> None:
    """delay = 25 ms per access link: the swarm crosses 100 ms RTT relays, gloo would run on
    plain loopback; before, DDP ran there and the summary printed a speed-up over it."""
    proc, out = run_experiment(
        tmp_path, '[network]\ndelay = "25ms"\n[baselines]\nrun = ["ddp", "diloco"]\n'
    )
    report = load_report(out)
    assert report.ok and report.swarm.ok
    for name in ("ddp", "diloco"):
        b = report.baselines[name]
        assert b.refused is not None and "relays" in b.refused
        assert b.ranks == [] and b.final is None
        assert not (out / "baselines" / name).exists()  # not run at all
    assert report.time_to_target is None
    raw = json.loads((out / "report.json").read_text())
    assert raw["baselines"]["ddp"]["refused"] == report.baselines["ddp"].refused
    summary = (out / "summary.md").read_text()
    assert "speed-up" not in summary
    assert f"- ddp: {report.baselines['ddp'].refused}" in summary
    # The refusal is in the runner's output, once per baseline.
    said = proc.stdout + proc.stderr
    assert said.count(report.baselines["ddp"].refused or "?") >= 1
    # The swarm's own utilization is there: waiting a 100 ms round trip costs it some.
    util = report.swarm.compute_utilization
    assert util is not None and 0 < util < 1
    assert all(p.compute_utilization is not None for p in report.swarm.peers)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_system_reports_its_compute_utilization(tmp_path: Path) -> None:
    """Plain loopback for everyone: DDP, PowerSGD and DiLoCo run, and each, like the swarm,
    has a utilization per process and a mean in report.json and the summary."""
    baselines = '[baselines]\nrun = ["ddp", "powersgd", "diloco"]\ndiloco_local_steps = 10\n'
    _, out = run_experiment(tmp_path, baselines)
    report = load_report(out)
    assert report.ok
    for p in report.swarm.peers:
        assert p.compute_utilization is not None and 0 < p.compute_utilization <= 1
    assert report.swarm.compute_utilization is not None
    for name, b in report.baselines.items():
        assert b.ok and b.refused is None, name
        for r in b.ranks:
            assert r is not None
            assert r.communication_seconds is not None and r.communication_seconds > 0, name
            assert r.compute_utilization is not None and 0 < r.compute_utilization < 1, name
        mean = sum(r.compute_utilization for r in b.ranks if r) / len(b.ranks)  # type: ignore[misc]
        assert b.compute_utilization == pytest.approx(mean), name
    summary = (out / "summary.md").read_text()
    table = summary.split("\n\n")[2].splitlines()  # title, the run's line, the table
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    column = rows[0].index("compute util.")
    rows = rows[2:]
    assert [row[0].split(" ")[0] for row in rows] == ["gossipgrad", "ddp", "powersgd", "diloco"]
    for row in rows:
        assert float(row[column]) > 0, row


def test_an_old_report_with_ddp_over_other_links_gets_no_speedup() -> None:
    """report.json from before refusals: DDP ran on loopback (``network`` set) while the
    swarm's links were delayed. Redrawn, it names DDP as not compared and prints no time to
    target (before, a '0.07x speed-up')."""
    proc = {
        "final": {"accuracy": 0.9}, "final_seconds": 2.0, "steps": 30, "metric": "accuracy",
        "evals": [{"step": 10, "seconds": 1.0, "accuracy": 0.9}], "wall_seconds": 2.0,
        "mean_sent_bytes": 1e6,
    }  # fmt: skip
    ddp = {**proc, "network": "unshaped loopback: baselines do not go through the relays"}
    report = Report.model_validate({
        "name": "old", "task": "digits", "peers": 1, "mode": "local", "seed": 0, "steps": 30,
        "batch_size": 8, "swarm": {"metric": "accuracy", "peers": [{"id": "peer0", **proc}]},
        "baselines": {"ddp": ddp},
    })  # fmt: skip
    assert time_to_target(report) is None
    summary = markdown(report)
    assert "speed-up" not in summary and "Time to DDP" not in summary
    assert "- ddp: ran over other links than the swarm's (unshaped loopback" in summary


def test_dry_run_says_which_baselines_it_refuses(tmp_path: Path) -> None:
    """The plan shows the refusal before anything runs: relays refuse, netns does not."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC + '[network]\ndelay = "25ms"\n[baselines]\nrun = ["ddp"]\n')

    def plan(*extra: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "gossipgrad.experiment", str(spec), "--dry-run", *extra],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return next(line for line in proc.stdout.splitlines() if "baseline ddp" in line)

    assert "refused: the swarm's links are relays" in plan()
    assert "torch DDP over gloo" in plan("--set", "experiment.mode=netns")
