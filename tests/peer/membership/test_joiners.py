"""Joining a running swarm: donors that do not stampede, bootstrap lists retried, clear errors.

In-process peers on 127.0.0.1:0 for the donor laws (order, busy, rate limit); real
``python -m gossipgrad.peer`` processes for the daemon's join path (two joiners at once, a
dead first bootstrap address, only dead bootstrap addresses).
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.config import ConfigError, build_config
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.network import PeerClient
from gossipgrad.peer.records import PeerStatus, read_record
from gossipgrad.peer.runtime.joining import (
    DONOR_NEAR_STEPS,
    DONOR_STEP_SLACK,
    JoinError,
    donor_order,
    find_swarm,
)
from gossipgrad.peer.runtime.node import Peer, transport_options
from gossipgrad.proto import gossip_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st
from support.peers import FAST_MEMBERSHIP, rejected, start_peer, started, wait_until_met
from support.swarms import BASE, served_states
from torch import nn

CHUNK = 4096


@contextlib.contextmanager
def dead_addresses(n: int) -> Iterator[list[str]]:
    """``n`` loopback addresses nobody listens on: ports bound (so no one else takes them)
    but not listening, so a connection is refused at once."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        yield [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


def start_donor(pid: str, bootstrap: list[str], step: int, blob: bytes, **overrides) -> Peer:
    """A peer serving ``blob`` as its state at ``step`` (same model as :func:`start_joiner`)."""
    torch.manual_seed(0)
    flat = FlatParameters(nn.Linear(16, 4))
    cfg = build_config(
        {},
        {
            "peer.id": pid,
            "peer.bootstrap": bootstrap,
            "transport.chunk_bytes": CHUNK,
            **FAST_MEMBERSHIP,
            **overrides,
        },
    )
    peer = started(Peer(cfg, flat, state_source=lambda: (step, 0, blob)))
    peer.update_progress(step, 0)
    return peer


def start_joiner(bootstrap: list[str]) -> Peer:
    torch.manual_seed(1)
    cfg = build_config({}, {"peer.id": "joiner", "peer.bootstrap": bootstrap, **FAST_MEMBERSHIP})
    return started(Peer(cfg, FlatParameters(nn.Linear(16, 4))))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def knows_steps(peer: Peer, steps: dict[str, int]) -> bool:
    """Whether ``peer`` has heard each donor's step (progress travels in heartbeats)."""
    return {d.id: d.step for d in peer.donors()} == steps


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("transport.state_rate_bytes", "-1"),
        ("transport.max_state_downloads", "0"),
        ("transport.state_timeout", "0"),
    ],
)
def test_state_serving_keys_are_validated(key: str, bad: str) -> None:
    """Bad values are config errors naming the key; good ones reach the transport."""
    name = key.split(".")[1]
    with pytest.raises(ConfigError, match=name):
        build_config({}, {key: bad})
    assert getattr(transport_options(build_config({}, {key: "7"}), 1 << 20), name) == 7


# --------------------------------------------------------------------------- donor order


infos = st.lists(st.integers(0, 500), max_size=12).map(
    lambda steps: [pb.PeerInfo(id=f"p{i}", step=s) for i, s in enumerate(steps)]
)


