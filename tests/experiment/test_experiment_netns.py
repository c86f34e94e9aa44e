"""netns mode: real namespaces, veth links and qdiscs (root and iproute2, else skipped).

Shows the shaping is real (a transfer over a 10 mbit link takes the time the rate implies),
runs a 3-peer swarm and the DDP baseline over shaped links, and checks that no namespace or
process survives a run, a SIGTERM, or a runner that died.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gossipgrad.experiment import netns
from gossipgrad.experiment.nat import nat_unavailable
from gossipgrad.experiment.report import load_report
from gossipgrad.experiment.spec import NetworkSection
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from support import ROOT
from support.experiment import processes_mentioning

SPEC = ROOT / "scripts" / "experiments" / "digits-small.toml"

pytestmark = pytest.mark.skipif(
    netns.available() is not None, reason=f"netns mode unavailable: {netns.available()}"
)

RECEIVER = """
import socket, sys, time
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
n, t0 = 0, None
while True:
    b = conn.recv(1 << 16)
    if t0 is None:
        t0 = time.monotonic()
    if not b:
        break
    n += len(b)
print(n, time.monotonic() - t0, flush=True)
"""
SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.sendall(b"x" * int(sys.argv[3]))
s.close()
"""


def ours(prefix: str) -> list[str]:
    return [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]


def transfer_seconds(lab: netns.NetnsLab, nbytes: int) -> float:
    """Seconds site 1 takes to receive ``nbytes`` sent by site 0 over TCP."""
    rx = subprocess.Popen(
        [*lab.exec_prefix(1), sys.executable, "-c", RECEIVER, lab.address(1)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = rx.stdout.readline().strip()
        subprocess.run(
            [*lab.exec_prefix(0), sys.executable, "-c", SENDER, lab.address(1), port, str(nbytes)],
            check=True, timeout=60,
        )  # fmt: skip
        got, seconds = rx.stdout.readline().split()
        assert int(got) == nbytes
        return float(seconds)
    finally:
        rx.kill()
        rx.wait()


@pytest.mark.timeout(120)
def test_shaped_link_takes_the_time_the_rate_implies() -> None:
    nbytes = 1_250_000  # 10 Mbit: one second at 10 mbit/s
    with netns.NetnsLab(2, NetworkSection(rate="10mbit")) as lab:
        prefix = lab.prefix
        assert len(ours(prefix)) == 3
        shaped = transfer_seconds(lab, nbytes)
    assert ours(prefix) == []
    with netns.NetnsLab(2) as lab:
        unshaped = transfer_seconds(lab, nbytes)
    print(f"1.25 MB: {shaped:.3f}s over 10 mbit, {unshaped:.3f}s unshaped")
    assert shaped >= 0.9 * nbytes * 8 / 10e6
    assert shaped < 3.0  # and the link does carry it at about that rate
    assert unshaped < shaped / 3


@pytest.mark.timeout(120)
def test_delay_is_applied_by_netem_or_else_tun_links() -> None:
    lab = netns.NetnsLab(2, NetworkSection(delay="50ms")).up()
    try:
        # netem where the kernel has it, else TUN links through the user-space switch.
        assert (lab.switch is None) == netns.netem_supported(lab.hub, "br0")
        t0 = time.monotonic()
        transfer_seconds(lab, 1000)  # handshake + data: several one-way delays
        assert time.monotonic() - t0 >= 0.1
    finally:
        lab.down()
    assert ours(lab.prefix) == []


@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_runners_are_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"gg{dead.pid}xbeef-p0"
    live = netns.NetnsLab(1)  # our own pid: alive, must survive
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live.ns(0)], check=True)
    try:
        removed = netns.cleanup_stale()
        assert stale in removed and live.ns(0) not in removed
        assert stale not in netns.list_namespaces()
        assert live.ns(0) in netns.list_namespaces()
    finally:
        netns.delete_namespace(stale)
        netns.delete_namespace(live.ns(0))


