"""Configuration paths exercised the way a user reaches them: a key in the config (or an
environment variable, a signal, a console script) and what the running peer then does.

Cheap checks use in-process peers (real gRPC servers on 127.0.0.1:0, tests/peer_harness.py);
the paths that only a daemon has (status.json, checkpoints, signals, the local optimizer) run
real ``gossipgrad-peer`` processes. One six-peer daemon swarm covers several keys at once
(``gossip.local_steps`` > 1 with CHOCO, adam and adamw, the exponential topology, Dirichlet
shards), so the file stays within a few minutes on two cores.
"""

from __future__ import annotations

import math
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.launch import LocalSwarm, terminate
from gossipgrad.experiment.links import LinkEmulator
from gossipgrad.peer.config import ConfigError, build_config
from gossipgrad.peer.network.errors import REASON_METADATA_KEY
from gossipgrad.peer.network.framing import GRPC_FRAME_OVERHEAD
from gossipgrad.peer.network.protocol import PUSH, UPDATE_CODEC, method_path
from gossipgrad.peer.optimizer import GossipOptimizer
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from gossipgrad.proto import gossip_pb2 as pb
from peer_harness import FAST_MEMBERSHIP, close_all, quiesce, rejected, run_rounds, start_peer
from peer_harness import start_peers as harness_start_peers
from test_choco import assert_mirrors_exact
from torch import nn

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def sample(peer, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of an in-process peer's metrics (0 while absent)."""
    return peer.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- transport.chunk_bytes -------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [0, 4095, (4 << 20) + 1, "4k"])
def test_invalid_chunk_bytes_is_refused_at_config_load(value) -> None:
    with pytest.raises(ConfigError, match=r"^transport\.chunk_bytes: "):
        build_config({"transport": {"chunk_bytes": value}})


def _update_traffic(sender, receiver) -> tuple[float, float, float]:
    """(wire bytes sender -> receiver as the sender counts them, header + payload bytes as the
    receiver counts them, pushes), over updates and resyncs."""
    sent = received = 0.0
    for kind in ("update", "resync"):
        sent += sample(
            sender, "gossipgrad_sent_bytes_total", {"neighbor": receiver.id, "kind": kind}
        )
        received += sample(
            receiver, "gossipgrad_received_bytes_total", {"neighbor": sender.id, "kind": kind}
        )
    pushes = sample(sender, "gossipgrad_push_duration_seconds_count", {"neighbor": receiver.id})
    return sent, received, pushes


@pytest.mark.timeout(120)
def test_small_chunks_deliver_updates_exactly_and_set_the_framing() -> None:
    """4 KiB chunks: dense updates of ~45 KiB go out as a dozen chunks each and arrive bit
    for bit; the wire-byte counters show one chunk frame per 4 KiB of payload."""
    widths = (100, 110, 10)  # 12,220 parameters: 48,880 bytes dense
    figures = {}
    for chunk in (4096, 4 << 20):
        overrides = {
            "transport.chunk_bytes": chunk,
            "gossip.codec": "none",
            "gossip.gamma": 0.5,
            "gossip.max_staleness": 0,
        }
        peers = harness_start_peers(2, overrides, widths=widths)
        try:
            d0 = float((peers[0].flat.data - peers[1].flat.data).norm())
            run_rounds(peers, 12)
            quiesce(peers)
            assert assert_mirrors_exact(peers) == 2
            assert float((peers[0].flat.data - peers[1].flat.data).norm()) < d0 / 100
            sent, received, pushes = _update_traffic(peers[0], peers[1])
        finally:
            close_all(peers)
        assert pushes > 0 and received > 0
        figures[chunk] = (sent - received) / pushes  # framing bytes per push
    nbytes = widths[0] * widths[1] + widths[1] + widths[1] * widths[2] + widths[2]
    chunks = math.ceil(4 * nbytes / 4096)
    per_chunk = 1 + 2 + GRPC_FRAME_OVERHEAD  # data tag, 2-byte varint length, gRPC framing
    extra = figures[4096] - figures[4 << 20]
    print(f"framing bytes per push: {figures}; {chunks} chunks of 4 KiB per dense update")
    # Pushes without a payload (session openings, end notices) carry no chunk at all, so the
    # mean lies below the full count; most pushes are dense updates.
    assert 0.5 * (chunks - 1) * per_chunk < extra <= (chunks - 1) * per_chunk + 1


# --- peer.advertise ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["localhost", "localhost:", ":7000", "host:port", "a b:70"])
def test_advertise_without_host_and_port_is_refused_at_config_load(value: str) -> None:
    """An advertised address is what every other peer dials: without a port it never works."""
    with pytest.raises(ConfigError, match=r"^peer\.advertise: "):
        build_config({"peer": {"advertise": value}})