@settings(max_examples=200, deadline=None)
@given(donors=infos, min_step=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_donor_order_is_the_donors_near_the_median_first_then_behind_then_ahead(
    donors: list[pb.PeerInfo], min_step: int, seed: int
) -> None:
    order = donor_order(donors, min_step, random.Random(seed))
    eligible = sorted(d.id for d in donors if d.step >= min_step)
    assert sorted(d.id for d in order) == eligible
    if not order:
        return
    reference = sorted(d.step for d in order)[len(order) // 2]
    slack = max(DONOR_STEP_SLACK * reference, DONOR_NEAR_STEPS)
    band = [
        0 if abs(d.step - reference) <= slack else 1 if d.step < reference else 2 for d in order
    ]
    assert band == sorted(band)  # near, then behind, then ahead
    behind = [d.step for d, b in zip(order, band, strict=True) if b == 1]
    ahead = [d.step for d, b in zip(order, band, strict=True) if b == 2]
    assert behind == sorted(behind, reverse=True) and ahead == sorted(ahead)


@settings(max_examples=100, deadline=None)
@given(
    honest=st.lists(st.integers(100, 110), min_size=2, max_size=8),
    claimed=st.integers(200, 10**12),
    seed=st.integers(0, 2**16),
)
def test_a_member_claiming_a_far_step_is_never_a_joiners_first_donor(
    honest: list[int], claimed: int, seed: int
) -> None:
    """Issue 40: one member advertising a step far ahead of the swarm's was every joiner's
    first donor (the most advanced). Against two honest donors or more it now comes last."""
    donors = [pb.PeerInfo(id=f"p{i}", step=s) for i, s in enumerate(honest)]
    donors.append(pb.PeerInfo(id="liar", step=claimed))
    assert donor_order(donors, 1, random.Random(seed))[-1].id == "liar"


def test_donor_order_spreads_joiners_over_donors_at_the_same_step() -> None:
    donors = [pb.PeerInfo(id=f"p{i}", step=200 + i) for i in range(4)] + [
        pb.PeerInfo(id="behind", step=100)
    ]
    firsts = {donor_order(donors, 20, random.Random(seed))[0].id for seed in range(50)}
    assert firsts == {"p0", "p1", "p2", "p3"}
    assert all(donor_order(donors, 20, random.Random(s))[-1].id == "behind" for s in range(50))


# --------------------------------------------------------------------------- busy / rate


@pytest.mark.timeout(60)
def test_a_busy_donor_makes_the_joiner_take_another_and_the_rate_limit_holds() -> None:
    """Donor a (the most advanced) serves one download at a time at 40 kB/s; while a client
    holds that slot, the joiner is refused by a (busy) and takes b's state. The held
    download itself takes at least (size - one chunk) / rate."""
    rate = 40_000
    blob_a, blob_b = b"a" * 120_000, b"b" * 10_000
    a = start_donor(
        "a",
        [],
        step=100,
        blob=blob_a,
        **{"transport.max_state_downloads": 1, "transport.state_rate_bytes": rate},
    )
    b = start_donor("b", [a.address], step=50, blob=blob_b)
    joiner = start_joiner([a.address])
    peers = [a, b, joiner]
    held: dict[str, object] = {}

    def hold_the_slot() -> None:
        t0 = time.monotonic()
        with PeerClient(a.address) as client:
            _, got = client.download_state(pb.StateRequest(swarm="gossipgrad", requester="x"))
        held.update(blob=bytes(got), seconds=time.monotonic() - t0)

    holder = threading.Thread(target=hold_the_slot)
    try:
        wait_until_met(peers)
        wait_for(lambda: knows_steps(joiner, {"a": 100, "b": 50}), 20, "the donors' steps")
        holder.start()
        wait_for(lambda: a.server.admission.state_downloads == 1, 10, "a's slot to be taken")
        header, blob = joiner.download_state(min_step=20)
        assert header.sender == "b" and bytes(blob) == blob_b
        assert rejected(a, "rate_limited") == 1
        holder.join(30)
        assert held["blob"] == blob_a
        assert held["seconds"] >= (len(blob_a) - CHUNK) / rate  # 2.9 s
        # Now a is free again: the most advanced donor is asked first and serves.
        header, blob = joiner.download_state(min_step=20)
        assert header.sender == "a" and bytes(blob) == blob_a
    finally:
        holder.join(30)


@pytest.mark.timeout(60)
def test_no_donor_serving_within_patience_is_an_error_naming_it() -> None:
    a = start_donor(
        "a",
        [],
        step=100,
        blob=b"a" * 80_000,
        **{"transport.max_state_downloads": 1, "transport.state_rate_bytes": 20_000},
    )
    joiner = start_joiner([a.address])

    def hold_the_slot() -> None:
        with PeerClient(a.address) as client:
            client.download_state(pb.StateRequest(swarm="gossipgrad", requester="x"))

    holder = threading.Thread(target=hold_the_slot)
    try:
        wait_until_met([a, joiner])
        wait_for(lambda: knows_steps(joiner, {"a": 100}), 20, "the donor's step")
        holder.start()
        wait_for(lambda: a.server.admission.state_downloads == 1, 10, "a's slot to be taken")
        t0 = time.monotonic()
        with pytest.raises(JoinError) as err:
            joiner.download_state(min_step=20, patience=1.0)
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert re.fullmatch(
            rf"no donor sent its state: a at {a.address} \(busy\) \(after [12]s\)", str(err.value)
        ), str(err.value)
        assert rejected(a, "rate_limited") >= 2  # asked again after backing off
        # Nobody at min_step: not an error, the swarm is young (train from scratch).
        assert joiner.download_state(min_step=101, patience=1.0) is None
    finally:
        holder.join(30)


# --------------------------------------------------------------------------- bootstrap


@pytest.mark.timeout(60)
def test_find_swarm_skips_a_dead_bootstrap_address() -> None:
    with dead_addresses(1) as dead:
        first = start_peer("p0", [], seed=0)
        joiner = start_peer("joiner", [*dead, first.address], seed=1)
        find_swarm(joiner.membership, timeout=20)
        assert "p0" in joiner.membership.present_ids()


@pytest.mark.timeout(60)
def test_find_swarm_gives_up_after_the_bound_naming_every_address() -> None:
    with dead_addresses(2) as dead:
        joiner = start_peer("joiner", dead, seed=1)
        try:
            t0 = time.monotonic()
            with pytest.raises(JoinError) as err:
                find_swarm(joiner.membership, timeout=2.0)
            assert 2.0 <= time.monotonic() - t0 < 6.0
            assert re.fullmatch(
                rf"no bootstrap peer answered: {dead[0]}, {dead[1]} \(after [23]s\)",
                str(err.value),
            ), str(err.value)
        finally:
            joiner.close()


# --------------------------------------------------------------------------- daemons


@pytest.mark.timeout(120)
def test_a_daemon_with_only_dead_bootstrap_addresses_exits_with_one_line_error(
    tmp_path: Path,
) -> None:
    with dead_addresses(2) as dead:
        cmd = [sys.executable, "-m", "gossipgrad.peer", "--peer.bootstrap", ",".join(dead)]
        cmd += ["--peer.start_timeout", "3", "--peer.run_dir", str(tmp_path / "peer")]
        cmd += ["--train.task", "digits", "--train.threads", "1", "--metrics.enabled", "false"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr
    match = re.search(r"no bootstrap peer answered: (.*) \(after (\d+)s\)$", errors[0])
    assert match is not None, errors[0]
    assert match[1] == f"{dead[0]}, {dead[1]}"
    assert 3 <= int(match[2]) <= 8
    status = read_record(tmp_path / "peer" / "status.json", PeerStatus)
    assert status is not None and status.step == 0  # it never trained alone
    assert not (tmp_path / "peer" / "summary.json").exists()


@pytest.mark.timeout(180)
def test_a_resumed_daemon_whose_bootstrap_is_gone_exits_rather_than_training_alone(
    tmp_path: Path,
) -> None:
    """A peer restarted after its swarm ended (or with a stale bootstrap) resumed from its
    checkpoint, trained every remaining step alone and reported success with 0 bytes sent;
    it now looks for the swarm like a fresh peer and exits with the one-line error."""
    run_dir = tmp_path / "peer"
    base = [sys.executable, "-m", "gossipgrad.peer", "--peer.run_dir", str(run_dir)]
    base += ["--train.task", "digits", "--train.threads", "1", "--metrics.enabled", "false"]
    base += ["--checkpoint.every", "10"]
    first = subprocess.run([*base, "--train.steps", "20"], capture_output=True, text=True,
                           timeout=100)  # fmt: skip
    assert first.returncode == 0, first.stderr
    (run_dir / "summary.json").unlink()
    with dead_addresses(1) as dead:
        cmd = [*base, "--train.steps", "60", "--peer.bootstrap", dead[0]]
        proc = subprocess.run([*cmd, "--peer.start_timeout", "3"], capture_output=True,
                              text=True, timeout=100)  # fmt: skip
    assert "resumed from checkpoint at step 20" in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"no bootstrap peer answered: {dead[0]}" in errors[0], errors
    status = read_record(run_dir / "status.json", PeerStatus)
    # Its checkpoint's step (not 0), and not one step alone.
    assert status is not None and status.state == "starting" and status.step == 20
    assert not (run_dir / "summary.json").exists()


def wait_for_status(path: Path, state: str, timeout: float) -> PeerStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = read_record(path, PeerStatus)
        if status is not None and status.state == state:
            return status
        time.sleep(0.1)
    raise AssertionError(f"no status {state!r} in {path} within {timeout}s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("waiting", ["expected_peers", "bootstrap"])
def test_a_sigterm_while_the_daemon_waits_to_start_ends_it_at_once(
    tmp_path: Path, waiting: str
) -> None:
    # Waiting for peer.expected_peers, or hunting a bootstrap address that does not answer,
    # lasts up to peer.start_timeout (here 600 s); a SIGTERM must end it like any other.
    with dead_addresses(1) as dead:
        cmd = [sys.executable, "-m", "gossipgrad.peer", "--peer.start_timeout", "600"]
        cmd += ["--peer.run_dir", str(tmp_path / "peer"), "--train.task", "digits"]
        cmd += ["--train.threads", "1", "--metrics.enabled", "false"]
        if waiting == "expected_peers":
            cmd += ["--peer.expected_peers", "3"]
        else:
            cmd += ["--peer.bootstrap", dead[0]]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            wait_for_status(tmp_path / "peer" / "status.json", "starting", 60)
            time.sleep(1.0)  # inside the wait
            signalled = time.monotonic()
            proc.terminate()
            code = proc.wait(timeout=60)
            took = time.monotonic() - signalled
            stderr = proc.stderr.read()
        finally:
            proc.kill()
            proc.wait()
    assert code == 0, stderr
    assert took < 30, f"the daemon took {took:.0f}s to leave after SIGTERM"
    assert "Traceback" not in stderr
    status = read_record(tmp_path / "peer" / "status.json", PeerStatus)
    assert status is not None and status.step == 0  # it never trained


JOINERS = (2, 3)
RATE = 50_000  # bytes/s each donor serves state at: a digits state (~212 kB) takes ~4 s


def download_of(swarm: LocalSwarm, i: int) -> tuple[str, int, float, float]:
    """(donor, bytes, start, end) of the state download peer i logged (end: unix seconds)."""
    log = (swarm.out / f"peer{i}.log").read_text()
    match = re.search(
        r"^(\S+ \S+) INFO \S+: downloaded state of (\S+): step \d+, (\d+) bytes in ([\d.]+)s$",
        log,
        re.MULTILINE,
    )
    assert match is not None, log
    end = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return match[2], int(match[3]), end - float(match[4]), end


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_joiners_at_once_both_join_without_overloading_a_donor(tmp_path: Path) -> None:
    """Two donors training, each serving one download at a time at RATE; two joiners
    started at once, whose first bootstrap address is dead. Both find the swarm, both start
    from a state a donor served (step and parameters), each download took at least
    size / RATE, and downloads that overlapped in time came from different donors."""
    overrides = {
        **BASE,
        "train.steps": "100000",  # stopped by the test once both have joined
        "peer.expected_peers": "2",
        "peer.join_after_steps": "20",
        "peer.start_timeout": "60",
        "transport.chunk_bytes": str(CHUNK),
        "transport.max_state_downloads": "1",
        "transport.state_rate_bytes": str(RATE),
    }
    swarm = LocalSwarm(
        tmp_path / "swarm",
        4,
        overrides,
        peer_overrides=lambda i: {"peer.expected_peers": "1"} if i in JOINERS else {},
    )
    try:
        with dead_addresses(1) as dead:
            swarm.start(count=2)
            wait_for(lambda: min(swarm.status(i).step for i in (0, 1)) >= 30, 120, "donors")
            swarm.bootstrap = f"{dead[0]},{swarm.bootstrap}"
            for i in JOINERS:
                swarm.spawn(i)
            wait_for(
                lambda: (
                    all(swarm.status(i).start_step is not None for i in JOINERS) or swarm.failed()
                ),
                150,
                "both joiners to start training",
            )
        assert swarm.failed() == []
    finally:
        swarm.stop(timeout=10)
    served = served_states(swarm, range(2))
    downloads = []
    for i in JOINERS:
        status = read_record(swarm.peer_dir(i) / "status.json", PeerStatus)
        assert status is not None and (status.joined_at_step or 0) >= 20, status
        assert status.start_step == status.joined_at_step
        assert (status.start_step, status.start_params) in served
        donor, size, start, end = download_of(swarm, i)
        assert donor in ("peer0", "peer1")
        # The log gives seconds to 0.01 s.
        assert end - start >= (size - CHUNK) / RATE - 0.01, (i, size, end - start)
        downloads.append((donor, start, end))
    (d2, s2, e2), (d3, s3, e3) = downloads
    overlapped = s2 < e3 and s3 < e2
    print(f"downloads {downloads}, overlapped {overlapped}")
    if overlapped:
        assert d2 != d3
