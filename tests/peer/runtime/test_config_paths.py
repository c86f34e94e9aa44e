"""Configuration paths exercised the way a user reaches them: a key in the config (or an
environment variable, a signal, a console script) and what the running peer then does.

Cheap checks use in-process peers (real gRPC servers on 127.0.0.1:0, tests/support/peers.py);
the paths that only a daemon has (status.json, checkpoints, signals, the local optimizer) run
real ``gossipgrad-peer`` processes. One six-peer daemon swarm covers several keys at once
(``gossip.local_steps`` > 1 with CHOCO, adam and adamw, the exponential topology, Dirichlet
shards), so the file stays within a few minutes on two cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from gossipgrad.experiment import launch
from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.launch import LocalSwarm, terminate
from gossipgrad.experiment.links import LinkEmulator
from gossipgrad.peer.config import ConfigError, build_config
from gossipgrad.peer.network.errors import REASON_METADATA_KEY
from gossipgrad.peer.network.framing import GRPC_FRAME_OVERHEAD
from gossipgrad.peer.network.protocol import PUSH, UPDATE_CODEC, method_path
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from gossipgrad.proto import gossip_pb2 as pb
from support import ROOT
from support.peers import (
    FAST_MEMBERSHIP,
    assert_mirrors_exact,
    quiesce,
    rejected,
    run_rounds,
    start_peer,
)
from support.peers import start_peers as harness_start_peers
from torch import nn

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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
@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0, "greater than or equal to 4096"),
        (4095, "greater than or equal to 4096"),
        ((4 << 20) + 1, "less than or equal to 4194304"),
        ("4k", "valid integer"),
    ],
)
def test_invalid_chunk_bytes_is_refused_at_config_load(value, why: str) -> None:
    """One line naming the key and the allowed range, before anything starts."""
    with pytest.raises(ConfigError, match=rf"^transport\.chunk_bytes: .*{why}"):
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
        d0 = float((peers[0].flat.data - peers[1].flat.data).norm())
        run_rounds(peers, 12)
        quiesce(peers)
        assert assert_mirrors_exact(peers) == 2
        assert float((peers[0].flat.data - peers[1].flat.data).norm()) < d0 / 100
        sent, received, pushes = _update_traffic(peers[0], peers[1])
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
        wait_for(lambda: all(len(p.membership.present_ids()) == 3 for p in peers), 20, "membership")
        assert p1.address == advertised
        assert p0.membership.address_of("p1") == p2.membership.address_of("p1") == advertised
        run_rounds(peers, 5)
        quiesce(peers)
        assert assert_mirrors_exact(peers) == 6
        for other in ("p0", "p2"):
            assert (
                sample(p1, "gossipgrad_received_bytes_total", {"neighbor": other, "kind": "update"})
                > 0
            ), other
        stats = relay.stats()
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
    """join_after_steps = 6: a donor 5 steps in is not taken, the newcomer keeps its own
    seeded start; a donor 6 steps in is: the newcomer takes over its parameters, optimizer
    state and step (the daemon makes the same call before its first step)."""
    donor = _gossip_optimizer("d0", [])
    newcomers: list[GossipOptimizer] = []

    def newcomer(pid: str) -> GossipOptimizer:
        g = _gossip_optimizer(pid, [donor.peer.address], **{"peer.join_after_steps": 6})
        newcomers.append(g)

        def sees_donor_step() -> bool:
            record = g.peer.membership.record("d0")
            return record is not None and record.info.step == donor.local_step

        wait_for(sees_donor_step, 10, f"{pid} to hear the donor's step")
        return g

    try:
        _train(donor, 5)
        early = newcomer("n1")
        start = early.flat.data.clone()
        assert early.join_from_swarm(timeout=10) is False
        assert early.local_step == 0 and torch.equal(early.flat.data, start)
        state_bytes = {"neighbor": "d0", "kind": "state"}
        assert sample(early, "gossipgrad_received_bytes_total", state_bytes) == 0
        early.close()

        _train(donor, 1)  # step 6: exactly join_after_steps
        late = newcomer("n2")
        with donor.state_lock:
            expected = donor.flat.data.clone()
            momentum = [s["momentum_buffer"].clone() for s in donor.optimizer.state.values()]
        assert late.join_from_swarm(timeout=10) is True
        assert late.local_step == 6
        assert torch.equal(late.flat.data, expected)
        got = [s["momentum_buffer"] for s in late.optimizer.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(got, momentum, strict=True))
        assert sample(late, "gossipgrad_received_bytes_total", state_bytes) > 0
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


@pytest.mark.timeout(120)
def test_installed_peer_exits_with_its_status_and_everything_it_printed() -> None:
    """gossipgrad-peer ends with a fast exit (no interpreter teardown): the exit status is
    still main's, and what it printed to a pipe (block-buffered) is all there."""
    peer = str(BIN / "gossipgrad-peer")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    shown = subprocess.run(
        [peer, "--print-config", "--set", "train.steps=7"],
        capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["train"]["steps"] == 7
    bad = subprocess.run(
        [peer, "--set", "train.stepz=7"],
        capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    assert bad.returncode == 2 and "config error" in bad.stderr, bad


# --- daemon swarms: local_steps with CHOCO, adam/adamw, topologies, Dirichlet shards ----------

SWARM_PEERS = 6
SWARM_STEPS = 90
LOCAL_STEPS = 3
# Shared by every swarm below and by the no-gossip reference, so the reference fits them all.
SWARM_TRAIN = {
    "train.task": "digits",
    "train.steps": str(SWARM_STEPS),
    "train.batch_size": "32",
    "train.eval_every": "0",
    "train.lr": "0.005",
    "train.schedule": "constant",
    "train.partition": "dirichlet",
    "train.alpha": "0.5",
    "gossip.codec": "int8",
    "gossip.gamma": "0.5",
    "gossip.local_steps": str(LOCAL_STEPS),
    "checkpoint.every": "0",
}
SWARM_RUNTIME = {
    "metrics.enabled": "true",
    # On a loaded machine six interpreters may take minutes to start: peer0 waits for them.
    "peer.start_timeout": "300",
    "membership.heartbeat_interval": "0.2",
    # Lenient: a peer suspected on a busy machine would change the others' neighbours.
    "membership.suspect_after": "4",
    "membership.dead_after": "8",
    "gossip.round_timeout": "3",
}
# (1/n) sum ||x_i - mean||^2 / ||mean||^2 at the end. Measured on digits (6 Dirichlet shards,
# 90 steps, adam/adamw at lr 0.005): peers that never gossip end at 0.43; the swarms below
# at 5e-4 (exponential) to 2.4e-3 (random-regular, degree 3).
CONSENSUS_BOUND = 2e-2


def optimizer_of(i: int) -> dict[str, str]:
    """Half the peers run adamw, half adam: the local optimizer is each peer's own choice."""
    return {"train.optimizer": "adamw" if i % 2 == 0 else "adam"}


def expected_neighbours(topology: str, n: int, seed: int = 0) -> list[set[int]]:
    """Each peer's neighbours by the topology's definition (docs/topologies.md), written out
    here rather than asked of the code under test (random-regular: checked for shape)."""
    if topology == "exponential":
        hops = {1 << k for k in range(n.bit_length()) if (1 << k) < n}
        return [{(i + s * h) % n for h in hops for s in (1, -1)} - {i} for i in range(n)]
    if topology == "torus" and n == 6:  # a 2 x 3 grid with wrap-around
        rows, cols = 2, 3
        out = []
        for i in range(n):
            r, c = divmod(i, cols)
            near = {
                ((r + dr) % rows) * cols + (c + dc) % cols
                for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))
            }
            out.append(near - {i})
        return out
    raise ValueError(topology)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models train far faster on one intra-op thread on a busy machine (2 s instead of
    minutes for the reference below); the process's setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def no_gossip_consensus(n: int, seed: int = 0) -> float:
    """Relative consensus distance of n peers that train their shards alone (same config)."""
    from gossipgrad.peer.tasks import build_task
    from gossipgrad.peer.tasks.schedule import make_scheduler
    from gossipgrad.peer.tasks.training import make_optimizer, task_context

    finals = []
    for i in range(n):
        cfg = build_config({}, {**SWARM_TRAIN, **optimizer_of(i), "train.seed": str(seed)})
        task = build_task(cfg.train.task, task_context(cfg.train, i, n))
        opt = make_optimizer(task.model.parameters(), cfg.train)
        scheduler = make_scheduler(opt, cfg.train)
        batches = task.batches()
        for _ in range(cfg.train.steps):
            opt.zero_grad()
            task.loss(task.model, next(batches)).backward()
            opt.step()
            scheduler.step()
        finals.append(torch.cat([p.detach().flatten() for p in task.model.parameters()]))
    xs = torch.stack(finals).double()
    mean = xs.mean(0)
    return float(((xs - mean) ** 2).sum(1).mean() / (mean**2).sum())


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """One peer's /metrics: (name, sorted label items) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gossip_view(status: PeerStatus) -> tuple[set[str], float, float]:
    """(peers it has sent compressed updates to, steps, rounds) from a running peer's metrics."""
    samples = scrape(status.metrics_port)
    sent_to = {
        dict(labels)["neighbor"]
        for (name, labels), value in samples.items()
        if name == "gossipgrad_sent_bytes_total"
        and dict(labels).get("kind") == "update"
        and value > 0
    }
    steps = samples[("gossipgrad_train_steps_total", ())]
    rounds = samples[("gossipgrad_gossip_rounds_total", ())]
    return sent_to, steps, rounds


