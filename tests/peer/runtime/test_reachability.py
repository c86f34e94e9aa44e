"""Issue 45, first slice: a peer learns at start whether the other members can dial it.

A bootstrap peer dials the starting peer back at the address it advertises (a heartbeat on a
new client pinned to its certificate), and dials nothing else. In-process peers on
127.0.0.1:0 with real mutual TLS for the member's side; real ``gossipgrad-peer`` processes for
the exit status and status.json. An address nobody can dial is a port bound, then closed;
one that drops inbound packets lives in a network namespace the test makes (root and ``ip``).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from gossipgrad.peer.network import PeerClient, TransportError, TransportOptions, protocol
from gossipgrad.peer.records import PeerStatus, read_record
from gossipgrad.peer.runtime import node, reachability
from gossipgrad.peer.runtime.reachability import DIAL_BACK_TIMEOUT_S, DIAL_BACKS_BURST
from gossipgrad.peer.security import TransportSecurity, write_swarm_certs
from gossipgrad.proto import gossip_pb2 as pb
from support import TESTS
from support.listeners import CountingListener
from support.netlab import netlab_unavailable
from support.peers import start_peer

pytestmark = pytest.mark.timeout(120)

BIN = Path(sys.executable).parent
OPTIONS = TransportOptions(retries=0, heartbeat_timeout=5.0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return write_swarm_certs(tmp_path_factory.mktemp("certs"), ["p0", "p1", "evil"])


def tls(certs, pid: str) -> dict[str, str]:
    return {
        "security.ca": str(certs.ca),
        "security.cert": str(certs.certs[pid]),
        "security.key": str(certs.keys[pid]),
    }


def closed_port() -> str:
    """A 127.0.0.1 address where nothing listens: a port bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def listener() -> Iterator[CountingListener]:
    lis = CountingListener()
    yield lis
    lis.close()


# --- the check, in-process ------------------------------------------------------------------


def test_a_normal_peer_is_reachable_and_the_first_is_unknown(certs) -> None:
    p0 = start_peer("p0", [], 1, tls(certs, "p0"), widths=(8, 4, 2))
    p1 = start_peer("p1", [p0.address], 2, tls(certs, "p1"), widths=(8, 4, 2))
    first = p0.check_reachability()
    assert (first.status, first.cause, first.checker) == ("unknown", "first_peer", "")
    assert p0.metrics.registry.get_sample_value("gossipgrad_reachable") == -1
    found = p1.check_reachability()
    assert (found.status, found.address, found.checker) == ("reachable", p1.address, "p0")
    assert p1.metrics.registry.get_sample_value("gossipgrad_reachable") == 1


def test_an_address_where_nothing_listens_is_unreachable_refused(certs) -> None:
    p0 = start_peer("p0", [], 1, tls(certs, "p0"), widths=(8, 4, 2))
    nowhere = closed_port()
    p1 = start_peer(
        "p1", [p0.address], 2, {**tls(certs, "p1"), "peer.advertise": nowhere}, widths=(8, 4, 2)
    )
    found = p1.check_reachability()
    assert (found.status, found.cause, found.address, found.checker) == (
        "unreachable",
        "refused",
        nowhere,
        "p0",
    )
    assert p1.metrics.registry.get_sample_value("gossipgrad_reachable") == 0


def test_a_port_that_never_speaks_grpc_is_unreachable_within_the_deadline(certs) -> None:
    """A port that takes the TCP connection and then says nothing: unreachable, something
    else listening there (no TLS or HTTP/2 answer within the dial-back's deadline, and a bare
    connection is taken), and the check waits no longer than that deadline."""
    p0 = start_peer("p0", [], 1, tls(certs, "p0"), widths=(8, 4, 2))
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        p1 = start_peer(
            "p1", [p0.address], 2, {**tls(certs, "p1"), "peer.advertise": address}, (8, 4, 2)
        )
        started = time.monotonic()
        found = p1.check_reachability()
        took = time.monotonic() - started
    assert (found.status, found.cause, found.checker) == ("unreachable", "wrong_identity", "p0")
    assert took < DIAL_BACK_TIMEOUT_S + 2


