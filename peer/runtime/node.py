"""One swarm member's runtime: gRPC server, membership, metrics, and the gossip algorithm.

``Peer`` builds the pieces from the config (the composition root: every collaborator goes to a
constructor) and implements the transport's handler interface; it knows nothing of training
loops (that is GossipOptimizer's job) or tasks (the daemon's).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import grpc
from gossipgrad.peer.algorithms import (
    GossipAlgorithm,
    Identity,
    Neighbourhood,
    anchors_graph,
    build_algorithm,
)
from gossipgrad.peer.algorithms.buffers import BufferAverage
from gossipgrad.peer.algorithms.neighbours import KIND_LABEL, neighbours_in
from gossipgrad.peer.config import PeerConfig
from gossipgrad.peer.flat import FlatParameters, FloatBuffers
from gossipgrad.peer.membership.heartbeats import Membership, PeerListTooLong
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.peer.metrics import UNATTRIBUTED, PeerMetrics
from gossipgrad.peer.network import (
    GossipServer,
    TransportError,
    TransportOptions,
    UpdateRejected,
    protocol,
)
from gossipgrad.peer.network.errors import BindError
from gossipgrad.peer.network.framing import StreamedPayload
from gossipgrad.peer.network.pool import ClientPool
from gossipgrad.peer.network.relay import (
    Attachment,
    RelayDialer,
    RelayHub,
    RelayRoute,
    can_connect,
)
from gossipgrad.peer.runtime.donor import SnapshotCache, SnapshotRefused
from gossipgrad.peer.runtime.joining import StateDownload
from gossipgrad.peer.runtime.reachability import (
    CHECK_TIMEOUT_S,
    UNREACHABLE,
    DialBack,
    NotReachable,
    Reachability,
    tcp_probe,
)
from gossipgrad.peer.runtime.reachability import check as check_dial_back
from gossipgrad.peer.runtime.relaying import ATTACH_TIMEOUT_S, RelayKeeper
from gossipgrad.peer.runtime.state_stream import STATE_FORMAT, StateWriter
from gossipgrad.peer.security import TransportSecurity, resolve_security
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return version("gossipgrad")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


#: What a dense update carries besides the model's values (envelope, headers), at most.
ENVELOPE_BYTES = 1 << 20


def transport_options(cfg: PeerConfig, model_bytes: int) -> TransportOptions:
    """TransportOptions from the [transport] and [security] sections; the size caps left
    unset follow the model: a dense copy plus its envelope for an update, 8 models plus
    64 MiB for a state download."""
    t, s = cfg.transport, cfg.security
    return TransportOptions(
        chunk_size=t.chunk_bytes,
        max_payload_bytes=t.max_payload_bytes or model_bytes + ENVELOPE_BYTES,
        max_state_bytes=t.max_state_bytes or 8 * model_bytes + (64 << 20),
        push_timeout=t.push_timeout,
        min_rate_bytes=t.min_rate_bytes,
        state_timeout=t.state_timeout,
        max_state_downloads=t.max_state_downloads,
        state_rate_bytes=t.state_rate_bytes,
        retries=t.retries,
        max_streams_per_peer=s.max_streams_per_peer,
        peer_rate=s.peer_rate,
        peer_burst=s.peer_burst,
    )


def transport_security(cfg: PeerConfig) -> TransportSecurity | None:
    """Mutual TLS / token / plaintext for this peer (see security.resolve_security).

    Raises ValueError when a non-loopback swarm has neither certificates nor ``insecure``,
    or when the certificate's identity is not ``peer.id``.
    """
    s, p = cfg.security, cfg.peer
    sec = resolve_security(
        s.ca,
        s.cert,
        s.key,
        s.token or os.environ.get("GOSSIPGRAD_TOKEN", ""),
        s.insecure,
        [p.listen, p.advertise, *p.bootstrap],
    )
    if sec is not None and sec.tls and p.id and sec.identity != p.id:
        raise ValueError(
            f"security.cert is issued to {sec.identity!r} but peer.id is {p.id!r}; "
            "use the certificate made for this peer"
        )
    return sec


#: Most (address, peer) pairs :meth:`Peer._wrong_server` logs (each is logged once; beyond
#: this they are only counted, so invented ids cannot grow the set without bound).
MAX_WRONG_SERVERS_LOGGED = 1024

#: Seconds a peer that is done relays on for the peers still attached to it (they detach as
#: they end), before it leaves.
RELAY_LINGER_S = 30.0

#: Listen hosts that bind every interface (not an address another machine can dial).
WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::")


class AddressedSender:
    """Pushes an update to a peer id: address from membership, client from the pool."""

    def __init__(
        self, membership: Membership, clients: ClientPool, options: TransportOptions
    ) -> None:
        self._membership = membership
        self._clients = clients
        self._options = options

    def push(
        self, peer: str, header: pb.UpdateHeader, payload: bytes, patience: float = 1.0
    ) -> tuple[pb.PushReply, int]:
        address = self._membership.address_of(peer)
        if address is None:
            raise ConnectionError(f"no address for peer {peer}")
        client = self._clients.get(address, peer)
        sent_at = time.monotonic()
        try:
            timeout = self._options.push_deadline(len(payload)) * patience
            result = client.push_detailed(header, payload, timeout=timeout)
        except TransportError as err:
            if err.refused:  # its process is gone: tell membership now, not heartbeats later
                self._membership.refused(peer, sent_at)
            raise
        return result.reply, result.wire_bytes


class Peer:
    """A running swarm member around a flat parameter vector: the one place that builds the
    pieces from the config and hands each its collaborators.

    Args:
        cfg: the whole peer config (each component receives only its own section).
        flat: the model's parameters, re-homed into one tensor.
        state_source: returns (step, round, snapshot) for a joining peer's state download,
            the snapshot a ``StateWriter`` (or a serialized blob); called at most once per
            (step, round) reported to :meth:`update_progress`.
        registry: Prometheus registry for this peer's metrics (None: a fresh one).
        state_lock: held by the training thread around optimizer steps, and by the algorithm
            around reading and writing the parameters.
        buffers: the model's floating-point buffers, averaged with the neighbours after each
            round unless ``gossip.buffers = "local"`` (None or empty: the model has none).
    """

    def __init__(
        self,
        cfg: PeerConfig,
        flat: FlatParameters,
        state_source: Callable[[], tuple[int, int, StateWriter | bytes]] | None = None,
        registry=None,
        state_lock: threading.RLock | None = None,
        buffers: FloatBuffers | None = None,
    ) -> None:
        self.cfg = cfg
        self.flat = flat
        self._buffers = buffers
        #: A joiner's state, snapshotted at most once per reported (step, round).
        self.snapshots = SnapshotCache(state_source) if state_source is not None else None
        self.state_lock = state_lock if state_lock is not None else threading.RLock()
        self.metrics = PeerMetrics(registry=registry)
        self.options = transport_options(cfg, flat.nbytes)
        self.security = transport_security(cfg)
        if flat.nbytes + 1024 > self.options.max_payload_bytes:  # + the envelope
            raise ValueError(
                f"the model's dense copy ({flat.nbytes} bytes) does not fit "
                f"transport.max_payload_bytes ({self.options.max_payload_bytes}): a resync "
                "could never be sent; raise transport.max_payload_bytes"
            )
        # (address, peer id) pairs whose server held another member's certificate, logged once
        self._wrong_servers: set[tuple[str, str]] = set()
        self._wrong_servers_lock = threading.Lock()
        self.clients = ClientPool(
            self.options,
            self.security,
            self._dial_target,
            on_wrong_server=self._wrong_server,
        )
        #: As a relay: the peers attached here and their tunnels.
        self.relays = RelayHub(
            cfg.peer.relay_capacity,
            cfg.peer.swarm,
            self.metrics.record_relay_forwarded,
            self._relay_load,
            self.metrics.record_relay_tunnel,
        )
        #: Local endpoints of the peers this one calls through their relays.
        self.relay_dialer = RelayDialer(
            lambda target: pb.RelayOpen(swarm=cfg.peer.swarm, sender=self.id, target=target),
            self._relay_route,
            self.metrics.record_relayed,
        )
        #: This peer's own relay, when nobody can dial it (None: called directly).
        self.relay_keeper: RelayKeeper | None = None
        # peer id -> the relay it was last called through ("": directly)
        self._routes: dict[str, str] = {}
        self.server = GossipServer(
            self,
            bind=cfg.peer.listen,
            options=self.options,
            on_reject=lambda reason, _peer: self.metrics.record_rejected(reason),
            security=self.security,
            relays=self.relays,
        )
        self.topology = topology_from_name(
            cfg.gossip.topology, seed=cfg.train.seed, degree=cfg.gossip.degree
        )
        # Every graph a peer gossips on: its neighbours there are heartbeated as neighbours.
        self.graphs = [self.topology, *filter(None, [anchors_graph(cfg.gossip)])]
        self.id = cfg.peer.id or (self.security.identity if self.security is not None else "")
        self.address = ""
        self.metrics_port = 0
        self.membership: Membership | None = None
        self.neighbourhood: Neighbourhood | None = None
        self.algorithm: GossipAlgorithm | None = None
        self.buffer_average: BufferAverage | None = None
        # Incarnations of the peers seen, and the lock over them: the membership-change
        # handler runs on server, push and membership threads at once.
        self._incarnations: dict[str, int] = {}
        self._membership_lock = threading.RLock()
        self.joining: StateDownload | None = None
        self.dial_back: DialBack | None = None
        #: What :meth:`check_reachability` found (None before it ran).
        self.reachability: Reachability | None = None
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self, checking: bool = False) -> None:
        """Bind the server, then build membership and the algorithm (they need this peer's
        address and id), and start them. Idempotent.

        ``checking``: the caller settles this peer's reachability before it trains
        (:meth:`settle_reachability`, as ``GossipOptimizer.start`` and the daemon do). Until
        :meth:`done_checking` this peer's heartbeats say so
        (``PeerInfo.checking``), and no other peer counts it or mixes with it, nor holds an
        unanswered call against it: without that, a reachable peer waiting for
        ``expected_peers`` would count a peer behind NAT before any call could reach it,
        and train without it."""
        if self._started:
            return
        port = self.server.start()
        self.metrics.mark_serving()
        host = self.cfg.peer.listen.rsplit(":", 1)[0]
        self.address = self.cfg.peer.advertise or f"{host}:{port}"
        if self.relays.capacity > 0 and self.cfg.peer.relay_port >= 0:
            try:
                self.relays.listen(host, self.cfg.peer.relay_port)
            except OSError as err:
                self.server.stop(grace=0)
                raise BindError(
                    f"cannot open the relay's tunnel listener on {host}:"
                    f"{self.cfg.peer.relay_port} (peer.relay_port): {err}"
                ) from err
        if not self.cfg.peer.advertise and host in WILDCARD_HOSTS:
            log.warning(
                "peer.listen %s binds every interface and peer.advertise is empty: other "
                "peers are told %s, which reaches only this machine; set peer.advertise to "
                "the host:port they dial",
                self.cfg.peer.listen,
                self.address,
            )
        if not self.id:
            self.id = f"{socket.gethostname()}-{port}"
        g = self.cfg.gossip
        self.metrics.set_build_info(
            version=package_version(), algorithm=g.algorithm, codec=g.codec, topology=g.topology
        )
        if self.cfg.metrics.enabled:
            self.metrics_port = self.metrics.serve(self.cfg.metrics.host, self.cfg.metrics.port)
        me = pb.PeerInfo(
            id=self.id,
            address=self.address,
            incarnation=time.time_ns(),
            relaying=len(self.relays.attached()),
            relay_port=self.relays.port,
            checking=checking and bool(self.cfg.peer.bootstrap),
            metrics_address=(
                f"{self.cfg.metrics.host}:{self.metrics_port}" if self.cfg.metrics.enabled else ""
            ),
        )
        self.membership = Membership(
            me,
            self.cfg.peer.swarm,
            self.cfg.membership,
            self.cfg.peer.bootstrap,
            heartbeat=self._heartbeat,
            on_change=self._on_membership_change,
            near=lambda ids: set().union(*(neighbours_in(g, self.id, ids) for g in self.graphs)),
        )
        # Which donor a download asks first is random, so joiners arriving together spread.
        self.joining = StateDownload(
            self.membership,
            self.clients,
            self.cfg.peer.swarm,
            self.id,
            self.flat.fingerprint,
            self.metrics,
            self.options.state_timeout,
        )
        dial = self.cfg.transport.dial_target
        self.dial_back = DialBack(
            self.id,
            self._advertised,
            self._dial_back,
            lambda address, timeout: tcp_probe(dial(address), timeout),
        )
        self._build_gossip()
        self.membership.start()
        self._started = True
        log.info("peer %s serving gossip on %s", self.id, self.address)

    def _build_gossip(self) -> None:
        """The neighbour layer over membership, the algorithm on it, the buffers' average."""
        g = self.cfg.gossip
        identity = Identity(self.id, self.cfg.peer.swarm, self.flat.fingerprint, self.flat.nbytes)
        sender = AddressedSender(self.membership, self.clients, self.options)
        self.neighbourhood = Neighbourhood(
            identity, self.membership, self.topology, sender, self.metrics
        )
        self.algorithm = build_algorithm(
            g, self.flat, self.neighbourhood, self.state_lock, self.metrics
        )
        if self._buffers and g.buffers == "average":
            self.buffer_average = BufferAverage(
                self._buffers, g.buffer_codec, self.neighbourhood, self.state_lock, g.buffers_every
            )

    def close(self) -> None:
        """Leave the swarm cleanly: announce, stop threads, stop serving."""
        if not self._started:
            return
        self._started = False
        self._relay_until_detached(RELAY_LINGER_S)
        try:
            self.membership.announce_leaving()
        except Exception as err:  # best effort
            log.debug("announce_leaving failed: %s", err)
        self.membership.stop()
        self.algorithm.close()
        if self.relay_keeper is not None:
            self.relay_keeper.close()
        self.server.stop(grace=0.5)
        self.relays.stop_listening()
        self.relay_dialer.close()
        self.clients.close()
        self.metrics.stop()

    # ------------------------------------------------------------------ outgoing

    def _heartbeat(
        self, address: str, peer_id: str | None, request: pb.HeartbeatRequest, timeout: float
    ) -> pb.HeartbeatReply:
        if (address, peer_id or "") in self._kept_clients():
            reply = self.clients.get(address, peer_id).heartbeat(request, timeout=timeout)
        else:  # a probe of a peer held dead or gone: no channel left behind, reconnecting
            with self.clients.transient(address, peer_id) as client:
                reply = client.heartbeat(request, timeout=timeout)
        if reply.responder.id:
            self.metrics.record_sent(UNATTRIBUTED, "heartbeat", request.ByteSize())
            self.metrics.sent_heartbeats.inc()
        return reply

    def _wrong_server(self, address: str, peer_id: str) -> None:
        """A client dialling ``peer_id`` at ``address`` met another member's certificate:
        counted as ``unauthenticated`` every time, logged once per (address, peer)."""
        self.metrics.record_rejected("unauthenticated")
        with self._wrong_servers_lock:
            first = (address, peer_id) not in self._wrong_servers and (
                len(self._wrong_servers) < MAX_WRONG_SERVERS_LOGGED
            )
            if first:
                self._wrong_servers.add((address, peer_id))
        if first:
            log.warning(
                "the server at %s does not hold %s's certificate: not talking to it as %s "
                "(another member serves there, or %s's certificate predates per-peer names "
                "and must be reissued with 'gossipgrad-peer certs')",
                address,
                peer_id,
                peer_id,
                peer_id,
            )

    def check_reachability(self) -> Reachability:
        """Ask the first bootstrap peer that answers to dial this peer back at its advertised
        address (see :mod:`~gossipgrad.peer.runtime.reachability`); logs the outcome in one
        line and publishes it as ``gossipgrad_reachable``."""
        m = self.membership
        found = check_dial_back(m.bootstrap, self.address, self._introduce, self._ask_dial_back)
        self.reachability = found
        self.metrics.reachable.set(found.gauge)
        if found.status == "reachable":
            log.info("%s", found.summary())
        else:
            log.warning("%s", found.summary())
        return found

    def settle_reachability(
        self, on_verdict: Callable[[Reachability], None] = lambda found: None
    ) -> str:
        """At start: have a bootstrap peer dial this one back (:meth:`check_reachability`;
        ``on_verdict`` hears the outcome at once); if it could not, be called through a
        relay (``peer.relay = "auto"``, :meth:`start_relaying`); then tell the others this
        peer is done checking (:meth:`done_checking`). Returns the relay's id ("" if none).

        An unreachable peer that no member relays for raises NotReachable (a one-line
        error: nobody could push to it) if ``peer.require_reachable`` is set; otherwise it
        is logged, and the peer trains alone."""
        found = self.check_reachability()
        on_verdict(found)
        relay = ""
        if found.status == UNREACHABLE and self.cfg.peer.relay == "auto":
            relay = self.start_relaying()
        self.done_checking()  # called directly, or through its relay, or exits, or alone
        if found.status != UNREACHABLE or relay:
            return relay
        why = (
            "; ".join(f"{k}: {v}" for k, v in sorted(self.relay_refusals.items()))
            or "no member to relay"
            if self.cfg.peer.relay == "auto"
            else "peer.relay = off"
        )
        line = f"not reachable and no relay: {found.summary()}; relays tried: {why}"
        if self.cfg.peer.require_reachable:
            raise NotReachable(f"{line} (peer.require_reachable = false to go on)")
        log.warning("%s; training alone", line)
        return ""

    def done_checking(self) -> None:
        """This peer's reachability is settled (and its relay chosen, if it needs one): the
        others may count it, mix with it and call it from its next heartbeat on."""
        m = self.membership
        if m is not None and m.me.checking:
            m.me.checking = False
            self._on_membership_change()  # the view's digest changed: lists go out again

    def _introduce(self, address: str) -> str:
        """One heartbeat to a bootstrap address, so the member there holds our address from
        our own word (all it will dial back); returns its id."""
        m = self.membership
        request = pb.HeartbeatRequest(swarm=m.swarm, sender=m.me, view_digest=m.view_digest())
        return self._heartbeat(address, None, request, m.heartbeat_timeout).responder.id

    def _ask_dial_back(self, address: str, checker: str) -> pb.ReachabilityReply:
        """``CheckReachability`` to the member ``checker`` at ``address``, on a client pinned
        to it (the bootstrap's unpinned one closes once membership opens a pinned one)."""
        request = pb.ReachabilityRequest(
            swarm=self.cfg.peer.swarm, requester=self.id, address=self.address
        )
        with self.clients.transient(address, checker or None) as client:
            return client.check_reachability(request, timeout=CHECK_TIMEOUT_S)

    def _advertised(self, peer_id: str) -> str | None:
        """The address ``peer_id``'s own word advertised to this peer (None if only hearsay)."""
        rec = self.membership.record(peer_id) if self.membership is not None else None
        return rec.info.address if rec is not None and rec.heard_directly else None

    def _dial_back(self, address: str, peer_id: str, timeout: float) -> str:
        """One heartbeat to ``peer_id`` at ``address`` on a new client pinned to it; the id
        that answered."""
        m = self.membership
        request = pb.HeartbeatRequest(swarm=m.swarm, sender=m.me, view_digest=m.view_digest())
        with self.clients.fresh(address, peer_id) as client:
            return client.heartbeat(request, timeout=timeout).responder.id

    # ------------------------------------------------------------------ relays

    def _relay_until_detached(self, timeout: float) -> None:
        """Before leaving, relay on for the peers attached here until they detach (they end
        too), at most ``timeout`` seconds: peers that finish about together end their last
        exchanges through this peer, rather than alone once it left."""
        deadline = time.monotonic() + timeout
        if self.relays.attached():
            log.info("relaying on for %s until they finish", ", ".join(self.relays.attached()))
        while self.relays.attached() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _relay_load(self, attached: int) -> None:
        """The peers attached here changed: advertise how many (``PeerInfo.relaying``), so
        a peer choosing a relay weighs this one's load (:mod:`~gossipgrad.peer.runtime.
        relaying`)."""
        if self.membership is not None:
            self.membership.me.relaying = attached

    def _dial_target(self, address: str, peer_id: str | None) -> str:
        """Where a client for ``peer_id`` at ``address`` connects: a local relay endpoint if
        the peer is called through a relay, else the address (``transport.dial_via``)."""
        rec = self.membership.record(peer_id) if peer_id and self.membership else None
        if rec is not None and rec.info.relay:
            return self.relay_dialer.endpoint(peer_id)
        return self.cfg.transport.dial_target(address)

    def _relay_route(self, target: str) -> RelayRoute | None:
        """The relay ``target`` is called through now, and how to open a tunnel there."""
        rec = self.membership.record(target) if self.membership is not None else None
        relay = rec.info.relay if rec is not None else ""
        if not relay:
            return None
        if relay == self.id:  # relaying for it ourselves: straight into our own hub
            return RelayRoute(
                relay,
                lambda frames: self.relays.open_local(self.id, frames),
                splice_local=lambda opening, conn: self.relays.open_spliced(opening, self.id, conn),
            )
        relay_rec = self.membership.record(relay)
        if relay_rec is None or relay_rec.info.relay:
            return None
        client = self.clients.get(relay_rec.info.address, relay)
        return RelayRoute(
            relay,
            lambda frames: client.relay_stream(protocol.RELAY, frames),
            self._tunnel_listener(relay_rec.info),
        )

    def _tunnel_listener(self, info: pb.PeerInfo) -> tuple[str, int] | None:
        """Where member ``info``'s raw tunnel listener is dialled (None: it has none, or it
        is reached through ``transport.dial_via``, an emulated link the listener's port
        would bypass)."""
        if not info.relay_port or self.cfg.transport.dial_target(info.address) != info.address:
            return None
        host = info.address.rsplit(":", 1)[0].strip("[]")
        return host, info.relay_port

    def _local_address(self) -> str:
        """This peer's own gossip server as dialled from this host (a tunnel's far end)."""
        host = self.cfg.peer.listen.rsplit(":", 1)[0]
        if host in WILDCARD_HOSTS:
            host = "[::1]" if ":" in host else "127.0.0.1"
        return f"{host}:{self.server.port}"

    def _attach(self, info: pb.PeerInfo) -> Attachment:
        """Attach to member ``info`` as this peer's relay (raises TransportError if it does
        not take this peer)."""
        client = self.clients.get(info.address, info.id)
        splice_at = self._tunnel_listener(info)
        if splice_at is not None and not can_connect(splice_at):
            log.info(
                "relay %s's tunnel listener %s:%d is closed to this peer: tunnels "
                "go through gRPC calls",
                info.id,
                *splice_at,
            )
            splice_at = None
        attachment = Attachment(
            info.id,
            client.attach,
            lambda frames: client.relay_stream(protocol.ACCEPT, frames),
            pb.AttachRequest(swarm=self.cfg.peer.swarm, peer=self.id, splice=bool(splice_at)),
            self._local_address(),
            lambda n: self.metrics.record_relayed(info.id, n),
            splice_at,
        )
        attachment.start(ATTACH_TIMEOUT_S)
        return attachment

    def _round_trip(self, info: pb.PeerInfo) -> tuple[float, pb.PeerInfo]:
        """One heartbeat to member ``info``: its round trip, seconds, and the member's
        PeerInfo as it answered (its load as a relay now)."""
        m = self.membership
        request = pb.HeartbeatRequest(swarm=m.swarm, sender=m.me, view_digest=m.view_digest())
        started = time.monotonic()
        reply = self._heartbeat(info.address, info.id, request, m.heartbeat_timeout)
        return time.monotonic() - started, reply.responder

    def start_relaying(self) -> str:
        """Be called through a relay from now on (see :mod:`~gossipgrad.peer.runtime.
        relaying`): the relay's id, or "" if no member takes this peer (then
        :attr:`relay_refusals` says why)."""
        if self.relay_keeper is None:
            self.relay_keeper = RelayKeeper(
                self.membership, self._round_trip, self._attach, self._relay_changed
            )
        if self.membership.unverified_ids():
            # Members heard of only second hand (the bootstrap's answer is such word) are no
            # candidates until they answer for themselves: probe them now, so the choice
            # does not depend on how far the heartbeat thread's probes have got.
            self.membership.beat_once()
        relay = self.relay_keeper.choose()
        if relay:
            self.relay_keeper.start()
        return relay

    @property
    def relay(self) -> str:
        """The id of the member that relays for this peer ("": called directly)."""
        return self.relay_keeper.relay if self.relay_keeper is not None else ""

    @property
    def relay_refusals(self) -> dict[str, str]:
        """Why the members tried last did not take this peer as a relay."""
        return dict(self.relay_keeper.refusals) if self.relay_keeper is not None else {}

    def _relay_changed(self, relay: str) -> None:
        """This peer chose another relay: its neighbours hear it with the next heartbeats;
        the peer list's digest changed, so the rest hear it in the lists."""
        self._on_membership_change()

    def donors(self) -> list[pb.PeerInfo]:
        """Live peers that have trained (see ``StateDownload.donors``)."""
        return self.joining.donors()

    def download_state(
        self, timeout: float | None = None, min_step: int = 1, patience: float = 0.0
    ) -> tuple[pb.StateHeader, bytes | dict] | None:
        """A donor's state (read as it arrived, or a blob from an older donor), or None if
        no live peer is at ``min_step`` (see ``StateDownload.download``; raises JoinError
        when donors were there but none served within ``patience``)."""
        return self.joining.download(timeout, min_step, patience)

    # ------------------------------------------------------------------ handler (server side)

    def _check_swarm(self, swarm: str) -> None:
        if swarm != self.cfg.peer.swarm:
            self.metrics.record_rejected("unknown_swarm")
            raise UpdateRejected(
                grpc.StatusCode.PERMISSION_DENIED,
                "unknown_swarm",
                f"swarm {swarm!r} is not {self.cfg.peer.swarm!r}",
            )

    def handle_update(
        self, header: pb.UpdateHeader, payload: bytes, context_peer: str = ""
    ) -> pb.PushReply:
        self._check_swarm(header.swarm)
        algorithm = self.algorithm
        if algorithm is None:
            raise UpdateRejected(grpc.StatusCode.UNAVAILABLE, "stale", "peer is starting")
        target = algorithm
        if header.kind == pb.BUFFERS and self.buffer_average is not None:
            target = self.buffer_average
        elif header.kind not in algorithm.kinds:
            self.metrics.record_rejected("malformed")
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "malformed",
                f"update kind {header.kind} is not taken by algorithm {algorithm.name}",
            )
        try:
            reply = target.handle_update(header, payload)
        except UpdateRejected as err:
            self.metrics.record_rejected(err.reason)
            raise
        kind = KIND_LABEL.get(header.kind, "update")
        self.metrics.record_received(header.sender, kind, header.ByteSize() + len(payload))
        return reply

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self._check_swarm(request.swarm)
        if request.sender.id:
            self.metrics.record_received(UNATTRIBUTED, "heartbeat", request.ByteSize())
        try:
            return self.membership.handle_heartbeat(request)
        except PeerListTooLong as err:
            self.metrics.record_rejected("too_large")
            raise UpdateRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large", str(err)
            ) from None

    def handle_state_request(
        self, request: pb.StateRequest
    ) -> tuple[pb.StateHeader, bytes | StreamedPayload]:
        self._check_swarm(request.swarm)
        if self.snapshots is None:
            raise UpdateRejected(grpc.StatusCode.UNAVAILABLE, "stale", "no state to share")
        try:
            step, round_, snapshot = self.snapshots.get(request.requester)
        except SnapshotRefused as err:
            self.metrics.record_rejected("rate_limited")
            raise UpdateRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited", str(err)
            ) from None
        payload, state_format = snapshot, 0
        if isinstance(snapshot, StateWriter):
            if request.state_format >= STATE_FORMAT:  # sent as it is serialized
                payload = StreamedPayload(snapshot.size, snapshot.pieces)
                state_format = STATE_FORMAT
            else:  # an older joiner reads a torch.save blob only
                payload = snapshot.blob()
        size = payload.size if isinstance(payload, StreamedPayload) else len(payload)
        self.metrics.record_sent(request.requester, "state", size)
        return (
            pb.StateHeader(
                sender=self.id,
                step=step,
                round=round_,
                payload_size=size,
                model_fingerprint=self.flat.fingerprint,
                state_format=state_format,
            ),
            payload,
        )

    def handle_reachability(self, request: pb.ReachabilityRequest) -> pb.ReachabilityReply:
        self._check_swarm(request.swarm)
        if self.dial_back is None:
            raise UpdateRejected(grpc.StatusCode.UNAVAILABLE, "stale", "peer is starting")
        try:
            return self.dial_back.handle(request)
        except UpdateRejected as err:
            self.metrics.record_rejected(err.reason)
            raise

    # ------------------------------------------------------------------ membership events

    def _on_membership_change(self) -> None:
        """Bring the algorithm, metrics and clients in line with the peer table. Called on
        server, push and membership threads alike: one runs it at a time, so two threads
        that see one peer leave drop it once (not a KeyError in the second)."""
        with self._membership_lock:
            self._apply_membership()

    def _apply_membership(self) -> None:
        m = self.membership
        counts = m.counts()
        self.metrics.set_peers(
            alive=counts["alive"], suspect=counts["suspect"], dead=counts["dead"]
        )
        if self.algorithm is None:
            return
        present = set(m.present_ids())
        # A peer that restarted (a new incarnation) starts new sessions with us.
        for pid in present - {self.id}:
            rec = m.record(pid)
            if rec is None:
                continue
            known = self._incarnations.get(pid)
            if known is not None and known != rec.info.incarnation:
                self._forget(pid)
            self._incarnations[pid] = rec.info.incarnation
        for pid in set(self._incarnations) - present:
            del self._incarnations[pid]
            self._forget(pid)
        self.algorithm.prune(present)
        if self.buffer_average is not None:
            self.buffer_average.prune(present)
        # Series of peers that left (also ones a late reply re-created): counts move to the
        # departed series. Not those of a peer still checking how it is called (heartbeated,
        # not yet present): it has not left.
        for pid in self.metrics.neighbor_ids - present - set(m.heard_ids()):
            self.metrics.remove_neighbor(pid)
        # A peer called another way now (a relay chosen, or another): its clients reconnect.
        for info in m.known_infos():
            if info.id != self.id and self._routes.get(info.id, "") != info.relay:
                self._routes[info.id] = info.relay
                self.clients.drop(info.address)
        for pid in set(self._routes) - present:
            del self._routes[pid]
        # Channels to peers that left go too (a probe of a dead peer uses one of its own).
        self.clients.prune(self._kept_clients())

    def _kept_clients(self) -> set[tuple[str, str]]:
        """(address, peer id) pairs whose clients the pool keeps: every peer not held dead,
        the bootstraps (id ""), less those at an address whose process is gone (a refused
        call; their probes use a channel of their own, closed after each, as probes of dead
        peers do)."""
        m = self.membership
        gone = m.gone_addresses()
        kept = {(i.address, i.id) for i in m.known_infos()} | {(b, "") for b in m.bootstrap}
        return {k for k in kept if k[0] not in gone}

    def _forget(self, pid: str) -> None:
        """A peer left or restarted: drop what the algorithm and the buffers hold of it."""
        self.algorithm.forget(pid)
        if self.buffer_average is not None:
            self.buffer_average.forget(pid)

    def update_progress(self, step: int, round_: int) -> None:
        """Advertise training progress in heartbeats (joining peers pick the most advanced);
        a state snapshot taken before it is stale from now on."""
        if self.snapshots is not None:
            self.snapshots.progress(step, round_)
        if self.membership is not None:
            self.membership.me.step = step
            self.membership.me.round = round_