def observe_mid_run(statuses, n: int, timeout: float = 420) -> list[tuple[set[str], float, float]]:
    """Every peer's gossip view once all of them are a third into training."""
    wait_for(
        lambda: all(
            (s := statuses(i)).step >= SWARM_STEPS // 3 and s.metrics_port for i in range(n)
        ),
        timeout,
        "every peer to be a third into training",
    )
    return [gossip_view(statuses(i)) for i in range(n)]


def check_swarm(views, summaries, params, expected: list[set[int]], reference: float) -> float:
    """The laws every swarm below must show; returns its relative consensus distance."""
    n = len(summaries)
    ids = [f"peer{i}" for i in range(n)]  # the topology's index is the sorted peer id
    for i, (sent_to, steps, rounds) in enumerate(views):
        assert sent_to == {ids[j] for j in expected[i]}, (i, sent_to, expected[i])
        # One round every local_steps steps while training.
        assert abs(rounds - steps / LOCAL_STEPS) <= 1, (i, steps, rounds)
    for s in summaries:
        assert s is not None and s.steps == SWARM_STEPS and not s.stopped_early
        assert s.rounds == SWARM_STEPS // LOCAL_STEPS, s.rounds
        assert s.sent_update_bytes > 0 and s.final["accuracy"] > 0.5, s
    cd = consensus_distance(params)
    assert cd is not None
    relative = cd[1]
    assert relative < CONSENSUS_BOUND < reference, (relative, reference)
    return relative


