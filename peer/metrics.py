"""Prometheus metrics of one gossipgrad peer: every metric family is declared in this module.

Names, label values and buckets are declared in :mod:`gossipgrad.peer.metric_vocabulary`.

The peer's own id is not a metric label: it reaches Prometheus as the ``peer`` target label set
by the scrape config (``scripts/prometheus_config.py``), so one exporter never repeats its own
id on every series.

Every :class:`PeerMetrics` owns its registry (a fresh :class:`CollectorRegistry` unless one is
passed in), so tests and several peers in one process never collide on the global registry.

Example::

    m = PeerMetrics()
    m.set_build_info(version="0.1.0", algorithm="choco", codec="topk:0.01+int8", topology="ring")
    m.add_neighbor("site-b")
    m.record_sent("site-b", "update", wire_bytes=23_000, dense_bytes=4_000_000)
    port = m.serve()          # http://127.0.0.1:<port>/metrics
    ...
    m.stop()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping

from gossipgrad.peer.metric_vocabulary import (
    COMPRESS_BUCKETS,
    DEPARTED,
    MAX_EVAL_METRICS,
    MESSAGE_KINDS,
    PEER_STATES,
    PREFIX,
    PUSH_BUCKETS,
    ROUND_BUCKETS,
    UNATTRIBUTED,
)
from gossipgrad.peer.network.errors import REJECT_REASONS
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")


def _check_amount(value: float, what: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")


class PeerMetrics:
    """All metrics one peer exports, on a registry of its own.

    Args:
        registry: where to register; ``None`` makes a fresh :class:`CollectorRegistry`.

    Thread-safe (prometheus-client's metrics are); the HTTP endpoint runs in a daemon thread.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._traffic_metrics(r)
        self._training_metrics(r)
        self._gossip_metrics(r)
        self._health_metrics(r)
        for reason in REJECT_REASONS:
            self.rejected_updates.labels(reason=reason)
        for state in PEER_STATES:
            self.peers.labels(state=state)

        self._neighbor_ids: set[str] = set()
        self._eval_names: set[str] = set()
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._serving_since: float | None = None  # time.monotonic() at mark_serving
        self._mixed_once = False

    def _traffic_metrics(self, r: CollectorRegistry) -> None:
        self.sent_bytes = Counter(
            _name("sent_bytes"),
            "Bytes this peer put on the wire to a neighbour, by message kind.",
            ["neighbor", "kind"],
            registry=r,
        )
        self.received_bytes = Counter(
            _name("received_bytes"),
            "Bytes this peer received from a neighbour, by message kind.",
            ["neighbor", "kind"],
            registry=r,
        )
        self.sent_heartbeats = Counter(
            _name("sent_heartbeats"),
            "Heartbeats this peer sent that were answered (membership messages; their bytes "
            "are sent_bytes{kind='heartbeat'}).",
            registry=r,
        )
        self.dense_bytes = Counter(
            _name("dense_bytes"),
            "Bytes the updates sent to a neighbour would have cost as dense fp32 "
            "(compression ratio = dense_bytes / sent_bytes{kind='update'}).",
            ["neighbor"],
            registry=r,
        )

    def _training_metrics(self, r: CollectorRegistry) -> None:
        self.train_steps = Counter(_name("train_steps"), "Local optimizer steps taken.", registry=r)
        self.samples = Counter(_name("samples"), "Training samples consumed.", registry=r)
        self.train_loss = Gauge(
            _name("train_loss"), "Training loss of the latest local step.", registry=r
        )
        self.eval_metric = Gauge(
            _name("eval_metric"),
            "Latest evaluation result of the local model, by metric name (accuracy, ...).",
            ["name"],
            registry=r,
        )

    def _gossip_metrics(self, r: CollectorRegistry) -> None:
        self.gossip_rounds = Counter(_name("gossip_rounds"), "Gossip rounds completed.", registry=r)
        self.round_duration = Histogram(
            _name("round_duration_seconds"),
            "Wall time of one gossip round (local steps excluded).",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.push_duration = Histogram(
            _name("push_duration_seconds"),
            "Wall time to push one update to a neighbour, until it acknowledged.",
            ["neighbor"],
            buckets=PUSH_BUCKETS,
            registry=r,
        )
        self.gossip_blocking = Counter(
            _name("gossip_blocking_seconds"),
            "Wall time the training thread spent blocked in gossip (rounds, gradient "
            "exchanges, the end of the run); compute utilization = 1 - rate() of this.",
            registry=r,
        )
        self.alone_seconds = Counter(
            _name("alone_seconds"),
            "Seconds a round waited because no other peer was alive while some were suspect "
            "(instead of training alone and racing ahead).",
            registry=r,
        )
        self.compress_duration = Histogram(
            _name("compress_duration_seconds"),
            "Wall time to compress and encode this peer's update for one round.",
            buckets=COMPRESS_BUCKETS,
            registry=r,
        )
        self.consensus_distance = Gauge(
            _name("consensus_distance"),
            "Local estimate ||sum_j w_ij (xhat_j - xhat_i)|| of the distance to the "
            "neighbours: the pull of their public copies on this peer's at the latest mix "
            "(CHOCO-SGD, Koloskova et al. 2019).",
            registry=r,
        )
        self.error_feedback_norm = Gauge(
            _name("error_feedback_norm"),
            "L2 norm of what the compressor has not sent yet (x_i - xhat_i, or the EF residual).",
            registry=r,
        )

    def _health_metrics(self, r: CollectorRegistry) -> None:
        """Membership and health: who is known, what was refused or resynced, what runs."""
        self.peers = Gauge(
            _name("peers"),
            "Other peers this peer knows, by membership state.",
            ["state"],
            registry=r,
        )
        self.neighbors = Gauge(
            _name("neighbors"), "Neighbours currently in this peer's mixing weights.", registry=r
        )
        self.first_mix = Gauge(
            _name("first_mix_seconds"),
            "Seconds from this process's gossip server start to its first gossip round that "
            "mixed a neighbour's copy (how fast a restarted or joining peer rejoins the "
            "swarm); NaN until then.",
            registry=r,
        )
        self.first_mix.set(math.nan)
        self.reachable = Gauge(
            _name("reachable"),
            "Whether a member could dial this peer back at its advertised address when it "
            "started: 1 yes, 0 no, -1 not known (first peer, or no member could check).",
            registry=r,
        )
        self.reachable.set(-1)
        self.relay_forwarded = Counter(
            _name("relay_forwarded_bytes"),
            "As a relay: bytes forwarded to and from each peer attached here, both ways "
            "(one series per peer relayed for since start, at most peer.relay_capacity at once).",
            ["attached"],
            registry=r,
        )
        self.relay_tunnels = Counter(
            _name("relay_tunnels"),
            "As a relay: tunnels opened to the peers attached here, by how their bytes went: "
            "spliced (two plain connections at the raw tunnel listener, peer.relay_port) or "
            "calls (Relay and Accept gRPC calls: the listener is off, or an end could not "
            "reach it).",
            ["how"],
            registry=r,
        )
        self.relayed = Counter(
            _name("relayed_bytes"),
            "Bytes this peer's tunnels carried through each relay, both ways: calls to it as "
            "an attached peer, and its calls to peers behind that relay.",
            ["relay"],
            registry=r,
        )
        self.rejected_updates = Counter(
            _name("rejected_updates"),
            "Incoming messages refused before touching the model, by reason.",
            ["reason"],
            registry=r,
        )
        self.resyncs = Counter(
            _name("resyncs"),
            "Dense resyncs of an edge after a sequence or checksum mismatch.",
            ["neighbor"],
            registry=r,
        )
        self.exchanges = Counter(
            _name("exchanges"),
            "CHOCO exchanges completed with a neighbour (each mixed once, with the agreed "
            "weight, 0 included). Both ends of an edge count the same; a difference is an "
            "exchange mixed at one end only.",
            ["neighbor"],
            registry=r,
        )
        self.lane_dropped = Counter(
            _name("push_lane_dropped"),
            "Vectors dropped, oldest first, from a neighbour's push lane that was full (a "
            "live but slow uplink: ef-gradient and diloco queue one per exchange).",
            ["neighbor"],
            registry=r,
        )
        self.anchor_mismatches = Counter(
            _name("anchor_mismatches"),
            "exact-diloco: messages whose origin started the phase from another anchor than "
            "this peer (0 while the replicas are identical).",
            registry=r,
        )
        self.build_info = Gauge(
            _name("build_info"),
            "Always 1; labels say which version, algorithm, codec and topology this peer runs.",
            ["version", "algorithm", "codec", "topology"],
            registry=r,
        )

    # --- identity ----------------------------------------------------------------------------
    def set_build_info(self, *, version: str, algorithm: str, codec: str, topology: str) -> None:
        """Publish what this peer runs; replaces any earlier build info."""
        self.build_info.clear()
        self.build_info.labels(
            version=version, algorithm=algorithm, codec=codec, topology=topology
        ).set(1)

    # --- neighbours --------------------------------------------------------------------------
    def add_neighbor(self, neighbor: str) -> None:
        """Create every per-neighbour child at 0, so the link's series exist before traffic."""
        if not neighbor:
            raise ValueError("neighbor id must be a non-empty string")
        with self._lock:
            if neighbor in self._neighbor_ids:
                return
            self._neighbor_ids.add(neighbor)
        for kind in MESSAGE_KINDS:
            self.sent_bytes.labels(neighbor=neighbor, kind=kind)
            self.received_bytes.labels(neighbor=neighbor, kind=kind)
        self.dense_bytes.labels(neighbor=neighbor)
        self.push_duration.labels(neighbor=neighbor)
        self.resyncs.labels(neighbor=neighbor)
        self.exchanges.labels(neighbor=neighbor)
        self.lane_dropped.labels(neighbor=neighbor)

    def remove_neighbor(self, neighbor: str) -> None:
        """Drop a departed neighbour's series (keeps cardinality bounded under churn).

        Its byte and resync counts move to the :data:`DEPARTED` series, so totals summed
        over neighbours never go down; its push-time histogram goes. If it comes back, its
        own series start again from 0.
        """
        with self._lock:
            if neighbor not in self._neighbor_ids:
                return
            self._neighbor_ids.discard(neighbor)
            for kind in MESSAGE_KINDS:
                for counter in (self.sent_bytes, self.received_bytes):
                    _move(
                        counter,
                        {"neighbor": neighbor, "kind": kind},
                        {"neighbor": DEPARTED, "kind": kind},
                    )
            _move(self.dense_bytes, {"neighbor": neighbor}, {"neighbor": DEPARTED})
            _move(self.resyncs, {"neighbor": neighbor}, {"neighbor": DEPARTED})
            _move(self.exchanges, {"neighbor": neighbor}, {"neighbor": DEPARTED})
            _move(self.lane_dropped, {"neighbor": neighbor}, {"neighbor": DEPARTED})
            self.push_duration.remove(neighbor)

    @property
    def neighbor_ids(self) -> frozenset[str]:
        """Neighbours whose series currently exist."""
        with self._lock:
            return frozenset(self._neighbor_ids)

    # --- traffic -----------------------------------------------------------------------------
    def record_sent(self, neighbor: str, kind: str, wire_bytes: int, dense_bytes: int = 0) -> None:
        """Count bytes sent to ``neighbor``; ``dense_bytes`` is the same payload as dense fp32.

        ``neighbor`` may be :data:`UNATTRIBUTED` for traffic to any peer (heartbeats).
        """
        _check_choice(kind, MESSAGE_KINDS, "message kind")
        _check_amount(wire_bytes, "wire_bytes")
        _check_amount(dense_bytes, "dense_bytes")
        if neighbor != UNATTRIBUTED:
            self.add_neighbor(neighbor)
        self.sent_bytes.labels(neighbor=neighbor, kind=kind).inc(wire_bytes)
        if dense_bytes:
            self.dense_bytes.labels(neighbor=neighbor).inc(dense_bytes)

    def record_received(self, neighbor: str, kind: str, wire_bytes: int) -> None:
        """Count bytes received from ``neighbor`` (or :data:`UNATTRIBUTED`, as in record_sent)."""
        _check_choice(kind, MESSAGE_KINDS, "message kind")
        _check_amount(wire_bytes, "wire_bytes")
        if neighbor != UNATTRIBUTED:
            self.add_neighbor(neighbor)
        self.received_bytes.labels(neighbor=neighbor, kind=kind).inc(wire_bytes)

    def traffic_totals(self) -> dict[str, int]:
        """Bytes so far, summed over neighbours: ``sent_bytes``, ``received_bytes`` and
        ``dense_bytes``, and ``sent_<kind>_bytes`` / ``received_<kind>_bytes`` per kind.

        Reads the three byte counters only, not the whole registry (whose per-neighbour
        histograms cost ten times as much to collect), since status.json asks every 0.5 s.
        """
        out: dict[str, int] = {}
        for prefix, counter in (
            ("sent", self.sent_bytes),
            ("received", self.received_bytes),
            ("dense", self.dense_bytes),
        ):
            out[f"{prefix}_bytes"] = 0
            if prefix != "dense":
                out.update((f"{prefix}_{kind}_bytes", 0) for kind in MESSAGE_KINDS)
            for labels, value in _counts(counter):
                out[f"{prefix}_bytes"] += value
                if kind := labels.get("kind"):
                    out[f"{prefix}_{kind}_bytes"] += value
        return out

    def bytes_by_neighbour(self) -> dict[str, dict[str, int]]:
        """Bytes so far per neighbour, summed over message kinds:
        ``{neighbour: {"sent": n, "received": n}}``. Heartbeats (unattributed) are left out;
        departed neighbours are summed under :data:`DEPARTED`."""
        out: dict[str, dict[str, int]] = {}
        for direction, counter in (("sent", self.sent_bytes), ("received", self.received_bytes)):
            for labels, value in _counts(counter):
                neighbour = labels["neighbor"]
                if neighbour != UNATTRIBUTED:
                    out.setdefault(neighbour, {"sent": 0, "received": 0})[direction] += value
        return out

    # --- failures ----------------------------------------------------------------------------
    def record_relay_forwarded(self, attached: str, nbytes: int) -> None:
        """As a relay: ``nbytes`` forwarded to or from the attached peer ``attached``."""
        self.relay_forwarded.labels(attached=attached).inc(nbytes)

    def record_relay_tunnel(self, how: str) -> None:
        """As a relay: a tunnel opened, ``how`` its bytes go (spliced, calls)."""
        self.relay_tunnels.labels(how=how).inc()

    def record_relayed(self, relay: str, nbytes: int) -> None:
        """``nbytes`` this peer's tunnels carried through ``relay``."""
        self.relayed.labels(relay=relay).inc(nbytes)

    def record_rejected(self, reason: str) -> None:
        """Count one refused message; ``reason`` must be in :data:`REJECT_REASONS`."""
        _check_choice(reason, REJECT_REASONS, "reject reason")
        self.rejected_updates.labels(reason=reason).inc()

    def record_lane_dropped(self, neighbor: str, count: int = 1) -> None:
        """Count vectors dropped from ``neighbor``'s full push lane."""
        self.add_neighbor(neighbor)
        self.lane_dropped.labels(neighbor=neighbor).inc(count)

    def record_resync(self, neighbor: str) -> None:
        """Count one dense resync of the edge to ``neighbor``."""
        self.add_neighbor(neighbor)
        self.resyncs.labels(neighbor=neighbor).inc()

    def record_anchor_mismatches(self, count: int) -> None:
        """Count ``count`` messages of a phase whose origin's anchor differed from ours."""
        self.anchor_mismatches.inc(count)

    def record_exchange(self, neighbor: str) -> None:
        """Count one exchange with ``neighbor`` completed (mixed) at this end."""
        self.add_neighbor(neighbor)
        self.exchanges.labels(neighbor=neighbor).inc()

    def exchanges_by_neighbour(self) -> dict[str, int]:
        """Exchanges completed so far per neighbour (departed ones under :data:`DEPARTED`);
        neighbours with none left out."""
        return {labels["neighbor"]: n for labels, n in _counts(self.exchanges) if n}

    # --- training ----------------------------------------------------------------------------
    def record_step(self, loss: float, samples: int) -> None:
        """Count one local optimizer step over ``samples`` samples and publish its loss."""
        _check_amount(samples, "samples")
        self.train_steps.inc()
        self.samples.inc(samples)
        self.train_loss.set(loss)

    def set_eval(self, metrics: Mapping[str, float]) -> None:
        """Publish evaluation results, e.g. ``{"accuracy": 0.91, "loss": 0.3}``."""
        if any(not name for name in metrics):
            raise ValueError("eval metric names must be non-empty strings")
        with self._lock:
            names = self._eval_names | set(metrics)
            if len(names) > MAX_EVAL_METRICS:
                raise ValueError(
                    f"at most {MAX_EVAL_METRICS} distinct eval metric names; got {sorted(names)}"
                )
            self._eval_names = names
        for name, value in metrics.items():
            self.eval_metric.labels(name=name).set(value)

    # --- gossip ------------------------------------------------------------------------------
    def record_blocking(self, seconds: float) -> None:
        """Count ``seconds`` the training thread waited for gossip instead of computing."""
        _check_amount(seconds, "seconds")
        self.gossip_blocking.inc(seconds)

    def record_alone(self, seconds: float) -> None:
        """Count ``seconds`` waited with no live neighbour (some suspect)."""
        _check_amount(seconds, "seconds")
        self.alone_seconds.inc(seconds)

    def observe_round(self, seconds: float) -> None:
        """Record one completed gossip round and its duration."""
        _check_amount(seconds, "seconds")
        self.gossip_rounds.inc()
        self.round_duration.observe(seconds)

    def observe_push(self, neighbor: str, seconds: float) -> None:
        """Record how long one push to ``neighbor`` took."""
        _check_amount(seconds, "seconds")
        self.add_neighbor(neighbor)
        self.push_duration.labels(neighbor=neighbor).observe(seconds)

    def observe_compress(self, seconds: float) -> None:
        """Record how long compressing one round's update took."""
        _check_amount(seconds, "seconds")
        self.compress_duration.observe(seconds)

    def set_consensus_distance(self, value: float) -> None:
        """Publish the local consensus-distance estimate."""
        self.consensus_distance.set(value)

    def set_error_feedback_norm(self, value: float) -> None:
        """Publish the norm of the not-yet-sent residual."""
        self.error_feedback_norm.set(value)

    # --- membership --------------------------------------------------------------------------
    def set_peers(self, *, alive: int, suspect: int, dead: int) -> None:
        """Publish how many other peers this peer sees in each membership state."""
        for state, n in (("alive", alive), ("suspect", suspect), ("dead", dead)):
            _check_amount(n, f"{state} peers")
            self.peers.labels(state=state).set(n)

    def mark_serving(self) -> None:
        """The gossip server serves from now: the origin of ``first_mix_seconds``."""
        self._serving_since = time.monotonic()

    def set_neighbors(self, n: int) -> None:
        """Publish how many neighbours the last round mixed (the first time one did, also the
        seconds since the server started serving)."""
        _check_amount(n, "neighbors")
        self.neighbors.set(n)
        with self._lock:
            if n > 0 and self._serving_since is not None and not self._mixed_once:
                self._mixed_once = True
                self.first_mix.set(time.monotonic() - self._serving_since)

    # --- HTTP endpoint -----------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` over HTTP in a daemon thread; returns the bound port.

        Loopback by default: exposing metrics beyond this machine is the caller's choice
        (pass ``host="0.0.0.0"`` or an interface address). ``port=0`` lets the OS pick.
        """
        if self._server is not None:
            raise RuntimeError("metrics endpoint already serving; call stop() first")
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        bound = int(server.server_address[1])
        log.info("metrics endpoint on http://%s:%s/metrics", host, bound)
        return bound

    @property
    def port(self) -> int | None:
        """The bound HTTP port, or ``None`` when not serving."""
        return None if self._server is None else int(self._server.server_address[1])

    def stop(self) -> None:
        """Stop the HTTP endpoint (no-op if not serving)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)


def _counts(counter: Counter) -> Iterator[tuple[dict[str, str], int]]:
    """Each child's (labels, count) of a labelled counter (its ``_total`` samples)."""
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                yield sample.labels, int(sample.value)


def _move(counter: Counter, labels: dict[str, str], to: dict[str, str]) -> None:
    """Add the count of ``counter``'s series ``labels`` to series ``to``; remove the first."""
    count = next(
        sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels == labels
    )
    counter.labels(**to).inc(count)
    counter.remove(*labels.values())