@pytest.fixture
def dropping_netns() -> Iterator[tuple[str, str]]:
    """A network namespace of the test's own whose 198.18.7.2 swallows every packet: a veth
    pair inside it, the far end's MAC address made up (no ARP answer, no reset, no ICMP),
    as a NAT or firewall dropping inbound connections looks from outside."""
    why = netlab_unavailable()
    if why is not None:
        pytest.skip(why)
    ns = f"ggr{uuid.uuid4().hex[:6]}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, timeout=10)

    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
    try:
        ip("link", "set", "lo", "up")
        ip("link", "add", "v0", "type", "veth", "peer", "name", "v1")
        ip("addr", "add", "198.18.7.1/24", "dev", "v0")
        ip("link", "set", "v0", "up")
        ip("link", "set", "v1", "up")
        ip("neigh", "add", "198.18.7.2", "lladdr", "02:00:00:00:07:02", "dev", "v0")
        yield ns, "198.18.7.2:7000"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_an_address_whose_packets_are_dropped_is_unreachable_timed_out(
    dropping_netns: tuple[str, str],
) -> None:
    ns, dropped = dropping_netns
    script = str(TESTS / "support" / "reach_dropped.py")
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, script, dropped],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert (found["status"], found["cause"], found["checker"]) == (
        "unreachable",
        "timed_out",
        "p0",
    )
    # Silence is asked about twice before it stops the peer, each dial-back its deadline.
    assert 2 * DIAL_BACK_TIMEOUT_S - 1 < found["seconds"] < 2 * DIAL_BACK_TIMEOUT_S + 3


def test_another_member_at_the_advertised_address_is_the_wrong_identity(certs) -> None:
    """p1 advertises the address where 'evil' serves: the dial-back, pinned to p1's name,
    does not take evil's certificate for p1's."""
    p0 = start_peer("p0", [], 1, tls(certs, "p0"), widths=(8, 4, 2))
    evil = start_peer("evil", [], 3, tls(certs, "evil"), widths=(8, 4, 2))
    p1 = start_peer(
        "p1",
        [p0.address],
        2,
        {**tls(certs, "p1"), "peer.advertise": evil.address},
        widths=(8, 4, 2),
    )
    found = p1.check_reachability()
    assert (found.status, found.cause, found.checker) == ("unreachable", "wrong_identity", "p0")


