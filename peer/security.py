"""Peer authentication: a swarm CA, peer certificates, TLS credentials and peer identity.

Trust model (SECURITY.md): every member of a swarm holds a certificate signed by the swarm's
own CA, and both ends of every gossip connection present one (mutual TLS). A peer's identity
is the common name of its certificate, which must equal its ``peer.id``; the transport refuses
any call whose claimed sender differs from the certificate it came with. An optional shared
swarm token rides on top as call metadata.

Clients verify the server's certificate against the swarm CA and against the member they
dialled, never against the host name: every peer certificate carries, as DNS names, the fixed
:data:`SWARM_TLS_NAME` and its own :func:`peer_tls_name`, so certificates need not know the
sites' addresses. A client dialling peer X at the address held for it asks for X's name
(:meth:`TransportSecurity.channel_args`), so a member holding only its own certificate cannot
answer as X; a client dialling an address whose peer it does not know yet (a bootstrap) asks
for :data:`SWARM_TLS_NAME`, i.e. any member, and takes what it hears there as hearsay.

Example::

    paths = write_swarm_certs(Path("certs"), ["site-a", "site-b"])
    sec = TransportSecurity.from_files(paths.ca, paths.certs["site-a"], paths.keys["site-a"])
    server = GossipServer(handler, bind="0.0.0.0:7000", security=sec)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

#: DNS name every peer certificate carries; a client that does not know which member it
#: dials (a bootstrap address) verifies the server against it.
SWARM_TLS_NAME = "gossipgrad.swarm"

#: Parent domain of the per-peer names (:func:`peer_tls_name`).
PEER_NAME_DOMAIN = "id." + SWARM_TLS_NAME

#: Call metadata key carrying the optional swarm token.
TOKEN_METADATA_KEY = "gossipgrad-token"

_ONE_DAY = datetime.timedelta(days=1)


# ------------------------------------------------------------------------------ certificates


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gossipgrad"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_ca(name: str = "gossipgrad swarm CA", days: int = 3650) -> tuple[bytes, bytes]:
    """A new self-signed swarm CA; returns (certificate PEM, private key PEM)."""
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = _name(name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _ONE_DAY)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def peer_tls_name(peer_id: str) -> str:
    """The DNS name that pins ``peer_id``'s certificate: a client dialling that peer accepts
    only a server certificate carrying it.

    A peer id may hold characters a DNS name may not, and TLS compares names without case,
    so the name is a digest of the id (128 bits: no member can be issued a colliding id).
    """
    digest = hashlib.sha256(peer_id.encode()).hexdigest()[:32]
    return f"{digest}.{PEER_NAME_DOMAIN}"


def _san(peer_id: str, hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [
        x509.DNSName(SWARM_TLS_NAME),
        x509.DNSName(peer_tls_name(peer_id)),
    ]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_peer_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    peer_id: str,
    hosts: Sequence[str] = (),
    days: int = 825,
) -> tuple[bytes, bytes]:
    """A certificate for ``peer_id`` signed by the swarm CA; returns (cert PEM, key PEM).

    The common name is the peer id (its identity in the swarm); the certificate is valid for
    both TLS client and server use. Its subject alternative names are :data:`SWARM_TLS_NAME`,
    the peer's :func:`peer_tls_name` (what clients dialling it check) and ``hosts`` (names or
    IPs) for tools that verify host names.
    """
    if not peer_id or len(peer_id) > 64:
        raise ValueError(f"peer id must be 1-64 characters, got {peer_id!r}")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(peer_id))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _ONE_DAY)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_san(peer_id, hosts)), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def certificate_identity(cert_pem: bytes) -> str:
    """The peer id a certificate stands for (its common name)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ValueError("certificate has no common name")
    value = names[0].value
    return value if isinstance(value, str) else value.decode()


def certificate_dns_names(cert_pem: bytes) -> list[str]:
    """The DNS names among a certificate's subject alternative names."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.DNSName)


def check_pinnable(cert_pem: bytes, where: str = "security.cert") -> None:
    """Raise ValueError, saying to reissue it, if a peer certificate lacks its per-peer name.

    Certificates made before identity pinning carry only :data:`SWARM_TLS_NAME`: every
    client dialling such a peer would refuse it, so the peer must not start with one.
    """
    identity = certificate_identity(cert_pem)
    if peer_tls_name(identity) not in certificate_dns_names(cert_pem):
        raise ValueError(
            f"{where}: the certificate of {identity!r} does not carry its per-peer name "
            f"{peer_tls_name(identity)} (it was made by an older 'gossipgrad-peer certs'), "
            "so other peers would refuse to reach it; reissue it with "
            f"'gossipgrad-peer certs --out <dir holding ca.pem and ca.key> {identity}'"
        )


@dataclasses.dataclass(frozen=True)
class SwarmCertPaths:
    """Where :func:`write_swarm_certs` put things."""

    ca: Path
    ca_key: Path
    certs: dict[str, Path]
    keys: dict[str, Path]


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_swarm_certs(
    out: Path,
    peer_ids: Sequence[str],
    hosts: dict[str, Sequence[str]] | None = None,
    days: int = 825,
) -> SwarmCertPaths:
    """Create (or reuse) the swarm CA in ``out`` and a certificate for each peer id.

    Files: ``ca.pem``, ``ca.key`` (keep it off the peers), ``<id>.pem``, ``<id>.key``. An
    existing CA is reused so peers can be added later; keys are written mode 0600.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ca_path, ca_key_path = out / "ca.pem", out / "ca.key"
    if ca_path.exists() and ca_key_path.exists():
        ca_pem, ca_key_pem = ca_path.read_bytes(), ca_key_path.read_bytes()
    else:
        ca_pem, ca_key_pem = make_ca()
        ca_path.write_bytes(ca_pem)
        _write_private(ca_key_path, ca_key_pem)
        log.info("new swarm CA in %s", ca_path)
    certs, keys = {}, {}
    for pid in peer_ids:
        cert_pem, key_pem = make_peer_cert(
            ca_pem, ca_key_pem, pid, (hosts or {}).get(pid, ()), days=days
        )
        certs[pid], keys[pid] = out / f"{pid}.pem", out / f"{pid}.key"
        certs[pid].write_bytes(cert_pem)
        _write_private(keys[pid], key_pem)
    return SwarmCertPaths(ca_path, ca_key_path, certs, keys)


