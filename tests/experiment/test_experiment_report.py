"""The report's time-to-target figures on hand-built reports (both metric directions, never
reached), and that reports from before evaluations were timed still redraw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gossipgrad.experiment import analysis, cli
from gossipgrad.experiment.analysis import consensus_distance, time_to_target
from gossipgrad.experiment.markdown import markdown
from gossipgrad.experiment.records import Report, Sample, SystemTime
from gossipgrad.experiment.report import load_report, write_outputs
from support.experiment import png_size

pytestmark = pytest.mark.timeout(120)


def proc(evals: list[tuple[int, float, float]], final: tuple[float, float], metric: str) -> dict:
    """A process's report entry: timed evaluations (step, seconds, value) and its final one
    (seconds, value) at step 150."""
    return {
        "final": {metric: final[1]},
        "final_seconds": final[0],
        "steps": 150,
        "metric": metric,
        "evals": [{"step": s, "seconds": t, metric: v} for s, t, v in evals],
        # What the summary table reads (a peer ignores the baseline-only keys).
        "mean_sent_bytes": 1e6, "wall_seconds": final[0], "powersgd_rank": 2,
    }  # fmt: skip


def report_of(metric: str, peers: list[dict], baselines: dict[str, dict]) -> Report:
    for i, p in enumerate(peers):
        p.update(id=f"peer{i}", history=[])
    return Report.model_validate(raw_report(metric, peers, baselines))


def raw_report(metric: str, peers: list[dict], baselines: dict[str, dict]) -> dict:
    return {
        "name": "hand", "task": "t", "peers": len(peers), "mode": "local", "seed": 0,
        "steps": 150, "batch_size": 8, "codec": "none", "topology": "ring",
        "swarm": {"metric": metric, "peers": peers, "mean_sent_bytes": 1.0},
        "baselines": baselines,
    }  # fmt: skip


def accuracy_report() -> Report:
    peers = [
        proc([(50, 1.0, 0.80), (100, 2.0, 0.93)], (3.0, 0.95), "accuracy"),
        # Alone past DDP's final at step 100, but the mean (0.945) is not.
        proc([(50, 1.2, 0.84), (100, 2.5, 0.96)], (3.5, 0.96), "accuracy"),
    ]
    ddp = proc([(50, 10.0, 0.70), (100, 20.0, 0.945)], (30.0, 0.95), "accuracy")
    psgd = proc([(50, 5.0, 0.60), (100, 10.0, 0.85)], (15.0, 0.90), "accuracy")
    return report_of("accuracy", peers, {"ddp": ddp, "powersgd": psgd})


def test_consensus_distance_read_a_chunk_at_a_time_is_the_whole_vectors_one(
    tmp_path: Path, monkeypatch
) -> None:
    """(1/n) Σ ||x_i − x̄||² and its ratio to ||x̄||², from files read in chunks (one of them
    short), against the formula over the whole vectors; a missing file is left out."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(23, generator=gen) for _ in range(3)]
    files = [tmp_path / f"p{i}.pt" for i in range(4)]  # p3.pt: never written
    for x, f in zip(xs, files, strict=False):
        torch.save(x, f)
    monkeypatch.setattr(analysis, "CONSENSUS_CHUNK", 5)
    dist, relative = consensus_distance(files)
    stacked = torch.stack(xs).double()
    mean = stacked.mean(0)
    expected = float(((stacked - mean) ** 2).sum(1).mean())
    assert dist == pytest.approx(expected, rel=1e-12)
    assert relative == pytest.approx(expected / float((mean**2).sum()), rel=1e-12)
    assert consensus_distance(files[:1]) is None


def test_accuracy_target_is_the_first_mean_at_or_above_ddp_final() -> None:
    ttt = time_to_target(accuracy_report())
    assert ttt is not None and ttt.higher_is_better
    assert ttt.target == 0.95 and ttt.loose_target == pytest.approx(0.94)
    swarm, ddp, psgd = (ttt.systems[k] for k in ("swarm", "ddp", "powersgd"))
    # Mean over peers: 0.82, 0.945, 0.955 (final, timed by the slower peer).
    assert (swarm.step, swarm.seconds) == (150, 3.5)
    assert (swarm.loose_step, swarm.loose_seconds) == (100, 2.5)
    assert (ddp.step, ddp.seconds) == (150, 30.0)
    assert (ddp.loose_step, ddp.loose_seconds) == (100, 20.0)
    assert psgd == SystemTime()  # never reached either target
    assert ttt.speedup == {"ddp": pytest.approx(30.0 / 3.5), "powersgd": None}
    assert ttt.loose_speedup == {"ddp": pytest.approx(8.0), "powersgd": None}
    md = markdown(accuracy_report().model_copy(update={"time_to_target": ttt}))
    assert "## Time to DDP's final accuracy" in md
    assert "| powersgd | never | never | - | - |" in md
    assert "| ddp | 30.0 s (step 150) | 20.0 s (step 100) | 8.57x | 8.00x |" in md