@pytest.mark.timeout(120)
def test_peers_reach_a_peer_at_the_address_it_advertises() -> None:
    """p1 binds 127.0.0.1:0 but advertises ``localhost:R``, a relay in front of it: the others
    learn that address from membership and their heartbeats and updates all go through it."""
    bound: list[str] = []
    with LinkEmulator() as links:
        relay = links.add("to-p1", lambda: bound[0] if bound else None, [], [])
        advertised = f"localhost:{relay.port}"
        p0 = start_peer("p0", [], seed=1)
        p1 = start_peer("p1", [p0.address], seed=2, overrides={"peer.advertise": advertised})
        bound.append(f"127.0.0.1:{p1.server.port}")
        p2 = start_peer("p2", [p0.address], seed=3)
        peers = [p0, p1, p2]
        try:
            wait_for(
                lambda: all(len(p.membership.present_ids()) == 3 for p in peers), 20, "membership"
            )
            assert p1.address == advertised
            assert p0.membership.address_of("p1") == p2.membership.address_of("p1") == advertised
            run_rounds(peers, 5)
            quiesce(peers)
            assert assert_mirrors_exact(peers) == 6
            for other in ("p0", "p2"):
                assert (
                    sample(
                        p1, "gossipgrad_received_bytes_total", {"neighbor": other, "kind": "update"}
                    )
                    > 0
                ), other
            stats = relay.stats()
        finally:
            close_all(peers)
    # One connection per dialling peer at least (bulk and heartbeat channels), carrying all of
    # p1's incoming traffic: nobody reached it at the address it binds.
    assert stats["connections"] >= 2, stats
    received = sum(
        sample(p1, "gossipgrad_received_bytes_total", {"neighbor": other, "kind": kind})
        for other in ("p0", "p2")
        for kind in ("update", "resync")
    )
    assert stats["forward"]["bytes"] >= received > 0, (stats, received)
    print(f"relay in front of p1: {stats['connections']} connections, {stats['forward']} forward")


# --- GOSSIPGRAD_TOKEN ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_swarm_token_from_the_environment_admits_members_and_refuses_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GOSSIPGRAD_TOKEN (no security.token in the config): a peer started with the same value
    joins and gossips; one with another value or none is refused, UNAUTHENTICATED, counted."""
    monkeypatch.setenv("GOSSIPGRAD_TOKEN", "right-token")
    p0 = start_peer("p0", [], seed=1)
    p1 = start_peer("p1", [p0.address], seed=2)
    monkeypatch.setenv("GOSSIPGRAD_TOKEN", "wrong-token")
    wrong = start_peer("wrong", [p0.address], seed=3)
    monkeypatch.delenv("GOSSIPGRAD_TOKEN")
    missing = start_peer("missing", [p0.address], seed=4)
    members = [p0, p1]
    try:
        wait_for(lambda: all(len(p.membership.present_ids()) == 2 for p in members), 20, "p0+p1")
        wait_for(lambda: rejected(p0, "unauthenticated") >= 4, 20, "refused heartbeats")
        run_rounds(members, 4)
        quiesce(members)
        assert assert_mirrors_exact(members) == 2
        # The outsiders never got in, and they know nobody either.
        for p in (p0, p1):
            assert set(p.membership.present_ids()) == {"p0", "p1"}
        assert wrong.membership.present_ids() == ["wrong"]
        assert missing.membership.present_ids() == ["missing"]
        # The members did not refuse each other.
        assert rejected(p1, "unauthenticated") == 0
        print(f"p0 refused {rejected(p0, 'unauthenticated'):.0f} calls without the token")
    finally:
        close_all([*members, wrong, missing])


# --- security.max_streams_per_peer -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_streams_beyond_max_streams_per_peer_are_refused_and_counted() -> None:
    """max_streams_per_peer = 2: two held-open pushes of one caller are admitted and end
    accepted; a third while they are open ends RESOURCE_EXHAUSTED (reason rate_limited) and
    is counted; once one has ended the caller may open another."""
    p0 = start_peer("p0", [], seed=1, overrides={"security.max_streams_per_peer": 2})
    header = pb.UpdateHeader(
        swarm="gossipgrad",
        sender="p9",
        receiver="p0",
        kind=pb.FINAL,  # no payload: the handler answers ACCEPTED once the stream ends
        model_fingerprint=p0.flat.fingerprint,
    )
    head = UPDATE_CODEC.header_bytes(header)
    release = threading.Event()

    def held():
        yield head
        release.wait(30)  # the stream stays open (and admitted) until released

    channel = grpc.insecure_channel(p0.address)
    push = channel.stream_unary(method_path(PUSH), response_deserializer=pb.PushReply.FromString)
    limiter = p0.server.admission.bulk
    try:
        open_calls = [push.future(held(), timeout=30) for _ in range(2)]
        wait_for(lambda: limiter.in_flight("p9") == 2, 10, "two admitted streams")
        with pytest.raises(grpc.RpcError) as info:
            push(iter([head]), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(info.value.trailing_metadata() or ())
        assert trailing.get(REASON_METADATA_KEY) == "rate_limited"
        assert "limit 2 per peer" in info.value.details()
        assert rejected(p0, "rate_limited") == 1
        release.set()
        replies = [c.result(timeout=10) for c in open_calls]
        assert [r.status for r in replies] == [pb.PushReply.ACCEPTED] * 2
        wait_for(lambda: limiter.in_flight("p9") == 0, 10, "the streams to be released")
        assert push(iter([head]), timeout=10).status == pb.PushReply.ACCEPTED
        assert rejected(p0, "rate_limited") == 1
    finally:
        release.set()
        channel.close()
        p0.close()


# --- peer.join_after_steps -------------------------------------------------------------------


def _gossip_optimizer(pid: str, bootstrap: list[str], **overrides) -> GossipOptimizer:
    """A GossipOptimizer around a small seeded MLP (the daemon's code path minus the task)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    cfg = build_config(
        {}, {"peer.id": pid, "peer.bootstrap": bootstrap, **FAST_MEMBERSHIP, **overrides}
    )
    return GossipOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)


