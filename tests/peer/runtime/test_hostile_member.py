"""A hostile member process with a valid certificate against a live swarm (issue 40).

Three honest peer processes train over mutual TLS on 127.0.0.1 while a fourth process holding
certificates of the same CA (``support/hostile_member.py``: members ``evil`` and ``evil2``,
and a ``watcher``) tries, for 20 s, what issue 40 lists: forged departures, moves and restarts
of every honest peer in its peer lists, invented peers and a takeover at its own server,
calls that never send their request, state downloads cancelled after their header, peer
lists over the limit, and a step far ahead of the swarm's. A second watcher (``watcher2``)
times the honest peers' heartbeat answers from a process of its own.

What must hold: the honest peers finish every step; no honest peer's table ever holds
another honest peer dead or elsewhere than it says; every heartbeat the second watcher sends
is answered, within ``membership.heartbeat_timeout`` (on a host too loaded for the swarm
without the attacker to answer in it, within twice that swarm's slowest answer) but for one
in twenty, and all before ``membership.suspect_after``; nothing
reaches the hostile server; the honest peers count what they refused (``unauthenticated``: a
dial of an invented or taken-over id met the hostile server's certificate; ``rate_limited``:
calls over the hostile members' limits; ``too_large``: the peer lists over the limit); and
they end as close together (final consensus distance within 2x) and as accurate (within 2
points) as the same swarm run without the attacker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import urlopen

import pytest
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.experiment.swarm import summarize
from gossipgrad.peer.config import build_config
from gossipgrad.peer.records import PeerSummary, read_record
from gossipgrad.peer.security import write_swarm_certs
from support import TESTS
from support.swarms import BASE

N = 3
STEPS = 2500  # about a minute on two loaded cores: the attack (20 s) ends well before
ATTACK_S = 20.0


def rejected(metrics_port: int) -> dict[str, float]:
    """gossipgrad_rejected_updates_total by reason, scraped from a peer's endpoint."""
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("gossipgrad_rejected_updates_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def honest_swarm(out: Path, certs) -> LocalSwarm:
    """The three honest peers, each with its own certificate and a metrics endpoint."""
    overrides = {
        **BASE,
        "train.steps": str(STEPS),
        "metrics.enabled": "true",
        "metrics.host": "127.0.0.1",
        "metrics.port": "0",
        "security.ca": str(certs.ca),
    }
    return LocalSwarm(
        out,
        N,
        overrides,
        peer_overrides=lambda i: {
            "security.cert": str(certs.certs[f"peer{i}"]),
            "security.key": str(certs.keys[f"peer{i}"]),
        },
    )


def finished(swarm: LocalSwarm) -> list[PeerSummary]:
    """Every honest peer's summary, once each took all its steps."""
    summaries = [read_record(swarm.peer_dir(i) / "summary.json", PeerSummary) for i in range(N)]
    for s in summaries:
        assert s is not None and s.steps == STEPS and not s.stopped_early, s
    return summaries


def consensus(swarm: LocalSwarm) -> float:
    """How far apart the peers' final models are: (1/n) sum ||x_i - mean||^2 over
    ||mean||^2, from their params.pt."""
    return summarize(swarm)["relative_consensus_distance"]


def members_process(
    swarm: LocalSwarm, certs, report_path: Path, *extra: str
) -> tuple[list[str], Path]:
    """The argv of a hostile members' process against ``swarm`` for ``ATTACK_S``, and where
    it writes its report."""
    args = {
        "bootstrap": swarm.bootstrap,
        "swarm": build_config({}, BASE).peer.swarm,
        "certs": str(certs.ca.parent),
        "seconds": str(ATTACK_S),
        "out": str(report_path),
    }
    argv = [sys.executable, str(TESTS / "support" / "hostile_member.py")]
    argv += [part for key, value in args.items() for part in (f"--{key}", value)]
    return [*argv, *extra], report_path


def report_of(ended: subprocess.CompletedProcess, report_path: Path) -> dict:
    """A members' process's report; its last steps and errors if it failed."""
    if ended.returncode != 0:
        progress = Path(f"{report_path}.progress")
        steps = progress.read_text().splitlines()[-15:] if progress.exists() else []
        raise AssertionError(
            "a hostile members' process failed; its last steps:\n"
            + "\n".join(steps)
            + "\n"
            + ended.stderr[-3000:]
        )
    return json.loads(report_path.read_text())


def run_members(swarm: LocalSwarm, certs, out: Path, attack: bool) -> tuple[dict, dict | None]:
    """Once every honest peer has taken 5 steps, for ``ATTACK_S``: a watcher of its own
    (``watcher2``, in a process of its own, so that its timings are the honest peers'
    answers and not the attack's threads competing for the timing process), and with
    ``attack`` the hostile members' process. Their reports (the attack's None without)."""
    deadline = time.monotonic() + 120
    while not all(swarm.status(i).step >= 5 for i in range(N)):
        assert time.monotonic() < deadline and not swarm.failed(), "the swarm did not start"
        time.sleep(0.2)
    argv, watch_path = members_process(
        swarm, certs, out / "watch.json", "--watch-only", "--watcher", "watcher2"
    )
    watcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        attacked = None
        if attack:
            argv, attack_path = members_process(swarm, certs, out / "hostile.json")
            ended = subprocess.run(argv, capture_output=True, text=True, timeout=ATTACK_S + 120)
            attacked = report_of(ended, attack_path)
        stdout, stderr = watcher.communicate(timeout=ATTACK_S + 120)
    finally:
        watcher.kill()
        watcher.wait()
    watched = report_of(subprocess.CompletedProcess(argv, watcher.returncode, stdout, stderr),
                        watch_path)  # fmt: skip
    return watched, attacked


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hostile_member_cannot_take_out_an_honest_swarm(tmp_path: Path) -> None:
    members = [*(f"peer{i}" for i in range(N)), "evil", "evil2", "watcher", "watcher2"]
    certs = write_swarm_certs(tmp_path / "certs", members)
    # The same run without the attacker, watched alike: the consensus and the heartbeat
    # answers to compare with.
    calm = honest_swarm(tmp_path / "calm", certs)
    try:
        calm.start()
        (tmp_path / "calm-members").mkdir()
        calm_watched, _ = run_members(calm, certs, tmp_path / "calm-members", attack=False)
        assert calm.wait(300), "the swarm did not finish without the attacker"
        assert calm.failed() == []
    finally:
        calm.stop(timeout=10)
    swarm = honest_swarm(tmp_path / "attacked", certs)
    try:
        swarm.start()
        (tmp_path / "members").mkdir()
        watched, report = run_members(swarm, certs, tmp_path / "members", attack=True)
        assert all(swarm.alive(i) for i in range(N)), "an honest peer ended under attack"
        counted = [rejected(swarm.status(i).metrics_port) for i in range(N)]
        assert swarm.wait(300), "the honest swarm did not finish"
        assert swarm.failed() == []
    finally:
        swarm.stop(timeout=10)
    print(json.dumps({k: v for k, v in report.items() if k != "latencies"}, indent=1))
    print("rejected by reason:", counted)
    assert report["honest"] == watched["honest"] == [f"peer{i}" for i in range(N)]
    assert report["checked"] >= 10 and watched["checked"] >= 10, (report, watched)
    assert report["violations"] == watched["violations"] == [], report["violations"][:10]
    # Every heartbeat the second watcher sent under attack was answered; within the
    # heartbeat timeout, or on a host too loaded for the swarm without the attacker to
    # answer in it (the suite's other workers), within twice that swarm's slowest answer;
    # one in twenty may be later (the host's load comes and goes), none later than
    # suspect_after, the silence after which a peer is suspected.
    assert watched["errors"] == {}, watched["errors"]
    timeout = max(float(BASE["membership.heartbeat_interval"]), 1.0)  # heartbeat_timeout
    bound = max(timeout, 2 * max(calm_watched["latencies"]))
    latencies = watched["latencies"]
    late = [t for t in latencies if t >= bound]
    print("heartbeat answers under attack", sorted(latencies)[-5:], "bound", bound)
    assert len(latencies) >= 30 and len(late) <= len(latencies) // 20, (late, bound)
    assert max(latencies) < float(BASE["membership.suspect_after"]), max(latencies)
    assert report["impersonator_calls"] == 0  # nobody talked to it as an honest peer
    for i, reasons in enumerate(counted):
        assert reasons.get("unauthenticated", 0) > 0, (i, reasons)
        assert reasons.get("rate_limited", 0) > 0, (i, reasons)
        assert reasons.get("too_large", 0) > 0, (i, reasons)
    attacked, baseline = finished(swarm), finished(calm)
    print("consensus attacked", consensus(swarm), "without", consensus(calm))
    print("accuracy attacked", [s.final for s in attacked], "without", [s.final for s in baseline])
    assert consensus(swarm) <= 2 * consensus(calm)
    for hit, calm_run in zip(attacked, baseline, strict=True):
        assert hit.final["accuracy"] >= calm_run.final["accuracy"] - 0.02, (hit, calm_run)