def test_loss_target_is_the_first_mean_at_or_below_ddp_final() -> None:
    peers = [
        proc([(50, 1.0, 2.0), (100, 2.0, 1.50)], (3.0, 1.40), "loss"),
        proc([(50, 1.0, 2.2), (100, 2.2, 1.52)], (3.1, 1.45), "loss"),
    ]
    ddp = proc([(50, 10.0, 2.5), (100, 20.0, 1.52)], (30.0, 1.5), "loss")
    # A baseline that never gets close, and a swarm that never gets there in another run.
    psgd = proc([(50, 5.0, 3.0), (100, 10.0, 2.9)], (15.0, 2.8), "loss")
    ttt = time_to_target(report_of("loss", peers, {"ddp": ddp, "powersgd": psgd}))
    assert ttt is not None and not ttt.higher_is_better  # by name: no direction recorded
    assert ttt.loose_target == pytest.approx(1.53)
    swarm = ttt.systems["swarm"]
    # Mean over peers: 2.1, 1.51 (past the loose target only), 1.425.
    assert (swarm.step, swarm.seconds) == (150, 3.1)
    assert (swarm.loose_step, swarm.loose_seconds) == (100, 2.2)
    assert ttt.systems["ddp"].loose_seconds == 20.0
    assert ttt.systems["powersgd"].seconds is None

    slow = [proc([(50, 1.0, 2.0)], (3.0, 1.7), "loss"), proc([(50, 1.0, 2.1)], (3.0, 1.6), "loss")]
    ttt = time_to_target(report_of("loss", slow, {"ddp": ddp}))
    assert ttt is not None and ttt.systems["swarm"] == SystemTime()
    assert ttt.speedup == {"ddp": None}


def test_recorded_direction_wins_over_the_name() -> None:
    report = accuracy_report()
    report.baselines["ddp"].higher_is_better = False  # e.g. an "accuracy" that is an error
    ttt = time_to_target(report)
    # Lower is better now: DDP's 0.70 at step 50 is already at or under its final 0.95.
    assert ttt is not None and not ttt.higher_is_better and ttt.systems["ddp"].step == 50


def test_no_ddp_no_target() -> None:
    report = accuracy_report()
    del report.baselines["ddp"]
    assert time_to_target(report) is None
    assert "Time to DDP" not in markdown(report)


def test_an_old_report_without_timed_evals_still_redraws(tmp_path: Path) -> None:
    report = accuracy_report().model_dump(mode="json")
    for entry in [*report["swarm"]["peers"], *report["baselines"].values()]:
        del entry["final_seconds"]
        for e in entry["evals"]:
            del e["seconds"]
    # Written by an older runner: keys this version does not know are kept, not refused.
    report["swarm"]["peers"][0]["legacy_key"] = 1
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert cli.main(["--report", str(tmp_path)]) == 0
    assert png_size(tmp_path / "loss_vs_step.png")[0] >= 400
    assert not (tmp_path / "metric_vs_time.png").exists()
    assert not (tmp_path / "consensus_vs_step.png").exists()
    redrawn = load_report(tmp_path)
    # DDP's final is known; nobody's times are.
    assert redrawn.time_to_target is not None
    assert redrawn.time_to_target.systems["ddp"].seconds is None
    assert (redrawn.swarm.peers[0].model_extra or {})["legacy_key"] == 1
    assert "metric_vs_time.png" not in (tmp_path / "summary.md").read_text()


def test_timed_report_draws_metric_and_consensus_plots(tmp_path: Path) -> None:
    report = accuracy_report()
    for p in report.swarm.peers:
        p.history = [Sample(step=s, loss=1.0, sent_bytes=s, seconds=s / 10,
                            consensus_distance=1e-2 / s) for s in range(1, 30)]  # fmt: skip
    write_outputs(tmp_path, report)
    for name in ("metric_vs_time.png", "consensus_vs_step.png"):
        w, h = png_size(tmp_path / name)
        assert w >= 400 and h >= 200 and (tmp_path / name).stat().st_size > 5000
    assert "![metric_vs_time.png](metric_vs_time.png)" in (tmp_path / "summary.md").read_text()
