"""The server's identity is pinned: a client dialling peer X talks only to a server holding X's
certificate.

Before, a client checked only that the server held *a* swarm certificate, so a member could
answer at its own address in the name of a peer it is not. Real gRPC servers on 127.0.0.1
with real certificates of one swarm CA.
"""

from __future__ import annotations

import datetime
import threading

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from gossipgrad.peer.network import (
    GossipServer,
    PeerClient,
    TransportError,
    TransportOptions,
    WrongServer,
    identity,
)
from gossipgrad.peer.security import (
    SWARM_TLS_NAME,
    TransportSecurity,
    certificate_dns_names,
    peer_tls_name,
    resolve_security,
    write_swarm_certs,
)
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import start_peer

pytestmark = pytest.mark.timeout(60)

FAST = TransportOptions(retries=2, heartbeat_timeout=5.0, push_timeout=5.0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return write_swarm_certs(tmp_path_factory.mktemp("certs"), ["p0", "p1", "evil"])


def sec_of(certs, pid: str) -> TransportSecurity:
    return TransportSecurity.from_files(certs.ca, certs.certs[pid], certs.keys[pid])


def tls_peer(pid: str, certs, seed: int, cert: str = "", key: str = ""):
    overrides = {
        "security.ca": str(certs.ca),
        "security.cert": cert or str(certs.certs[pid]),
        "security.key": key or str(certs.keys[pid]),
    }
    return start_peer(pid, [], seed, overrides, widths=(8, 4, 2))


def beat(sender: str) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(swarm="gossipgrad", sender=pb.PeerInfo(id=sender, address="x:1"))


def old_style_cert(certs, peer_id: str, out) -> tuple[str, str]:
    """A certificate as ``gossipgrad-peer certs`` made them before identity pinning: the
    peer id as common name, only the fixed swarm name as DNS name."""
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SWARM_TLS_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = out / f"{peer_id}-old.pem", out / f"{peer_id}-old.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def test_certificates_carry_their_peers_name(certs) -> None:
    names = certificate_dns_names(certs.certs["p1"].read_bytes())
    assert SWARM_TLS_NAME in names and peer_tls_name("p1") in names
    assert peer_tls_name("p0") not in names
    assert peer_tls_name("P1") != peer_tls_name("p1")  # TLS compares names without case


def test_a_member_serving_under_another_peers_id_is_refused_by_a_dialler(certs) -> None:
    """evil holds its own valid certificate. A client of p0 dialling "p1" at evil's address
    fails before anything is sent (WrongServer, reason unauthenticated, not retried), hears
    of it once per call, and evil's server receives nothing; dialled as evil, or as any
    member, the same server answers."""
    evil = tls_peer("evil", certs, seed=1)
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def wrong(address: str, peer: str) -> None:
        with lock:
            seen.append((address, peer))

    member = sec_of(certs, "p0")
    with PeerClient(evil.address, FAST, member, peer="p1", on_wrong_server=wrong) as c:
        with pytest.raises(WrongServer) as err:
            c.heartbeat(beat("p0"))
        assert err.value.reason == "unauthenticated"
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.attempts == 1  # not retried
        with pytest.raises(WrongServer):
            c.push(pb.UpdateHeader(swarm="gossipgrad", sender="p0", receiver="p1"), b"x" * 64)
    assert seen == [(evil.address, "p1")] * 2
    # The second call took the mismatch from memory (one failed handshake, not three), and
    # so does a new client of the same pair.
    hits = identity.REMEMBERED.hits
    with (
        PeerClient(evil.address, FAST, member, peer="p1") as again,
        pytest.raises(WrongServer),
    ):
        again.heartbeat(beat("p0"))
    assert identity.REMEMBERED.hits == hits + 1
    assert evil.membership.present_ids() == ["evil"]  # no heartbeat reached its handler
    with PeerClient(evil.address, FAST, member, peer="evil") as c:
        assert c.heartbeat(beat("p0")).responder.id == "evil"
    with PeerClient(evil.address, FAST, member) as c:  # a bootstrap: any member will do
        assert c.heartbeat(beat("p0")).responder.id == "evil"


def test_a_server_down_is_not_taken_for_another_member(certs) -> None:
    """A refused connection stays a refused connection (the peer's process is gone), not
    a certificate mismatch: only a handshake that fails where a member's would pass is."""
    p1 = tls_peer("p1", certs, seed=2)
    address = p1.address
    p1.close()
    with (
        PeerClient(address, FAST, sec_of(certs, "p0"), peer="p1") as c,
        pytest.raises(TransportError) as err,
    ):
        c.heartbeat(beat("p0"), timeout=2)
    assert not isinstance(err.value, WrongServer), err.value
    assert err.value.refused, err.value


def test_a_certificate_made_before_pinning_gets_a_clear_error(certs, tmp_path) -> None:
    """Its own: the peer refuses to start, saying to reissue it. Another peer's: a client
    dialling that peer is refused with WrongServer, whose detail says the same."""
    cert, key = old_style_cert(certs, "p1", tmp_path)
    with pytest.raises(ValueError, match="reissue it with 'gossipgrad-peer certs"):
        resolve_security(str(certs.ca), cert, key, "", False, ["127.0.0.1:0"])
    # A server holding it (started on the transport alone, as an older peer would run).
    old = TransportSecurity.from_files(certs.ca, cert, key)
    evil = tls_peer("evil", certs, seed=3)
    server = GossipServer(evil, security=old)
    port = server.start()
    try:
        with (
            PeerClient(f"127.0.0.1:{port}", FAST, sec_of(certs, "p0"), peer="p1") as c,
            pytest.raises(WrongServer, match="reissued with 'gossipgrad-peer certs'"),
        ):
            c.heartbeat(beat("p0"))
    finally:
        server.stop(grace=0)
