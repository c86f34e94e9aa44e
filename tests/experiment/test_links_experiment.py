"""Runner level: a local 2-peer swarm whose links go through the relay emulator (40 ms RTT)
finishes, every gossip byte crosses the relays in both directions, the peers' own push
latency (Prometheus) shows the delay, and no process or relay port is left afterwards."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support.experiment import processes_mentioning

SPEC = """
[experiment]
name = "links-smoke"
peers = 2
mode = "local"
timeout = 240
sample_every = 0.25

[network]
delay = "10ms"   # per access link: site 0 -> site 1 is 10 + 10 ms one-way, 40 ms RTT

[train]
task = "digits"
steps = 40
batch_size = 32
lr = 0.05
eval_every = 40

[gossip]
codec = "topk:0.01+int8"
topology = "ring"

[membership]
heartbeat_interval = 0.2
suspect_after = 2.0
dead_after = 4.0

[checkpoint]
every = 0

[baselines]
run = []
"""
_PUSH = re.compile(r'^gossipgrad_push_duration_seconds_(sum|count)\{neighbor="[^"]*"\} (\S+)$')


def push_seconds(port: int) -> tuple[float, float]:
    """(sum, count) of a peer's push_duration_seconds over its neighbours."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        if m := _PUSH.match(line):
            total[m.group(1)] += float(m.group(2))
    return total["sum"], total["count"]


def stop_runner(proc: subprocess.Popen) -> None:
    """Interrupt a runner still running (it stops its peers and relays), then kill it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_swarm_over_relayed_40ms_links(tmp_path: Path) -> None:
    spec, out = tmp_path / "spec.toml", tmp_path / "run"
    spec.write_text(SPEC)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipgrad.experiment", str(spec), "--out", str(out), "--no-live"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    pushes: dict[int, tuple[float, float]] = {}
    try:
        while proc.poll() is None:
            for i in range(2):
                try:
                    status = json.loads((out / "swarm" / f"peer{i}" / "status.json").read_text())
                    got = push_seconds(int(status["metrics_port"]))
                except (OSError, ValueError, KeyError):
                    continue
                if got[1] >= pushes.get(i, (0.0, 0.0))[1]:
                    pushes[i] = got
            time.sleep(0.2)
        output = proc.stdout.read()
    finally:
        stop_runner(proc)
        proc.stdout.close()
    assert proc.returncode == 0, output[-3000:]
    assert processes_mentioning(str(out)) == []
    report = json.loads((out / "report.json").read_text())
    swarm = report["swarm"]
    assert swarm["ok"] and all(p["steps"] == 40 for p in swarm["peers"])

    links = swarm["link_emulator"]
    assert links["emulator"] == "relay" and set(links["relays"]) == {"0->1", "1->0"}
    # Each site's gossip to the other (updates, heartbeats, replies) crossed the relays.
    for name in ("0->1", "1->0"):
        assert links["paths"][name]["bytes"] > 5_000, links["paths"]
    sent = sum(p["sent_bytes"] for p in swarm["peers"])
    assert links["relayed_bytes"] >= sent  # gRPC framing on top of the peers' own counts
    assert 0 < links["cpu_seconds"] < swarm["elapsed_seconds"]
    for relay in links["relays"].values():
        host, port = relay["address"].rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()

    # A push is one round trip at least: 40 ms through the relays (a few ms on loopback).
    assert set(pushes) == {0, 1}, pushes
    for total, count in pushes.values():
        assert count > 0 and total / count >= 0.040, pushes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigint_to_the_runner_closes_every_relay(tmp_path: Path) -> None:
    spec, out = tmp_path / "spec.toml", tmp_path / "run"
    spec.write_text(SPEC.replace("steps = 40", "steps = 100000"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipgrad.experiment", str(spec), "--out", str(out), "--no-live"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 200  # peers import torch first: slow on a loaded box
        while time.monotonic() < deadline:
            try:
                states = [
                    json.loads((out / "swarm" / f"peer{i}" / "status.json").read_text())["state"]
                    for i in range(2)
                ]
            except (OSError, ValueError, KeyError):
                states = []
            if states == ["training", "training"]:
                break
            time.sleep(0.2)
        assert states == ["training", "training"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        stop_runner(proc)
    assert processes_mentioning(str(out)) == []
    # The relay addresses each peer was told to dial (its command line) are closed now.
    commands = (out / "swarm" / "commands.sh").read_text()
    relays = set(re.findall(r"=127\.0\.0\.1:(\d+)", commands))
    assert len(relays) == 2, commands
    for port in relays:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