@pytest.fixture(scope="module")
def no_gossip_reference() -> float:
    with one_torch_thread():
        return no_gossip_consensus(SWARM_PEERS)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_daemon_swarm_local_steps_adam_adamw_exponential_dirichlet(
    tmp_path: Path, no_gossip_reference: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six gossipgrad-peer processes: CHOCO with local_steps = 3, adamw and adam peers, the
    exponential topology, Dirichlet shards. Then two of them resume from their checkpoints
    and their Adam moments and step counts go on where they stopped."""
    monkeypatch.setattr(launch, "ADDRESS_TIMEOUT_S", 300.0)  # peer0's start, on a busy machine
    swarm = LocalSwarm(
        tmp_path / "swarm",
        SWARM_PEERS,
        {**SWARM_TRAIN, **SWARM_RUNTIME, "gossip.topology": "exponential"},
        peer_overrides=optimizer_of,
    )
    try:
        swarm.start()
        views = observe_mid_run(swarm.status, SWARM_PEERS)
        assert swarm.wait(300), "swarm did not finish"
        assert swarm.failed() == []
    finally:
        swarm.stop(timeout=10)
    summaries = [
        read_record(swarm.peer_dir(i) / "summary.json", PeerSummary) for i in range(SWARM_PEERS)
    ]
    params = [swarm.peer_dir(i) / "params.pt" for i in range(SWARM_PEERS)]
    relative = check_swarm(
        views,
        summaries,
        params,
        expected_neighbours("exponential", SWARM_PEERS),
        no_gossip_reference,
    )
    print(f"exponential: relative consensus {relative:.2e}, no gossip {no_gossip_reference:.2e}")

    # Dirichlet shards: the sizes each daemon logged differ per peer and per seed, and are
    # the ones the task API gives for that seed.
    logged = [
        int(
            re.search(
                r"Task\('digits', params=\d+, shard=(\d+)", (swarm.out / f"peer{i}.log").read_text()
            )[1]
        )
        for i in range(SWARM_PEERS)
    ]
    from gossipgrad.peer.tasks import build_task
    from gossipgrad.peer.tasks.training import task_context

    def sizes(seed: int) -> list[int]:
        cfg = build_config({}, {**SWARM_TRAIN, "train.seed": str(seed)})
        return [
            build_task("digits", task_context(cfg.train, i, SWARM_PEERS)).num_train_samples
            for i in range(SWARM_PEERS)
        ]

    assert logged == sizes(0) and sum(logged) == 1437
    assert max(logged) - min(logged) > 50, logged  # IID shards differ by at most one sample
    assert sizes(1) != logged
    print(f"Dirichlet shard sizes {logged}")

    # Checkpoints keep the local optimizer's state; a restarted peer resumes it.
    for i in (0, 1):
        state = torch.load(swarm.peer_dir(i) / "checkpoint.pt", weights_only=True)
        group = state["optimizer"]["param_groups"][0]
        # torch >= 2.6 records which of the two it is (older versions have no such key).
        assert group.get("decoupled_weight_decay", i == 0) == (i == 0), group
        moments = state["optimizer"]["state"]
        assert moments and all(float(m["step"]) == SWARM_STEPS for m in moments.values())
        assert all(float(m["exp_avg_sq"].sum()) > 0 for m in moments.values())
    more = 4
    with contextlib.ExitStack() as logs:
        resumed = [
            subprocess.Popen(
                [
                    *swarm.command(i, None),
                    f"--train.steps={SWARM_STEPS + more}",
                    "--peer.expected_peers=1",  # alone now: the others have finished
                ],
                stdout=logs.enter_context(open(swarm.out / f"resume{i}.log", "w")),
                stderr=subprocess.STDOUT,
            )
            for i in (0, 1)
        ]
        try:
            assert [p.wait(timeout=120) for p in resumed] == [0, 0]
        finally:
            terminate(resumed, 10)
    for i in (0, 1):
        log = (swarm.out / f"resume{i}.log").read_text()
        assert f"resumed from checkpoint at step {SWARM_STEPS}" in log, log[-2000:]
        state = torch.load(swarm.peer_dir(i) / "checkpoint.pt", weights_only=True)
        assert state["local_step"] == SWARM_STEPS + more
        # Adam's per-parameter step counts went on from the checkpoint instead of restarting.
        assert all(
            float(m["step"]) == SWARM_STEPS + more for m in state["optimizer"]["state"].values()
        )


def run_daemon_threads(out: Path, n: int, overrides: dict[str, str]) -> tuple[list, list, list]:
    """n peer daemons (``Daemon.run``, the daemon's whole code path) on threads of this
    process: a swarm without n interpreter start-ups. Returns (mid-run views, summaries,
    params files)."""
    from gossipgrad.peer.runtime.daemon import Daemon

    dirs = [out / f"peer{i}" for i in range(n)]
    errors: list[BaseException] = []

    def status(i: int) -> PeerStatus:
        return read_record(dirs[i] / "status.json", PeerStatus) or PeerStatus()

    def run(i: int, bootstrap: list[str]) -> None:
        cfg = build_config(
            {},
            {
                **overrides,
                **optimizer_of(i),
                "peer.id": f"peer{i}",
                "peer.run_dir": str(dirs[i]),
                "peer.expected_peers": str(n),
                "peer.bootstrap": bootstrap,
                "train.shard_index": str(i),
                "train.num_shards": str(n),
            },
        )
        try:
            Daemon(cfg).run()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(0, []), daemon=True)]
    threads[0].start()
    wait_for(lambda: status(0).address, 60, "peer0's address")
    for i in range(1, n):
        threads.append(threading.Thread(target=run, args=(i, [status(0).address]), daemon=True))
        threads[-1].start()
    views = observe_mid_run(status, n)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a daemon thread did not finish"
    summaries = [read_record(d / "summary.json", PeerSummary) for d in dirs]
    return views, summaries, [d / "params.pt" for d in dirs]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("topology", ["torus", "random-regular"])
def test_topology_over_real_gossip(
    tmp_path: Path, topology: str, no_gossip_reference: float
) -> None:
    """Six daemons on threads: each gossips with exactly its neighbours in the topology, and
    the swarm ends in consensus that peers training alone miss by far."""
    overrides = {**SWARM_TRAIN, **SWARM_RUNTIME, "gossip.topology": topology}
    with one_torch_thread():
        views, summaries, params = run_daemon_threads(tmp_path, SWARM_PEERS, overrides)
    if topology == "random-regular":
        from gossipgrad.peer.membership.topology import DEFAULT_DEGREE, topology_from_name

        # No closed form: the graph the peers gossiped over is d-regular and symmetric, and
        # it is the one the swarm's seed (train.seed) draws.
        graph = [{int(p.removeprefix("peer")) for p in view[0]} for view in views]
        assert all(len(g) == DEFAULT_DEGREE for g in graph), graph
        assert all(i in graph[j] for i in range(SWARM_PEERS) for j in graph[i]), graph
        drawn = topology_from_name(topology, seed=0)
        expected = [set(drawn.neighbors(i, SWARM_PEERS)) for i in range(SWARM_PEERS)]
    else:
        expected = expected_neighbours(topology, SWARM_PEERS)
    relative = check_swarm(views, summaries, params, expected, no_gossip_reference)
    print(f"{topology}: relative consensus {relative:.2e}, no gossip {no_gossip_reference:.2e}")


# --- SIGINT, --insecure on a non-loopback address ---------------------------------------------


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _peer_command(run_dir: Path, *extra: str) -> list[str]:
    """The installed gossipgrad-peer, one peer alone on the digits task."""
    return [
        str(BIN / "gossipgrad-peer"),
        "--peer.id=solo",
        f"--peer.run_dir={run_dir}",
        "--train.task=digits",
        "--train.eval_every=0",
        "--train.threads=1",
        "--metrics.enabled=false",
        "--checkpoint.every=0",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_non_loopback_plaintext_needs_insecure_and_ctrl_c_leaves_cleanly(tmp_path: Path) -> None:
    """Binding 0.0.0.0 without TLS: refused with a clear error, nothing started; with
    --insecure it serves (reached only via 127.0.0.1 here) and warns. SIGINT (Ctrl-C) to that
    running daemon: exit 0 within seconds, checkpoint, summary and a final status written,
    no child process left."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    refused_dir, solo_dir = tmp_path / "refused", tmp_path / "solo"
    log = open(tmp_path / "solo.log", "w")  # noqa: SIM115 - closed below
    # Both at once: the refusal costs an interpreter start too.
    refused = subprocess.Popen(
        _peer_command(refused_dir, "--peer.listen=0.0.0.0:0", "--train.steps=5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    solo = subprocess.Popen(
        _peer_command(solo_dir, "--peer.listen=0.0.0.0:0", "--train.steps=1000000", "--insecure"),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        out, err = refused.communicate(timeout=300)
        assert refused.returncode == 1, (out, err)
        assert "0.0.0.0:0 is not a loopback address" in err and "--insecure" in err, err
        assert "Traceback" not in err
        assert not (refused_dir / "status.json").exists()  # refused before serving anything

        def solo_status() -> PeerStatus:
            return read_record(solo_dir / "status.json", PeerStatus) or PeerStatus()

        wait_for(lambda: solo_status().step >= 30, 300, "the insecure peer to train")
        port = int(solo_status().address.rsplit(":", 1)[1])
        assert solo_status().address == f"0.0.0.0:{port}"
        # It serves on every interface: ask it over loopback (another swarm's heartbeat,
        # refused by name, so nothing joins it).
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            beat = channel.unary_unary(
                method_path("Heartbeat"), response_deserializer=pb.HeartbeatReply.FromString
            )
            request = pb.HeartbeatRequest(swarm="elsewhere", sender=pb.PeerInfo(id="probe"))
            with pytest.raises(grpc.RpcError) as info:
                beat(request.SerializeToString(), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "INSECURE" in (tmp_path / "solo.log").read_text()

        children = psutil.Process(solo.pid).children(recursive=True)
        t0 = time.monotonic()
        solo.send_signal(signal.SIGINT)
        assert solo.wait(timeout=30) == 0
        seconds = time.monotonic() - t0
    finally:
        terminate([refused, solo], 10)
        log.close()
    assert not [c.pid for c in children if _alive(c)], "child processes outlived the daemon"
    summary = read_record(solo_dir / "summary.json", PeerSummary)
    assert summary is not None and summary.stopped_early is True and summary.steps >= 30
    state = torch.load(solo_dir / "checkpoint.pt", weights_only=True)
    assert state["local_step"] == summary.steps
    final = read_record(solo_dir / "status.json", PeerStatus)
    assert final is not None and final.state == "done" and final.step == summary.steps
    print(
        f"SIGINT at step {summary.steps}: exited 0 after {seconds:.2f}s, {len(children)} children"
    )


@pytest.mark.timeout(300)
def test_a_port_in_use_is_a_one_line_error_naming_its_key(tmp_path: Path) -> None:
    """The gossip port (peer.listen) or the relay's tunnel listener (peer.relay_port) taken by
    another process: the daemon exits 1 with one line naming the key, no traceback."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        runs = {
            key: subprocess.Popen(
                _peer_command(tmp_path / key, f"--{key}={value}", "--train.steps=5"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for key, value in (
                ("peer.listen", f"127.0.0.1:{port}"),
                ("peer.relay_port", str(port)),
            )
        }
        for key, proc in runs.items():
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 1, (key, out, err)
            assert "Traceback" not in err, err
            errors = [line for line in err.splitlines() if " ERROR " in line]
            assert len(errors) == 1 and key in errors[0] and str(port) in errors[0], err