# ------------------------------------------------------------------------------ credentials


@dataclasses.dataclass(frozen=True, repr=False)
class TransportSecurity:
    """TLS material and token of one peer; the transport builds its credentials from it.

    Attributes:
        ca_pem: the swarm CA certificate (verifies the other end).
        cert_pem / key_pem: this peer's certificate chain and private key.
        token: optional shared swarm secret sent with every call ("" = none).
    """

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    token: str = ""

    @classmethod
    def from_files(
        cls, ca: Path | str, cert: Path | str, key: Path | str, token: str = ""
    ) -> TransportSecurity:
        """Load PEM files; raises FileNotFoundError / ValueError naming the bad file."""
        data = {}
        for what, path in (("ca", ca), ("cert", cert), ("key", key)):
            blob = Path(path).read_bytes()
            if b"-----BEGIN" not in blob:
                raise ValueError(f"security.{what}: {path} is not a PEM file")
            data[what] = blob
        return cls(data["ca"], data["cert"], data["key"], token)

    @property
    def tls(self) -> bool:
        """Whether there is TLS material (False: plaintext carrying only a token)."""
        return bool(self.cert_pem)

    @property
    def identity(self) -> str:
        """This peer's id according to its certificate ("" without TLS)."""
        return certificate_identity(self.cert_pem) if self.tls else ""

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side of mutual TLS: clients must present a cert signed by the swarm CA."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side of mutual TLS (see :data:`SWARM_TLS_NAME` for the name check)."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )

    def channel_args(self, peer_id: str | None = None) -> list[tuple[str, str]]:
        """gRPC channel arguments a TLS client needs: the name the server's certificate must
        carry, ``peer_id``'s own (:func:`peer_tls_name`), or any member's without one."""
        name = peer_tls_name(peer_id) if peer_id else SWARM_TLS_NAME
        return [("grpc.ssl_target_name_override", name)]

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent with every call (the token, if any)."""
        return ((TOKEN_METADATA_KEY, self.token),) if self.token else ()

    def token_ok(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """Whether the call's metadata carries this swarm's token (constant-time compare)."""
        if not self.token:
            return True
        for key, value in metadata:
            if key == TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self.token.encode())
        return False


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The common name of the client certificate of a call, or None without TLS."""
    try:
        auth = context.auth_context()
    except Exception:  # pragma: no cover - very old grpc
        return None
    names = auth.get("x509_common_name") or ()
    if not names:
        return None
    value = names[0]
    return value.decode() if isinstance(value, bytes) else str(value)


# ------------------------------------------------------------------------------ policy


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` (or a bare host) names a loopback address or ``localhost``."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]" in address else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_security(
    ca: str,
    cert: str,
    key: str,
    token: str,
    insecure: bool,
    addresses: Iterable[str],
) -> TransportSecurity | None:
    """Decide how this peer talks: mutual TLS, or plaintext (None, or a token-only object).

    1. ``ca``/``cert``/``key`` set: mutual TLS with these files (``insecure`` must be off).
    2. Else every address (listen, advertise, bootstrap) is loopback: plaintext, as a
       single-machine swarm has no network to protect (tests, the local swarm runner).
    3. Else plaintext only with ``insecure``, logged as a warning; without it a ValueError
       saying what to configure.
    """
    given = [name for name, v in (("ca", ca), ("cert", cert), ("key", key)) if v]
    addresses = [a for a in addresses if a]
    if given:
        if len(given) != 3:
            raise ValueError("security: set all of ca, cert and key, or none of them")
        if insecure:
            raise ValueError("security: insecure = true contradicts ca/cert/key; drop one")
        sec = TransportSecurity.from_files(ca, cert, key, token)
        check_pinnable(sec.cert_pem, f"security.cert {cert}")
        log.info("gossip over mutual TLS as %s", sec.identity)
        return sec
    if insecure:
        log.warning(
            "INSECURE: gossip runs over plaintext gRPC without authentication (--insecure); "
            "anyone who reaches %s can read and send updates",
            ", ".join(addresses) or "this peer",
        )
        return TransportSecurity(b"", b"", b"", token) if token else None
    remote = [a for a in addresses if not is_loopback(a)]
    if remote:
        raise ValueError(
            f"security: {', '.join(remote)} is not a loopback address, so gossip needs "
            "mutual TLS: set security.ca, security.cert and security.key (make them with "
            "'gossipgrad-peer certs'), or pass --insecure to run plaintext anyway"
        )
    if token:
        log.info("loopback swarm: plaintext gRPC with a swarm token")
        return TransportSecurity(b"", b"", b"", token)
    log.info("loopback-only swarm: plaintext gRPC (no certificates configured)")
    return None
