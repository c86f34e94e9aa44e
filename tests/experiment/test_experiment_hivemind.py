"""The hivemind baseline end to end, local mode: the CLI runs a tiny swarm (digits, 2 peers,
30 steps) and then ``baselines.run = ["hivemind"]``: two hivemind.Optimizer ranks on
127.0.0.1 in the ``.venv-hivemind`` environment, which must reach the step count, learn the
task, evaluate on schedule, count their p2p bytes and leave no process behind. Skipped where
that environment does not exist (``scripts/setup.sh --hivemind`` creates it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gossipgrad.experiment.baselines import HIVEMIND_VENV
from gossipgrad.experiment.report import load_report
from gossipgrad.experiment.spec import SpecError, parse_spec
from support import ROOT
from support.experiment import processes_mentioning

pytestmark = pytest.mark.timeout(540)

SPEC = ROOT / "scripts" / "experiments" / "digits-small.toml"
HAVE_HIVEMIND = (HIVEMIND_VENV / "bin" / "python").exists()
SUBREAPER = ROOT / "tests" / "support" / "subreaper.py"


def test_missing_hivemind_venv_is_a_spec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOSSIPGRAD_HIVEMIND_PYTHON", "/nonexistent/bin/python")
    with pytest.raises(SpecError, match=r"setup\.sh --hivemind"):
        parse_spec({"baselines": {"run": ["ddp", "hivemind"]}})


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_HIVEMIND, reason="no .venv-hivemind: scripts/setup.sh --hivemind")
def test_hivemind_baseline_end_to_end(tmp_path: Path) -> None:
    out, orphans = tmp_path / "run", tmp_path / "orphans.json"
    # Under a subreaper: whatever a rank leaves behind (a p2p daemon, a DHT process, running
    # or a zombie) is adopted by it rather than by init (which may reap zombies late), listed.
    # 50 s alone here, 80 s beside two swarm test files; one CI run reached only epoch 29 of
    # 30 in 240 s (its gradient averager then ran hivemind's default 3-s request timeout
    # against a 0.5-s matchmaking window), hence 420 s.
    proc = subprocess.run(
        [sys.executable, str(SUBREAPER), str(orphans), "--",
         sys.executable, "-m", "gossipgrad.experiment", str(SPEC), "--out", str(out),
         "--no-live", "--set", "experiment.peers=2", "--set", "train.steps=30",
         "--set", "train.eval_every=10", "--set", "experiment.timeout=420",
         "--set", 'baselines.run=["hivemind"]'],
        capture_output=True, text=True, timeout=520, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert processes_mentioning(str(out)) == []
    left = json.loads(orphans.read_text())
    assert left["running"] == [], "a rank left hivemind's processes running"
    # Each rank ends its DHT, averagers and p2p daemons and reaps them, zombies included. Only
    # torch's shared-memory manager (hivemind shares tensors by file) outlives its rank, by
    # design: in a session of its own, it unlinks the segments and exits after its last client.
    # On failure: the ranks' pids and process groups, their teardown, and the runner's view.
    ranks = "\n".join(
        line
        for log in sorted((out / "baselines" / "hivemind").glob("rank*.log"))
        for line in log.read_text().splitlines()
        if "process group" in line or "ended its processes" in line
    )
    assert [a for a in left["adopted"] if not a.startswith("torch_shm_manag")] == [], (
        f"{left}\n{ranks}\n{proc.stderr[-3000:]}"
    )
    # Both averagers got the loopback settings: hivemind warns of a request timeout that is not
    # below the matchmaking window (matchmaking can deadlock), once per averager given one.
    for log in (out / "baselines" / "hivemind").glob("rank*.log"):
        assert "request_timeout smaller than min_matchmaking_time" not in log.read_text(), log
    report = load_report(out)
    assert report.ok and list(report.baselines) == ["hivemind"]

    hm = report.baselines["hivemind"]
    extra = hm.model_extra or {}  # hivemind's own figures: not declared, kept as they came
    assert hm.ok and len(hm.ranks) == 2 and hm.steps == 30
    assert hm.metric == "accuracy" and hm.higher_is_better
    # 30 steps of hivemind's asynchronous averaging learn the 10 digits to 0.27-0.7 (0.27, 0.41
    # and 0.53 in three CI runs): twice chance says it learned, without betting on how far.
    assert (hm.final or {})["accuracy"] > 0.2 and (hm.wall_seconds or 0) > 0
    # Global steps are hivemind epochs: each took at least one batch from every rank, and
    # most of them averaged gradients across both ranks.
    assert all(b >= 30 for b in extra["local_batches"])
    assert all(r > 15 for r in extra["grad_averaging_rounds"])
    # One evaluation each time the epoch passes a multiple of eval_every: an epoch can move
    # by more than one (a rank that fell behind catches up), so at the first epoch past it.
    first, second = (e["step"] for e in hm.evals)
    assert 10 <= first < 20 <= second < 30
    secs = [e["seconds"] for e in hm.evals]
    assert 0 < secs[0] < secs[1] < (hm.final_seconds or 0) <= (hm.wall_seconds or 0)
    # Bytes from the p2p daemons' sockets: what one rank sends, the other receives, up to
    # the sampling (`ss` every second; each rank reads its last sample at its own moment, and
    # a connection's bytes after its last sample are not seen): 5.4% apart in one loaded CI
    # run, 13% in another: rank 1's samples missed about 0.75 MB each way that rank 0's saw (a
    # connection opened and closed between two of its samples), while each rank's own sent and
    # received agreed within 0.2%. A wrong socket or a double count is off by far more.
    r0, r1 = hm.ranks
    assert r0 is not None and r1 is not None
    # Compute utilization as for every system: training time not spent in hivemind's
    # optimizer step, per rank, and their mean in the baseline's figures and the summary.
    for rank in (r0, r1):
        assert 0 < (rank.communication_seconds or 0) < (rank.wall_seconds or 0)
        assert rank.compute_utilization == pytest.approx(
            1 - rank.communication_seconds / rank.wall_seconds, rel=1e-6
        )
    assert hm.compute_utilization == pytest.approx(
        (r0.compute_utilization + r1.compute_utilization) / 2, rel=1e-6
    )
    summary = (out / "summary.md").read_text()
    assert f"| {hm.compute_utilization:.2f} |" in summary, summary
    assert (r0.sent_bytes or 0) > 0
    assert r0.sent_bytes == pytest.approx(r1.received_bytes, rel=0.25)
    assert (hm.mean_sent_bytes or 0) > 0