@pytest.fixture
def older_member() -> Iterator[str]:
    """A gossip server of a version before the check: it answers heartbeats only (gRPC
    answers UNIMPLEMENTED to CheckReachability). Its address."""
    reply = pb.HeartbeatReply(responder=pb.PeerInfo(id="old", address="", incarnation=1))
    handler = grpc.method_handlers_generic_handler(
        protocol.SERVICE,
        {
            protocol.HEARTBEAT: grpc.unary_unary_rpc_method_handler(
                lambda request, context: reply,
                request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatReply.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=(handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


def test_a_member_too_old_to_check_leaves_reachability_unknown(
    older_member: str,
) -> None:
    p1 = start_peer("p1", [older_member], 2, widths=(8, 4, 2))
    found = p1.check_reachability()
    assert (found.status, found.cause) == ("unknown", "not_supported")
    assert p1.metrics.registry.get_sample_value("gossipgrad_reachable") == -1


# --- the member's side: only what was advertised, rate-limited -------------------------------


def ask(client: PeerClient, requester: str, address: str) -> pb.ReachabilityReply:
    request = pb.ReachabilityRequest(swarm="gossipgrad", requester=requester, address=address)
    return client.check_reachability(request, timeout=10.0)


def test_the_member_dials_back_only_the_address_the_caller_advertised_for_itself(
    certs, listener: CountingListener
) -> None:
    """As member p1 (its real certificate): asking for an address p1 never advertised, or
    for another member's id, is refused and nothing is dialled; the advertised address is
    dialled (the listener counts it, so a dial would be seen), and only
    DIAL_BACKS_BURST times in a row."""
    p0 = start_peer("p0", [], 1, tls(certs, "p0"), widths=(8, 4, 2))
    bystander = CountingListener()
    sec = TransportSecurity.from_files(certs.ca, certs.certs["p1"], certs.keys["p1"])
    try:
        with PeerClient(p0.address, OPTIONS, sec) as client:
            # Not yet advertised at all.
            with pytest.raises(TransportError) as info:
                ask(client, "p1", listener.address)
            assert (info.value.code(), info.value.reason) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "unknown_sender",
            )
            me = pb.PeerInfo(id="p1", address=listener.address, incarnation=time.time_ns())
            client.heartbeat(pb.HeartbeatRequest(swarm="gossipgrad", sender=me), timeout=5)
            # Advertised one address, asks for another.
            with pytest.raises(TransportError) as info:
                ask(client, "p1", bystander.address)
            assert (info.value.code(), info.value.reason) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "unknown_sender",
            )
            # Another member's id: the certificate says p1.
            with pytest.raises(TransportError) as info:
                ask(client, "evil", bystander.address)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # The advertised address is dialled (and is no p1 server).
            for _ in range(DIAL_BACKS_BURST):
                reply = ask(client, "p1", listener.address)
                assert reply.checker == "p0"
                assert reply.result != pb.ReachabilityReply.REACHABLE
            assert listener.accepted >= 1
            with pytest.raises(TransportError) as info:
                ask(client, "p1", listener.address)
            assert (info.value.code(), info.value.reason) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "rate_limited",
            )
        time.sleep(0.5)
        assert bystander.accepted == 0
        rejected = p0.metrics.registry.get_sample_value(
            "gossipgrad_rejected_updates_total", {"reason": "unknown_sender"}
        )
        assert rejected == 2
    finally:
        bystander.close()


# --- the daemon: a one-line error and a non-zero exit, unless opted out -----------------------


def _daemon(run_dir: Path, bootstrap: str, advertise: str, *extra: str) -> list[str]:
    return [
        str(BIN / "gossipgrad-peer"),
        f"--peer.id=natted-{run_dir.name}",  # one id per daemon: each its own address
        f"--peer.run_dir={run_dir}",
        f"--peer.bootstrap={bootstrap}",
        f"--peer.advertise={advertise}",
        "--peer.start_timeout=20",
        "--train.task=digits",
        "--train.steps=2",
        "--train.eval_every=0",
        "--train.threads=1",
        "--metrics.enabled=false",
        "--checkpoint.every=0",
        "--gossip.round_timeout=1",
        *extra,
    ]


@pytest.mark.timeout(300)
def test_an_unreachable_daemon_without_a_relay_exits_non_zero_unless_opted_out(
    tmp_path: Path,
) -> None:
    """The only member relays for nobody (peer.relay_capacity = 0): no relay, so the strict
    daemon stops with the one-line error, the lenient one trains alone."""
    p0 = start_peer("p0", [], 1, {"peer.relay_capacity": 0}, widths=(8, 4, 2))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    strict_dir, lenient_dir = tmp_path / "strict", tmp_path / "lenient"
    # Both at once (each costs an interpreter start); each advertises a port of its own.
    strict = subprocess.Popen(
        _daemon(strict_dir, p0.address, closed_port()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lenient = subprocess.Popen(
        _daemon(lenient_dir, p0.address, closed_port(), "--peer.require_reachable=false"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _, err = strict.communicate(timeout=240)
        assert strict.returncode == 1, err
        assert "Traceback" not in err
        assert "not reachable and no relay: NOT reachable at" in err
        assert "p0: RESOURCE_EXHAUSTED: rate_limited: relaying for 0 peers" in err
        status = read_record(strict_dir / "status.json", PeerStatus)
        assert status is not None and status.reachability is not None
        assert (status.reachability.status, status.reachability.cause) == ("unreachable", "refused")
        assert status.reachability.checker == "p0"
        assert status.id == "natted-strict"
        assert status.step == 0 and status.state == "starting"  # never trained
        assert status.relay == ""
        _, err = lenient.communicate(timeout=240)
        assert lenient.returncode == 0, err
        status = read_record(lenient_dir / "status.json", PeerStatus)
        assert status is not None and status.state == "done" and status.step == 2
        assert status.reachability is not None
        assert (status.reachability.status, status.reachability.cause) == ("unreachable", "refused")
    finally:
        for proc in (strict, lenient):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(120)
def test_two_daemons_each_the_others_bootstrap_check_each_other_and_train_together(
    tmp_path: Path,
) -> None:
    """Two sites given one bootstrap list start at once: each finds the other while both
    are still checking their reachability (neither counts the other before that), each
    dials the other back, and they train together from step 0."""
    ports = [closed_port() for _ in range(2)]  # free now; each daemon binds its own
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(2):
        run_dir = tmp_path / f"site{i}"
        cmd = [
            str(BIN / "gossipgrad-peer"),
            "--insecure",
            f"--peer.id=site{i}",
            f"--peer.listen={ports[i]}",
            f"--peer.run_dir={run_dir}",
            f"--peer.bootstrap={ports[1 - i]}",
            "--peer.expected_peers=2",
            "--peer.start_timeout=30",
            "--train.steps=30",
            "--train.eval_every=0",
            "--train.threads=1",
            "--metrics.enabled=false",
            "--checkpoint.every=0",
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    try:
        for i, proc in enumerate(procs):
            _, err = proc.communicate(timeout=100)
            assert proc.returncode == 0, err[-3000:]
            status = read_record(tmp_path / f"site{i}" / "status.json", PeerStatus)
            assert status is not None and status.state == "done" and status.step == 30
            assert status.reachability is not None
            # Each asks the other to dial it back; under a loaded suite one check came back
            # unknown (no answer in time: not an error, and not the race tested here).
            assert status.reachability.status in ("reachable", "unknown"), status.reachability
            assert status.joined_at_step in (None, 0)
        summary = json.loads((tmp_path / "site0" / "summary.json").read_text())
        exchanges = sum(summary["exchanges"].values())
        assert exchanges >= 25, summary["exchanges"]  # mixed through the run
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("attempts", [reachability.CHECK_ATTEMPTS, 1])
def test_a_check_that_got_no_answer_asks_the_same_peer_again(
    certs, attempts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check call that ends without any answer (here the bootstrap peer starts listening
    only after the first attempt, as in a swarm's start-up) is made again, after a pause:
    a start-up race once left a NAT'd site's check "unknown", and it trained alone. Asked
    once only (attempts = 1, as before), the same start-up ends "unknown"."""
    where = closed_port()
    members: list = []

    def pause(seconds: float) -> None:
        if not members:  # the bootstrap peer comes up during the first pause
            overrides = {**tls(certs, "p0"), "peer.listen": where}
            members.append(start_peer("p0", [], 1, overrides, widths=(8, 4, 2)))
        time.sleep(seconds)

    monkeypatch.setattr(reachability, "CHECK_ATTEMPTS", attempts)
    monkeypatch.setattr(node, "check_dial_back", functools.partial(reachability.check, pause=pause))
    p1 = start_peer("p1", [where], 2, tls(certs, "p1"), widths=(8, 4, 2))
    found = p1.check_reachability()
    if attempts > 1:
        assert (found.status, found.checker) == ("reachable", "p0")
    else:
        assert (found.status, found.cause) == ("unknown", "no_answer")
        assert not members  # it never paused to ask again
