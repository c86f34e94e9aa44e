"""Network faults between real peer processes in network namespaces (see tests/support/netlab.py).

The peers listen on 198.18.0.x, which is not loopback, so they run with mutual TLS from a
swarm CA made for the test: the faults are exercised on the secure transport users get.

What must hold:

* partition into two halves, then healed: no peer crashes or hangs, both halves keep
  training while cut off, every peer sees all others again after healing, the local
  consensus distance comes back to its pre-partition level, and the final models are finite
  and in consensus;
* a slow peer (its process frozen most of the time, so every answer is late) and a
  flapping peer (link down and up every second): nobody blocks -- every peer keeps making
  progress; a slow neighbour paces its neighbours by design (bounded staleness) -- and the
  healthy peers' memory does not grow.
"""

from __future__ import annotations

import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.security import write_swarm_certs
from prometheus_client.parser import text_string_to_metric_families
from support.netlab import NetLab, netlab_unavailable
from support.waiting import wait_for

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(netlab_unavailable() is not None, reason=str(netlab_unavailable())),
]

METRICS_PORT = 9100
ALIVE_SUSPECT_DEAD = ("alive", "suspect", "dead")
BASE = {
    "train.task": "digits",
    "train.batch_size": "32",
    "train.eval_every": "0",
    "train.steps": "100000",  # stopped by the test (SIGTERM: finish the step, save, leave)
    "gossip.codec": "topk:0.05+int8",
    "gossip.gamma": "0.2",
    "gossip.topology": "ring",
    "metrics.enabled": "true",
    "metrics.port": str(METRICS_PORT),
    "membership.heartbeat_interval": "0.2",
    "membership.suspect_after": "1.5",
    "membership.dead_after": "3",
    "gossip.round_timeout": "2",
    "checkpoint.every": "0",
}

SCRAPE = (
    "import sys, urllib.request\n"
    "print(urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics', timeout=5)"
    ".read().decode())"
)


def scrape(lab: NetLab, i: int) -> dict[str, float]:
    """Unlabelled gauges plus peers{state} of peer i, read inside its namespace."""
    run = subprocess.run(
        [*lab.exec_prefix(i), sys.executable, "-c", SCRAPE, str(METRICS_PORT)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(run.stdout):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def steps(swarm: LocalSwarm) -> list[int]:
    return [s.step for s in swarm.statuses()]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture
def netswarm(tmp_path: Path):
    made: list[tuple[NetLab, LocalSwarm]] = []

    def make(groups: list[int]) -> tuple[NetLab, LocalSwarm]:
        lab = NetLab(groups)
        made.append((lab, None))  # type: ignore[arg-type]
        lab.up()
        n = len(groups)
        certs = write_swarm_certs(tmp_path / "certs", [f"peer{i}" for i in range(n)])

        def per_peer(i: int) -> dict[str, str]:
            return {
                "peer.listen": f"{lab.address(i)}:7000",
                "security.ca": str(certs.ca),
                "security.cert": str(certs.certs[f"peer{i}"]),
                "security.key": str(certs.keys[f"peer{i}"]),
            }

        swarm = LocalSwarm(
            tmp_path / "swarm",
            n,
            dict(BASE),
            command_prefix=lab.exec_prefix,
            peer_overrides=per_peer,
        )
        made[-1] = (lab, swarm)
        return lab, swarm

    try:
        yield make
    finally:
        for lab, swarm in made:
            try:
                if swarm is not None:
                    for p in swarm.procs.values():
                        if p.poll() is None:
                            p.send_signal(signal.SIGCONT)
                    swarm.stop(timeout=15)
            finally:
                lab.close()


def local_distance(lab: NetLab, n: int, samples: int = 5) -> float:
    """Median over a few seconds and all peers of gossipgrad_consensus_distance."""
    values = []
    for _ in range(samples):
        for i in range(n):
            v = scrape(lab, i).get("gossipgrad_consensus_distance")
            if v is not None:
                values.append(v)
        time.sleep(0.3)
    assert values and all(math.isfinite(v) for v in values), values
    return statistics.median(values)


def alive_seen(lab: NetLab, i: int) -> float:
    """Peers peer i counts as alive, itself included (-1: endpoint not up yet)."""
    return scrape(lab, i).get('gossipgrad_peers{state="alive"}', -1.0)


def view(lab: NetLab, i: int) -> tuple[float, float, float]:
    """Peer i's (alive, suspect, dead) counts, itself among the alive."""
    m = scrape(lab, i)
    return tuple(m.get(f'gossipgrad_peers{{state="{s}"}}', -1.0) for s in ALIVE_SUSPECT_DEAD)


def final_params(swarm: LocalSwarm) -> list[torch.Tensor]:
    files = [swarm.peer_dir(i) / "params.pt" for i in range(swarm.n)]
    assert all(f.exists() for f in files), "a peer did not write its final parameters"
    return [torch.load(f, weights_only=True) for f in files]


@pytest.mark.slow
def test_partition_then_heal_returns_to_consensus(netswarm) -> None:
    lab, swarm = netswarm([0, 0, 1, 1])
    swarm.start()
    wait_for(lambda: min(steps(swarm)) >= 150, 150, "all peers to reach step 150")
    wait_for(lambda: all(alive_seen(lab, i) == 4 for i in range(4)), 30, "full membership")
    before = local_distance(lab, 4)

    lab.partition()
    time.sleep(4)  # past dead_after: each half drops the other
    cut = steps(swarm)
    time.sleep(6)
    during = steps(swarm)
    assert swarm.failed() == [], "a peer crashed during the partition"
    for i in range(4):
        assert during[i] >= cut[i] + 50, f"peer{i} stalled while partitioned: {cut} -> {during}"
    # Each half has declared the other dead (10 s of silence > dead_after): two split views.
    wait_for(
        lambda: all(view(lab, i) == (2, 0, 2) for i in range(4)), 20, "each half to drop the other"
    )

    lab.heal()
    # One view again: everyone alive in every peer's table, nobody suspect or dead.
    wait_for(lambda: all(view(lab, i) == (4, 0, 0) for i in range(4)), 40, "the views to merge")
    time.sleep(8)  # resync the cut edges and mix
    after = local_distance(lab, 4)
    assert after <= 2.0 * before + 1e-3, (before, after)

    swarm.stop(timeout=30)
    assert swarm.failed() == [], "a peer failed to stop cleanly"
    params = final_params(swarm)
    assert all(torch.isfinite(p).all() for p in params)
    _, relative = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in range(4)])
    # Measured 6.2e-6 after the heal; digits peers that never mix end near 0.036 (the 4-peer
    # swarm test's control), so 1e-3 fails a swarm that stayed split or stopped gossiping.
    print(f"relative consensus distance after the heal {relative:.2e}")
    assert relative < 1e-3, relative


