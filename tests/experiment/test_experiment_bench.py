"""scripts/bench_suite.py's tables from hand-built reports: an ablation is compared with its
reference run's baselines, and the figures are the reports' own (read as records)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from gossipgrad.experiment.records import Report
from gossipgrad.experiment.report import save_report

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def bench(scripts_on_path: None):
    return importlib.import_module("bench_suite")


def report(accuracies: list[float], sent: float, baselines: dict) -> Report:
    peers = [{"id": f"peer{i}", "ok": True, "final": {"accuracy": a}, "metric": "accuracy",
              "higher_is_better": True, "steps": 100, "sent_update_bytes": sent / 2}
             for i, a in enumerate(accuracies)]  # fmt: skip
    return Report.model_validate(
        {
            "name": "b",
            "mode": "local",
            "peers": len(peers),
            "task": "digits",
            "steps": 100,
            "batch_size": 32,
            "seed": 0,
            "codec": "topk:0.01+int8",
            "gamma": 0.1,
            "local_steps": 1,
            "swarm": {
                "metric": "accuracy",
                "peers": peers,
                "mean_sent_bytes": sent,
                "relative_consensus_distance": 2e-3,
            },
            "baselines": baselines,
        }
    )


def test_an_ablation_row_uses_its_reference_baselines(bench, tmp_path: Path) -> None:
    ddp = {"ok": True, "final": {"accuracy": 0.95}, "metric": "accuracy",
           "mean_sent_bytes": 4e6, "wall_seconds": 7.0}  # fmt: skip
    for name, accs, base in (("digits", [0.94, 0.92], {"ddp": ddp}), ("digits-h2", [0.90], {})):
        (tmp_path / name).mkdir()
        save_report(tmp_path / name, report(accs, 4e4, base))
    entries = [
        bench.ENTRIES[[e.name for e in bench.ENTRIES].index(n)] for n in ("digits", "digits-h2")
    ]
    text = bench.tables(entries, tmp_path)
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r[0]: dict(zip(header, r, strict=True)) for r in (
        [c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}  # fmt: skip
    assert rows["digits"]["swarm accuracy (min-max)"] == "0.9300 (0.9200-0.9400)"
    assert rows["digits"]["gap to DDP (pt)"] == "-2.00"
    assert rows["digits"]["DDP/swarm bytes"] == "100x"
    assert rows["digits"]["DDP/swarm update bytes"] == "200x"
    assert rows["digits"]["swarm KB/peer/step"] == "0.40"
    # No baselines of its own: DDP's figures are the reference run's.
    assert rows["digits-h2"]["DDP"] == "0.9500" and rows["digits-h2"]["gap to DDP (pt)"] == "-5.00"
    assert rows["digits-h2"]["x̄ accuracy"] == "-"  # no params.pt: no average model
    seeds = bench.seed_summary(tmp_path)
    assert "| digits | 1 | 0.9300 | -2.00 [-2.00, -2.00]" in seeds
