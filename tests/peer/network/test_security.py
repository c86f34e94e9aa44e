"""Authentication and admission: mutual TLS between real peers, and hostile clients refused.

What must hold: peers holding certificates of the swarm CA gossip over mutual TLS and reach
consensus; a client without a certificate or with one from another CA never reaches the
handler; a client with a valid certificate but a forged sender, a wrong swarm, a wrong model
fingerprint or a missing token is refused with the right status, counted in
``gossipgrad_rejected_updates_total{reason}``, and changes nothing; a flooding member is
rate-limited while an honest neighbour's calls all succeed.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from gossipgrad.peer.config import ConfigError, build_config
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.network import PeerClient, TransportError, TransportOptions
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.peer.security import (
    TransportSecurity,
    certificate_identity,
    is_loopback,
    resolve_security,
    write_swarm_certs,
)
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import rejected, start_peer
from support.threads import on_threads
from torch import nn

pytestmark = pytest.mark.timeout(120)

FAST = TransportOptions(retries=0, push_timeout=5.0, heartbeat_timeout=5.0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("certs")
    swarm = write_swarm_certs(root / "swarm", ["p0", "p1", "evil"])
    other = write_swarm_certs(root / "other", ["p1"])
    return swarm, other


def sec_of(paths, pid: str, token: str = "") -> TransportSecurity:
    return TransportSecurity.from_files(paths.ca, paths.certs[pid], paths.keys[pid], token)


def make_peer(pid: str, paths, bootstrap: list[str], seed: int, **extra) -> Peer:
    overrides = {
        "gossip.codec": "int8",
        "gossip.gamma": 0.5,
        "security.ca": str(paths.ca),
        "security.cert": str(paths.certs[pid]),
        "security.key": str(paths.keys[pid]),
        **extra,
    }
    return start_peer(pid, bootstrap, seed, overrides, widths=(20, 10, 3))


def all_rejected(peer: Peer) -> float:
    total = 0.0
    for metric in peer.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "gossipgrad_rejected_updates_total":
                total += s.value
    return total


def test_certificates_name_the_peer_and_chain_to_the_ca(certs) -> None:
    swarm, other = certs
    ca = x509.load_pem_x509_certificate(swarm.ca.read_bytes())
    cert = x509.load_pem_x509_certificate(swarm.certs["p0"].read_bytes())
    cert.verify_directly_issued_by(ca)
    assert certificate_identity(swarm.certs["p0"].read_bytes()) == "p0"
    foreign = x509.load_pem_x509_certificate(other.certs["p1"].read_bytes())
    with pytest.raises((ValueError, Exception)):
        foreign.verify_directly_issued_by(ca)
    assert (swarm.keys["p0"].stat().st_mode & 0o777) == 0o600
    assert (swarm.ca_key.stat().st_mode & 0o777) == 0o600


@pytest.mark.timeout(60)
def test_certs_subcommand_writes_a_usable_swarm(tmp_path: Path) -> None:
    out = tmp_path / "c"
    run = subprocess.run(
        [sys.executable, "-m", "gossipgrad.peer", "certs", "--out", str(out), "a", "b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert certificate_identity((out / "b.pem").read_bytes()) == "b"
    TransportSecurity.from_files(out / "ca.pem", out / "a.pem", out / "a.key")


def test_policy_plaintext_only_on_loopback_or_insecure(caplog: pytest.LogCaptureFixture) -> None:
    assert is_loopback("127.0.0.1:5") and is_loopback("[::1]:7") and is_loopback("localhost:1")
    assert not is_loopback("0.0.0.0:5") and not is_loopback("198.18.0.1:7000")
    assert resolve_security("", "", "", "", False, ["127.0.0.1:0", "[::1]:9"]) is None
    with pytest.raises(ValueError, match="mutual TLS"):
        resolve_security("", "", "", "", False, ["0.0.0.0:7000"])
    with caplog.at_level(logging.WARNING):
        assert resolve_security("", "", "", "", True, ["0.0.0.0:7000"]) is None
    assert "INSECURE" in caplog.text
    with pytest.raises(ConfigError, match="security"):
        build_config({}, {"security.ca": "ca.pem"})
    # A peer on a public address without certificates refuses to start.
    with pytest.raises(ValueError, match="mutual TLS"):
        Peer(build_config({}, {"peer.listen": "0.0.0.0:0"}), FlatParameters(nn.Linear(2, 2)))


def test_certificate_must_match_peer_id(certs) -> None:
    swarm, _ = certs
    cfg = build_config(
        {},
        {
            "peer.id": "p1",
            "security.ca": str(swarm.ca),
            "security.cert": str(swarm.certs["p0"]),
            "security.key": str(swarm.keys["p0"]),
        },
    )
    with pytest.raises(ValueError, match="issued to 'p0'"):
        Peer(cfg, FlatParameters(nn.Linear(2, 2)))


def test_peers_gossip_over_mutual_tls(certs) -> None:
    swarm, _ = certs
    a = make_peer("p0", swarm, [], seed=1)
    b = make_peer("p1", swarm, [a.address], seed=2)
    try:
        deadline = time.monotonic() + 20
        while len(a.membership.present_ids()) < 2 or len(b.membership.present_ids()) < 2:
            assert time.monotonic() < deadline, "TLS peers did not discover each other"
            time.sleep(0.05)
        d0 = float((a.flat.data - b.flat.data).norm())

        def work(p: Peer) -> None:
            for _ in range(25):
                p.algorithm.step_round()

        on_threads(work, [(a,), (b,)])
        d1 = float((a.flat.data - b.flat.data).norm())
        assert d1 < d0 / 5, (d0, d1)
        assert all_rejected(a) == 0 and all_rejected(b) == 0
    finally:
        b.close()
        a.close()


def _heartbeat(sender: str, swarm: str = "gossipgrad") -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(swarm=swarm, sender=pb.PeerInfo(id=sender, address="x:1"))


def _raw_heartbeat(address: str, creds: grpc.ChannelCredentials) -> grpc.StatusCode:
    """One Heartbeat over a hand-made channel; the status code it ended with."""
    with grpc.secure_channel(
        address, creds, options=[("grpc.ssl_target_name_override", "gossipgrad.swarm")]
    ) as channel:
        call = channel.unary_unary(
            "/gossipgrad.v1.Gossip/Heartbeat",
            request_serializer=pb.HeartbeatRequest.SerializeToString,
            response_deserializer=pb.HeartbeatReply.FromString,
        )
        try:
            call(_heartbeat("p1"), timeout=5)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.fixture
def server_peer(certs):
    swarm, _ = certs
    peer = make_peer("p0", swarm, [], seed=3, **{"security.token": "s3cret"})
    try:
        yield peer
    finally:
        peer.close()


def test_clients_without_a_swarm_certificate_fail_the_handshake(certs, server_peer) -> None:
    swarm, other = certs
    before = server_peer.flat.data.clone()
    ca = swarm.ca.read_bytes()
    # 1. plaintext client against the TLS port.
    with (
        PeerClient(server_peer.address, options=FAST) as plain,
        pytest.raises(TransportError) as err,
    ):
        plain.heartbeat(_heartbeat("p1"), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # 2. TLS client that trusts our CA but has no certificate of its own.
    assert _raw_heartbeat(server_peer.address, grpc.ssl_channel_credentials(ca)) in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
    )
    # 3. TLS client with a certificate from another CA (same id, even).
    foreign = sec_of(other, "p1", token="s3cret")
    creds = grpc.ssl_channel_credentials(ca, foreign.key_pem, foreign.cert_pem)
    assert _raw_heartbeat(server_peer.address, creds) in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
    )
    # None of them got a call through: the handler never ran, nothing was learnt.
    assert server_peer.membership.present_ids() == ["p0"]
    assert torch.equal(server_peer.flat.data, before)
    # ... while a member with the right certificate and token gets an answer.
    with PeerClient(server_peer.address, FAST, sec_of(swarm, "p1", "s3cret")) as good:
        reply = good.heartbeat(_heartbeat("p1"), timeout=5)
    assert reply.responder.id == "p0"


def _update(sender: str, fingerprint: str, swarm: str = "gossipgrad") -> pb.UpdateHeader:
    return pb.UpdateHeader(
        swarm=swarm,
        sender=sender,
        receiver="p0",
        seq=0,
        round=0,
        kind=pb.RESYNC,
        model_fingerprint=fingerprint,
    )


@pytest.mark.parametrize(
    ("client", "sender", "swarm_name", "good_fingerprint", "token", "reason", "code"),
    [
        ("p1", "p0", "gossipgrad", True, "s3cret", "unauthenticated", "PERMISSION_DENIED"),
        ("evil", "p1", "gossipgrad", True, "s3cret", "unauthenticated", "PERMISSION_DENIED"),
        ("p1", "p1", "gossipgrad", True, "", "unauthenticated", "UNAUTHENTICATED"),
        ("p1", "p1", "gossipgrad", True, "wrong", "unauthenticated", "UNAUTHENTICATED"),
        ("p1", "p1", "other-swarm", True, "s3cret", "unknown_swarm", "PERMISSION_DENIED"),
        ("p1", "p1", "gossipgrad", False, "s3cret", "fingerprint", "FAILED_PRECONDITION"),
    ],
    ids=["forged-sender", "impersonation", "no-token", "wrong-token", "swarm", "fingerprint"],
)
def test_valid_certificate_but_wrong_claims_is_refused_and_counted(
    certs, server_peer, client, sender, swarm_name, good_fingerprint, token, reason, code
) -> None:
    swarm, _ = certs
    before = server_peer.flat.data.clone()
    fingerprint = server_peer.flat.fingerprint if good_fingerprint else "not-our-model"
    header = _update(sender, fingerprint, swarm_name)
    payload = server_peer.algorithm.dense_codec.encode(torch.zeros_like(before))
    count0 = rejected(server_peer, reason)
    with (
        PeerClient(server_peer.address, FAST, sec_of(swarm, client, token)) as c,
        pytest.raises(TransportError) as err,
    ):
        c.push(header, payload, timeout=5)
    assert err.value.code() == grpc.StatusCode[code], err.value
    assert err.value.reason == reason
    assert rejected(server_peer, reason) == count0 + 1
    assert torch.equal(server_peer.flat.data, before)
    edge = server_peer.algorithm.edges.get(sender)
    assert edge is None or not edge.valid


@pytest.mark.timeout(60)
def test_a_flooding_member_is_rate_limited_and_honest_calls_pass(certs) -> None:
    swarm, _ = certs
    server = make_peer(
        "p0",
        swarm,
        [],
        seed=4,
        **{"security.peer_rate": 20.0, "security.peer_burst": 20},
    )
    stop = threading.Event()
    flood_results: dict[str, int] = {"ok": 0, "limited": 0, "other": 0}
    lock = threading.Lock()

    def flood() -> None:
        with PeerClient(server.address, FAST, sec_of(swarm, "evil")) as c:
            while not stop.is_set():
                try:
                    c.heartbeat(_heartbeat("evil"), timeout=2)
                    key = "ok"
                except TransportError as err:
                    key = "limited" if err.reason == "rate_limited" else "other"
                with lock:
                    flood_results[key] += 1

    threads = [threading.Thread(target=flood) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        honest_ok = 0
        with PeerClient(server.address, FAST, sec_of(swarm, "p1")) as honest:
            for _ in range(15):
                reply = honest.heartbeat(_heartbeat("p1"), timeout=2)
                honest_ok += reply.responder.id == "p0"
                time.sleep(0.1)  # 10 calls/s: within the limit
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        limited = rejected(server, "rate_limited")
        server.close()
    assert honest_ok == 15
    assert flood_results["limited"] > flood_results["ok"]
    assert flood_results["ok"] <= 20 + 20 * 3  # burst + rate * (test seconds, generous)
    assert limited == flood_results["limited"] > 0


def test_a_server_certificate_from_another_ca_fails_the_clients_handshake(certs) -> None:
    """The client checks the server too: an impostor answering with a certificate of the
    right name (p1) but signed by another CA gets no update and no heartbeat from a member."""
    swarm, other = certs
    # The impostor trusts the swarm CA for its clients, so only the client's check of the
    # server certificate can stop the call.
    impostor = make_peer(
        "p1",
        swarm,
        [],
        seed=5,
        **{"security.cert": str(other.certs["p1"]), "security.key": str(other.keys["p1"])},
    )
    try:
        before = impostor.flat.data.clone()
        header = _update("p0", impostor.flat.fingerprint)
        header.receiver = "p1"
        payload = impostor.algorithm.dense_codec.encode(torch.zeros_like(before))
        member = sec_of(swarm, "p0")
        with PeerClient(impostor.address, FAST, member) as c:
            with pytest.raises(TransportError) as err:
                c.push(header, payload, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            with pytest.raises(TransportError) as err:
                c.heartbeat(_heartbeat("p0"), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        # Nothing reached the handler: no member learnt, no byte received, model unchanged.
        assert impostor.membership.present_ids() == ["p1"]
        assert torch.equal(impostor.flat.data, before)
        received = impostor.metrics.registry.get_sample_value(
            "gossipgrad_received_bytes_total", {"neighbor": "p0", "kind": "update"}
        )
        assert not received
        # Control: the same client key trusting the impostor's CA gets through, so it was the
        # server-certificate check that refused above, not the server.
        trusting = TransportSecurity(other.ca.read_bytes(), member.cert_pem, member.key_pem)
        with PeerClient(impostor.address, FAST, trusting) as c:
            assert c.heartbeat(_heartbeat("p0"), timeout=5).responder.id == "p1"
    finally:
        impostor.close()


@pytest.mark.timeout(30)
def test_binding_every_interface_without_advertise_warns(caplog: pytest.LogCaptureFixture) -> None:
    """0.0.0.0 is no address another machine can dial: the peer says so (only started and
    closed here; nothing connects to it)."""
    overrides = {"peer.listen": "0.0.0.0:0", "security.insecure": True, "metrics.enabled": False}
    for extra, warned in [({}, True), ({"peer.advertise": "127.0.0.1:7"}, False)]:
        caplog.clear()
        peer = Peer(build_config({}, {**overrides, **extra}), FlatParameters(nn.Linear(2, 2)))
        with caplog.at_level(logging.WARNING):
            peer.start()
        peer.close()
        assert ("set peer.advertise" in caplog.text) is warned, caplog.text