@pytest.mark.slow
def test_slow_and_flapping_peers_block_no_one_and_memory_stays_bounded(netswarm) -> None:
    lab, swarm = netswarm([0, 0, 0, 0])
    swarm.start()
    wait_for(lambda: min(steps(swarm)) >= 100, 150, "all peers to reach step 100")
    healthy = (0, 1)
    slow, flapping = 2, 3
    pids = {i: swarm.procs[i].pid for i in healthy}

    def pace(seconds: float) -> list[float]:
        s0 = steps(swarm)
        time.sleep(seconds)
        s1 = steps(swarm)
        return [(s1[i] - s0[i]) / seconds for i in healthy]

    baseline = pace(4)
    rss0 = {i: rss_kib(p) for i, p in pids.items()}
    slow_proc = swarm.procs[slow]
    t_end = time.monotonic() + 24
    t_mid = time.monotonic() + 8
    rss_mid: dict[int, int] = {}
    s_fault0 = steps(swarm)
    t_fault0 = time.monotonic()
    link_up = True
    while time.monotonic() < t_end:
        # The slow peer runs 0.25 s out of every 1.25 s; the flapping one changes link state
        # every second.
        slow_proc.send_signal(signal.SIGSTOP)
        lab.set_link(flapping, up=not link_up)
        link_up = not link_up
        time.sleep(1.0)
        slow_proc.send_signal(signal.SIGCONT)
        time.sleep(0.25)
        if not rss_mid and time.monotonic() > t_mid:
            rss_mid = {i: rss_kib(p) for i, p in pids.items()}
    lab.set_link(flapping, up=True)
    s_fault1 = steps(swarm)
    faulty_pace = [(s_fault1[i] - s_fault0[i]) / (time.monotonic() - t_fault0) for i in healthy]
    rss1 = {i: rss_kib(p) for i, p in pids.items()}
    assert swarm.failed() == []
    print(f"pace healthy peers: {baseline} steps/s before, {faulty_pace} during the faults")
    for i, f in zip(healthy, faulty_pace, strict=True):
        # Nobody blocks. By design a slow neighbour paces its neighbours (bounded staleness:
        # gossip.max_staleness rounds, each wait at most round_timeout), so the healthy
        # peers slow down -- but they never stop.
        assert f >= 1.0, f"peer{i} nearly stopped: {f:.2f} steps/s during the faults"
    for i in (slow, flapping):
        assert s_fault1[i] > s_fault0[i], f"peer{i} made no progress at all"
    for i in healthy:
        # Bounded memory: no growth in the second half of the faulty period beyond noise.
        assert rss1[i] - rss_mid[i] < 32 * 1024, (rss0[i], rss_mid[i], rss1[i])
    swarm.stop(timeout=30)
    assert swarm.failed() == []
    params = final_params(swarm)
    assert all(torch.isfinite(p).all() for p in params)