def run_cli(out: Path, *sets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gossipgrad.experiment", str(SPEC), "--out", str(out)]
    cmd += ["--no-live", "--set", "experiment.mode=netns", "--set", "experiment.peers=3"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_netns_experiment_three_peers_over_shaped_links(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(
        out,
        "network.rate=50mbit",
        'network.links=[{a = 0, b = 1, rate = "5mbit"}]',
        "train.steps=100",
        "baselines.run=['ddp']",
        "experiment.timeout=200",
    )
    output, _ = proc.communicate(timeout=270)
    assert proc.returncode == 0, output[-4000:]
    report = load_report(out)
    assert report.mode == "netns" and report.ok and report.namespaces
    assert ours(report.namespaces) == []
    assert processes_mentioning(str(out)) == []
    swarm = report.swarm
    for i, p in enumerate(swarm.peers):
        assert p.ok and p.steps == 100 and (p.final or {})["accuracy"] > 0.7
        status = read_record(out / "swarm" / f"peer{i}" / "status.json", PeerStatus)
        assert status is not None and (status.address or "").startswith(f"198.18.0.{i + 1}:")
    # The kernel saw the gossip on every site's access link: at least what peers counted.
    links = swarm.link_bytes
    for i, p in enumerate(swarm.peers):
        assert links[f"peer{i} up"] >= 0.9 * p.sent_bytes > 0
    ddp = report.baselines["ddp"]
    assert ddp.ok and ddp.steps == 100 and (ddp.final or {})["accuracy"] > 0.7
    # The all-reduces crossed the shaped links too (kernel counters, headers included).
    assert all(ddp.link_bytes[f"peer{i} up"] > 0.5 * (ddp.mean_sent_bytes or 0) for i in range(3))


@pytest.mark.timeout(180)
def test_sigterm_stops_everything_and_removes_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(out, "train.steps=100000", "network.rate=100mbit")
    try:
        deadline = time.monotonic() + 150
        status = out / "swarm" / "peer2" / "status.json"
        while (read_record(status, PeerStatus) or PeerStatus()).step == 0:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "peers did not start training"
            time.sleep(0.5)
        prefix = f"gg{proc.pid}x"
        assert len(ours(prefix)) == 4  # hub + 3 sites
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-3000:]
    assert "namespaces removed" in output
    assert ours(prefix) == []
    assert processes_mentioning(str(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(280)
@pytest.mark.skipif(nat_unavailable() is not None, reason=str(nat_unavailable()))
def test_natted_sites_train_through_a_relay(tmp_path: Path) -> None:
    """network.natted = [1, 2]: both sites sit behind NATs of their own (new inbound
    connections dropped), so both are called through peer0, the only site anyone can dial;
    they find that out before waiting for the others (two unreachable peers would otherwise
    count each other absent until start_timeout, and peer0 would be done by then), train
    the same steps and mix with each other through the relay; the report names the relays,
    and the routers' namespaces are removed with the rest.

    Each NAT'd site spends two dial-back timeouts (about 10 s) learning that it is
    unreachable; its heartbeats say it is still checking, so peer0 does not count it among
    its expected peers until it is called through the relay. Without that, peer0 counted
    both from their first heartbeat, trained its 100 steps alone (about 6 s here) while
    they checked, and they took its final state and never mixed."""
    out = tmp_path / "run"
    proc = run_cli(
        out,
        "network.natted=[1, 2]",
        "train.steps=100",
        "baselines.run=[]",
        "experiment.timeout=200",
    )
    output, _ = proc.communicate(timeout=270)
    assert proc.returncode == 0, output[-4000:]
    report = load_report(out)
    assert report.mode == "netns" and report.ok and report.namespaces
    assert ours(report.namespaces) == []  # hub, sites and both routers
    assert processes_mentioning(str(out)) == []
    peers = report.swarm.peers
    assert [p.relay for p in peers] == ["", "peer0", "peer0"]
    for i, p in enumerate(peers):
        assert p.ok and p.steps == 100 and (p.final or {})["accuracy"] > 0.7, i
    for i in (1, 2):
        status = read_record(out / "swarm" / f"peer{i}" / "status.json", PeerStatus)
        assert status is not None and status.reachability is not None
        assert status.reachability.status == "unreachable", status.reachability
        assert status.address == f"198.18.0.{i + 1}:7000"  # its router's, where SYNs drop
        assert status.joined_at_step in (None, 0), status.joined_at_step  # trained from 0
    # The NAT'd sites mixed with both neighbours through the run, not from a state taken
    # at its end (a neighbour that finished first is counted as "(departed)"), and with
    # each other (neighbours on the ring) through the relay.
    summaries = [
        read_record(out / "swarm" / f"peer{i}" / "summary.json", PeerSummary) for i in (1, 2)
    ]
    for s in summaries:
        assert sum(s.exchanges.values()) >= 150, s.exchanges  # 2 neighbours, 100 rounds
    assert max(summaries[0].exchanges.get("peer2", 0), summaries[1].exchanges.get("peer1", 0))