def _train(gopt: GossipOptimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(gopt.local_step)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=gen)
        gopt.zero_grad()
        gopt.model(x).pow(2).mean().backward()
        gopt.step()


@pytest.mark.timeout(120)
def test_a_fresh_peer_joins_from_the_swarm_once_a_donor_is_join_after_steps_in() -> None:
    """join_after_steps = 6: below 6 steps the newcomer keeps its own seeded start; at 6 it
    takes over the donor's parameters, optimizer state and step."""
    donor = _gossip_optimizer("d0", [])
    newcomers: list[GossipOptimizer] = []
    try:
        _train(donor, 5)
        early = _gossip_optimizer("n1", [donor.peer.address], **{"peer.join_after_steps": 6})
        newcomers.append(early)
        early.peer.membership.beat_once()  # as the daemon does before joining
        assert early.join_from_swarm(timeout=10) is False
        assert early.local_step == 0
        assert (
            sample(early, "gossipgrad_received_bytes_total", {"neighbor": "d0", "kind": "state"})
            == 0
        )

        _train(donor, 1)  # step 6: exactly join_after_steps
        donor.peer.update_progress(donor.local_step, donor.round)
        late = _gossip_optimizer("n2", [donor.peer.address], **{"peer.join_after_steps": 6})
        newcomers.append(late)
        wait_for(lambda: late.peer.membership.record("d0") is not None, 10, "n2 to see d0")
        late.peer.membership.beat_once()
        with donor.state_lock:
            expected = donor.flat.data.clone()
            momentum = [s["momentum_buffer"].clone() for s in donor.optimizer.state.values()]
        assert late.join_from_swarm(timeout=10) is True
        assert late.local_step == 6
        assert torch.equal(late.flat.data, expected)
        got = [s["momentum_buffer"] for s in late.optimizer.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(got, momentum, strict=True))
        assert (
            sample(late, "gossipgrad_received_bytes_total", {"neighbor": "d0", "kind": "state"}) > 0
        )
    finally:
        for g in [donor, *newcomers]:
            g.close()


# --- the installed console scripts -----------------------------------------------------------


def _console_scripts() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", sorted(_console_scripts()))
def test_console_script_is_installed_next_to_the_interpreter(script: str) -> None:
    """tests/test_commands.py runs each script's --help, falling back to PATH when the venv
    lacks it; here the venv itself must hold each entry point as an executable file."""
    exe = BIN / script
    assert exe.is_file(), f"{script} is not installed in {BIN}"
    assert exe.stat().st_mode & stat.S_IXUSR, f"{exe} is not executable"


@pytest.mark.timeout(120)
def test_installed_peer_prints_the_config_reference_of_docs() -> None:
    """One real action of the installed gossipgrad-peer: its reference is docs/config.md."""
    out = subprocess.run(
        [str(BIN / "gossipgrad-peer"), "--config-reference"],
        capture_output=True,
        text=True,
        timeout=100,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == (ROOT / "docs" / "config.md").read_text()
