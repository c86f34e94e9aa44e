"""The loss-vs-bytes figure across runs: one point per system and run that finished, from
report.json files and points given by hand, drawn as a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
from gossipgrad.experiment import plots
from gossipgrad.experiment.plots import BytesPoint, system_points
from gossipgrad.experiment.records import Report
from gossipgrad.experiment.report import save_report
from support.experiment import png_size

pytestmark = pytest.mark.timeout(120)


def run_report(algorithm: str | None, h: int, losses: list[float], sent: float,
               baselines: dict[str, dict]) -> Report:  # fmt: skip
    """A finished run: peers with these final losses, ``sent`` bytes per peer on the mean."""
    peers = [{"id": f"peer{i}", "final": {"loss": v}, "metric": "loss"}
             for i, v in enumerate(losses)]  # fmt: skip
    gossip = {"algorithm": algorithm} if algorithm else {}
    return Report.model_validate({
        "name": "hand", "task": "shakespeare", "peers": len(peers), "mode": "local",
        "seed": 0, "steps": 100, "batch_size": 8, "local_steps": h,
        "spec": {"peer_raw": {"gossip": gossip}},
        "swarm": {"metric": "loss", "peers": peers, "mean_sent_bytes": sent},
        "baselines": baselines,
    })  # fmt: skip


def baseline(loss: float | None, sent: float, h: int | None = None) -> dict:
    final = None if loss is None else {"loss": loss}
    return {"final": final, "metric": "loss", "mean_sent_bytes": sent, "local_steps": h}


def test_one_point_per_finished_system_and_run(tmp_path: Path) -> None:
    h10 = run_report("exact-diloco", 10, [1.6, 1.8], 2e7, {
        "ddp": baseline(1.4, 6e9), "diloco-int8": baseline(1.5, 1.5e8, h=10),
        "powersgd": baseline(None, 1e8),  # failed: no point
    })  # fmt: skip
    h100 = run_report(None, 100, [2.0, 2.0], 2e6, {})  # the default algorithm
    assert system_points(h10) == [
        BytesPoint("exact-diloco", "exact-diloco H=10", 2e7, pytest.approx(1.7)),
        BytesPoint("ddp", "ddp", 6e9, 1.4),
        BytesPoint("diloco-int8", "diloco-int8 H=10", 1.5e8, 1.5),
    ]
    assert [(p.family, p.label) for p in system_points(h100)] == [("choco", "choco H=100")]

    runs = []
    for name, report in (("h10", h10), ("h100", h100)):
        (tmp_path / name).mkdir()
        save_report(tmp_path / name, report)
        runs.append(str(tmp_path / name))
    out = tmp_path / "bytes.png"
    extra = ["diloco-int8/diloco-int8 H=100=1.5e7:1.61", "ddp=6.1e9:1.41"]
    assert plots.main([*runs, "--out", str(out), *(f"--point={p}" for p in extra)]) == 0
    w, h = png_size(out)
    assert w >= 400 and h >= 200 and out.stat().st_size > 5000


def test_every_point_is_drawn_and_a_bad_point_is_refused(tmp_path: Path) -> None:
    points = [BytesPoint("a", "a H=10", 1e6, 1.0), BytesPoint("a", "a H=30", 3e5, 1.2),
              BytesPoint("b", "b", 1e9, 0.9)]  # fmt: skip
    assert plots.bytes_plot(points, tmp_path / "p.png", "t", "loss") == 3
    with pytest.raises(SystemExit):
        plots.main(["--out", str(tmp_path / "q.png"), "--point", "ddp=6e9"])
    with pytest.raises(SystemExit):  # nothing to draw
        plots.main(["--out", str(tmp_path / "q.png")])


def test_loss_of_a_classification_run_on_request(tmp_path: Path) -> None:
    """A classification run's headline is accuracy; ``--metric loss`` draws its test loss."""
    finals = [{"accuracy": 0.90, "loss": 0.26}, {"accuracy": 0.92, "loss": 0.24}]
    report = Report.model_validate({
        "name": "cnn", "task": "fashion-mnist-cnn", "peers": 2, "mode": "local", "seed": 0,
        "steps": 100, "batch_size": 8, "local_steps": 10,
        "spec": {"peer_raw": {"gossip": {"algorithm": "exact-diloco"}}},
        "swarm": {"metric": "accuracy", "mean_sent_bytes": 7e6,
                  "peers": [{"id": f"peer{i}", "final": f, "metric": "accuracy"}
                            for i, f in enumerate(finals)]},
        "baselines": {"ddp": {"final": {"accuracy": 0.915, "loss": 0.243},
                              "metric": "accuracy", "mean_sent_bytes": 1.5e9}},
    })  # fmt: skip
    assert [p.value for p in system_points(report)] == [pytest.approx(0.91), 0.915]
    assert [p.value for p in system_points(report, "loss")] == [pytest.approx(0.25), 0.243]
    (tmp_path / "run").mkdir()
    save_report(tmp_path / "run", report)
    out = tmp_path / "loss.png"
    assert plots.main([str(tmp_path / "run"), "--out", str(out), "--metric", "loss"]) == 0
    assert out.stat().st_size > 5000
