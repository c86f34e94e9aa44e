"""Issue 45: sites behind a real NAT (network namespaces, nftables masquerade, new inbound
connections dropped) train through relays, under mutual TLS.

Four sites on a ring, peer2 and peer3 (neighbours of each other) each behind a NAT of its own
(tests/support/netlab.py): they advertise their routers' public addresses, where every new
inbound connection is dropped. Compared with the same swarm and seeds where nobody is behind
NAT.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from gossipgrad.peer.security import SwarmCertPaths, write_swarm_certs
from support.netlab import NetLab, netlab_unavailable
from support.swarms import BASE, served_states
from support.waiting import wait_for

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.skipif(
        netlab_unavailable(nat=True) is not None, reason=str(netlab_unavailable(nat=True))
    ),
]

STEPS = 400
# The swarm tests' daemon config, a fixed step count and no checkpoints.
CONFIG = {**BASE, "train.steps": str(STEPS), "checkpoint.every": "0"}
NATTED = {2, 3}


def site_keys(lab: NetLab, certs: SwarmCertPaths, i: int) -> dict[str, str]:
    """Site i's own keys: its address and certificate; behind NAT it listens inside and
    advertises what others would dial (its router's address)."""
    keys = {
        "peer.listen": f"{lab.address(i)}:7000",
        "security.ca": str(certs.ca),
        "security.cert": str(certs.certs[f"peer{i}"]),
        "security.key": str(certs.keys[f"peer{i}"]),
    }
    if i in lab.natted:
        keys["peer.listen"] = f"{lab.private_address(i)}:7000"
        keys["peer.advertise"] = f"{lab.address(i)}:7000"
    return keys


@contextlib.contextmanager
def lab_running(lab: NetLab, swarm: LocalSwarm) -> Iterator[None]:
    """The lab's namespaces up for the block; after it every peer still running is killed
    and the namespaces deleted."""
    try:
        lab.up()
        yield
    finally:
        for p in swarm.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        swarm.stop(timeout=15)
        lab.close()


def run_swarm(tmp_path: Path, natted: set[int]) -> tuple[LocalSwarm, float]:
    """The 4-site swarm to its end, ``natted`` behind NAT; the swarm and the relative
    consensus distance of its final models."""
    name = "nat" if natted else "open"
    lab = NetLab([0, 0, 0, 0], natted=natted)
    certs = write_swarm_certs(tmp_path / f"certs-{name}", [f"peer{i}" for i in range(4)])

    swarm = LocalSwarm(
        tmp_path / name,
        4,
        CONFIG,
        command_prefix=lab.exec_prefix,
        peer_overrides=lambda i: site_keys(lab, certs, i),
    )
    with lab_running(lab, swarm):
        swarm.start()
        assert swarm.wait(300), f"{name} swarm did not finish"
        assert swarm.failed() == [], name
    cd = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in range(4)])
    assert cd is not None
    return swarm, cd[1]


@pytest.mark.slow
def test_two_sites_behind_nat_train_through_relays_like_the_open_swarm(tmp_path: Path) -> None:
    """Both NAT'd sites are found unreachable (timed_out), are called through peer0 or peer1,
    mix with each other, and the swarm ends within 2x of the open swarm's consensus distance
    (with peer.relay = "off" they trained alone: 1.4e-2 against 2.0e-5)."""
    nat, nat_distance = run_swarm(tmp_path, NATTED)
    _, open_distance = run_swarm(tmp_path, set())
    print(f"relative consensus distance: {nat_distance:.3e} behind NAT, {open_distance:.3e} open")
    for i in NATTED:
        status = read_record(nat.peer_dir(i) / "status.json", PeerStatus)
        assert status is not None and status.reachability is not None
        assert (status.reachability.status, status.reachability.cause) == (
            "unreachable",
            "timed_out",
        )
        assert status.relay in ("peer0", "peer1"), status.relay
    summaries = [read_record(nat.peer_dir(i) / "summary.json", PeerSummary) for i in range(4)]
    assert all(s is not None and s.steps == STEPS for s in summaries)
    # The two NAT'd sites mixed with each other (the one that finished first left: the other
    # counts it under "(departed)").
    assert max(summaries[2].exchanges.get("peer3", 0), summaries[3].exchanges.get("peer2", 0))
    assert nat_distance <= 2 * open_distance


@pytest.mark.slow
def test_behind_nat_a_killed_relay_is_replaced_and_a_natted_joiner_trains(tmp_path: Path) -> None:
    """Real NAT: peer2 and peer3 behind NATs of their own attach to peer0 or peer1; the relay
    peer2 uses is SIGKILLed mid-run, and both are called through the other open peer within
    a few heartbeat intervals. Then peer4, behind a NAT of its own too, joins the running
    swarm: it finds itself unreachable, attaches to the open peer, takes a donor's state and
    trains to the end with the survivors, and all of them end together."""
    natted = {2, 3, 4}
    lab = NetLab([0] * 5, natted=natted)
    certs = write_swarm_certs(tmp_path / "certs", [f"peer{i}" for i in range(5)])
    steps = 1200
    interval = float(BASE["membership.heartbeat_interval"])

    swarm = LocalSwarm(
        tmp_path / "swarm",
        4,
        {**CONFIG, "train.steps": str(steps)},
        command_prefix=lab.exec_prefix,
        peer_overrides=lambda i: site_keys(lab, certs, i),
    )

    def relay_of(i: int) -> str:
        status = read_record(swarm.peer_dir(i) / "status.json", PeerStatus)
        return status.relay if status is not None and status.relay else ""

    with lab_running(lab, swarm):
        swarm.start()
        wait_for(lambda: relay_of(2) and relay_of(3) and swarm.status(2).step >= 100, 150, "relays")
        victim = int(relay_of(2).removeprefix("peer"))
        assert victim in (0, 1)
        other = 1 - victim
        moved = [i for i in (2, 3) if relay_of(i) == f"peer{victim}"]
        swarm.kill(victim)
        killed_at = time.monotonic()
        wait_for(lambda: all(relay_of(i) == f"peer{other}" for i in moved), 30, "a new relay")
        took = time.monotonic() - killed_at
        print(f"relay replaced {took:.2f}s after the kill ({took / interval:.1f} intervals)")
        assert took < 5 * interval + 1.0
        # The joiner, behind its NAT, bootstraps from the open survivor.
        swarm.spawn(4, bootstrap=swarm.address(other), extra={"peer.expected_peers": "1"})
        assert swarm.wait(300), "the swarm did not finish"
        assert swarm.failed() == [victim]
    finishers = [i for i in range(5) if i != victim]
    summaries = {i: read_record(swarm.peer_dir(i) / "summary.json", PeerSummary) for i in finishers}
    assert all(s is not None and s.steps == steps for s in summaries.values()), summaries
    joiner = read_record(swarm.peer_dir(4) / "status.json", PeerStatus)
    assert joiner is not None and joiner.reachability is not None
    assert (joiner.reachability.status, joiner.reachability.cause) == ("unreachable", "timed_out")
    assert joiner.relay == f"peer{other}"
    served = {i: served_states(swarm, range(i, i + 1)) for i in finishers if i != 4}
    donors = {digest: i for i, states in served.items() for _, digest in states}
    assert joiner.start_step and joiner.start_params in donors, (joiner, donors)
    print(f"peer4 took peer{donors[joiner.start_params]}'s state at step {joiner.start_step}")
    cd = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in finishers])
    assert cd is not None
    print(f"relative consensus distance of the finishers {cd[1]:.3e}")
    assert cd[1] < 1e-3
