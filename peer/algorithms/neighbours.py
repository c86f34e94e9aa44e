"""The neighbour layer every gossip algorithm shares: who the neighbours are, sending to them,
checking what they send, and waiting (bounded) for the ones that are late.

Written once here so that an algorithm only says what it sends and how it merges. The
collaborators are passed in: a membership view (who is present and alive) and a sender (one
blocking push to a peer); this module knows nothing of gRPC channels or heartbeats.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, cast

import grpc
from gossipgrad.peer.membership.topology import Topology
from gossipgrad.peer.membership.weights import metropolis_hastings_weights
from gossipgrad.peer.network.errors import UpdateRejected
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Jobs waiting in one neighbour's push lane before the oldest is dropped (the receiver
#: keeps as many: peer/algorithms/averaging.py's MAX_QUEUED).
MAX_LANE = 8

#: Answered pushes the round-trip estimate is taken over (``Neighbourhood.round_trip``).
ROUND_TRIPS = 32

#: The byte counters' ``kind`` label of an update kind (every other kind counts as "update").
KIND_LABEL = {pb.RESYNC: "resync", pb.INIT: "resync", pb.ANCHOR: "resync", pb.BUFFERS: "buffers"}


class MembershipView(Protocol):
    """What the algorithms need to know of the swarm."""

    def present_ids(self) -> list[str]: ...

    def is_alive(self, peer_id: str) -> bool: ...


class UpdateSender(Protocol):
    """One blocking push of an update to a peer: (reply, bytes on the wire)."""

    def push(
        self, peer: str, header: pb.UpdateHeader, payload: bytes, patience: float = 1.0
    ) -> tuple[pb.PushReply, int]:
        """``patience``: the deadline in units of the configured push deadline."""
        ...


def neighbours_in(topology: Topology, me: str, ids: list[str]) -> set[str]:
    """Every peer ``me`` gossips with in some round, over the sorted ``ids`` (``me`` included)."""
    if len(ids) < 2 or me not in ids:
        return set()
    i = ids.index(me)
    return {ids[j] for j in topology.all_neighbors(i, len(ids))}


@dataclass(frozen=True)
class Identity:
    """Who this peer is and which model it trains (stamped on every update)."""

    me: str
    swarm: str
    fingerprint: str
    dense_size: int


class Neighbourhood:
    """Topology over the live peers, pushes on a pool, header checks, bounded waiting.

    Args:
        identity: this peer, its swarm and model fingerprint.
        view: the membership view (present and alive peers).
        topology: the gossip topology; neighbours are computed over the peers alive now, so a
            suspect neighbour is bridged over at once instead of leaving this peer alone.
        sender: pushes one update to a peer.
        metrics: a PeerMetrics or None.
        pool_size: pushes in flight at once.
    """

    def __init__(
        self,
        identity: Identity,
        view: MembershipView,
        topology: Topology,
        sender: UpdateSender,
        metrics=None,
        pool_size: int = 8,
    ) -> None:
        self.identity = identity
        self.view = view
        self.topology = topology
        self.sender = sender
        self.metrics = metrics
        self.arrived = threading.Condition()
        self._heard: dict[str, int] = {}
        self._lagging: dict[str, int] = {}
        self._events = 0
        self._pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="push")
        # Jobs waiting per peer for submit_in_order; a key is present while its lane has a
        # job running or is in line for a worker (``_ready``), never both.
        self._lanes: dict[str, deque[tuple[Callable[..., None], tuple]]] = {}
        self._ready: deque[str] = deque()
        self._lanes_running = 0
        # Lanes never take the whole pool: CHOCO pushes and FINAL notices keep two workers.
        self._lane_workers = max(1, pool_size - 2)
        self._lanes_lock = threading.Lock()
        #: Jobs dropped from full lanes so far.
        self.lane_dropped = 0
        # Seconds of the latest answered pushes, every neighbour alike (round_trip).
        self._round_trips: deque[float] = deque(maxlen=ROUND_TRIPS)

    @property
    def me(self) -> str:
        return self.identity.me

    # ------------------------------------------------------------------ topology

    def ids(self) -> list[str]:
        """Sorted ids of the peers that take part now: this one and the live ones."""
        return [p for p in self.view.present_ids() if p == self.me or self.view.is_alive(p)]

    def neighbors_at(self, round_: int, ids: list[str] | None = None) -> list[str]:
        """This peer's neighbours in a round (a label: time-varying topologies cycle)."""
        ids = ids if ids is not None else self.ids()
        if len(ids) < 2 or self.me not in ids:
            return []
        i = ids.index(self.me)
        return [ids[j] for j in self.topology.neighbors(i, len(ids), round_)]

    def all_neighbors(self, ids: list[str] | None = None) -> set[str]:
        """Every peer this one gossips with in some round (for time-varying topologies)."""
        return neighbours_in(self.topology, self.me, ids if ids is not None else self.ids())

    def over(self, topology: Topology) -> Neighbourhood:
        """This layer on another graph: neighbours and weights from ``topology``, the same
        pushes, arrivals, checks and waiting (diloco's anchors gossip over a sparser graph
        than its pseudo-gradients are averaged on)."""
        return cast(Neighbourhood, _OtherGraph(self, topology))

    def weights_at(self, round_: int, ids: list[str]) -> dict[str, float]:
        """Metropolis–Hastings weights w_ij for this round (self excluded)."""
        n = len(ids)
        if n < 2 or self.me not in ids:
            return {}
        i = ids.index(self.me)
        w = metropolis_hastings_weights(i, lambda k: self.topology.neighbors(k, n, round_))
        return {ids[j]: wij for j, wij in w.items() if j != i}

    # ------------------------------------------------------------------ sending

    def header(self, peer: str, kind: int, payload: bytes, **fields) -> pb.UpdateHeader:
        """An update header to ``peer``, stamped with who we are and what we train (``fields``
        add to or override the stamp, e.g. ``dense_size=0`` for a control message)."""
        ident = self.identity
        stamped = {
            "swarm": ident.swarm,
            "sender": ident.me,
            "receiver": peer,
            "kind": kind,
            "payload_size": len(payload),
            "model_fingerprint": ident.fingerprint,
            "dense_size": ident.dense_size,
        }
        return pb.UpdateHeader(**{**stamped, **fields})

    def push(
        self, peer: str, header: pb.UpdateHeader, payload: bytes, patience: float = 1.0
    ) -> pb.PushReply:
        """Push one update now (blocking), within ``patience`` push deadlines; count it.
        Raises what the sender raises."""
        t0 = time.perf_counter()
        reply, wire_bytes = self.sender.push(peer, header, payload, patience)
        seconds = time.perf_counter() - t0
        self._round_trips.append(seconds)
        if self.metrics is not None:
            kind = KIND_LABEL.get(header.kind, "update")
            self.metrics.observe_push(peer, seconds)
            self.metrics.record_sent(peer, kind, wire_bytes, dense_bytes=header.dense_size)
        return reply

    def round_trip(self) -> float | None:
        """The fewest seconds among the latest answered pushes, any neighbour (a push is
        answered once the neighbour applied it): the link's round trip with the least of this
        host's and the neighbour's CPU delays in it; None before any."""
        samples = list(self._round_trips)
        return min(samples) if samples else None

    def submit(self, fn: Callable[..., None], *args) -> None:
        """Run ``fn(*args)`` on the push pool (pushes never block the training thread)."""
        self._pool.submit(fn, *args)

    def submit_in_order(self, peer: str, fn: Callable[..., None], *args) -> None:
        """Like :meth:`submit`, but after every job submitted earlier for the same ``peer``
        has run: that peer receives the messages in the order they were sent, however the
        pool's threads are scheduled (messages paired by arrival need it).

        A lane holds at most ``MAX_LANE`` waiting jobs: over a live but slow uplink the
        oldest go first (counted in ``gossipgrad_push_lane_dropped_total``); the receiver
        keeps no more than that either. Lanes take turns, one job each, on at most all but
        two of the pool's workers, so a slow neighbour delays neither the other lanes nor
        the pushes of :meth:`submit`.
        """
        dropped = 0
        with self._lanes_lock:
            lane = self._lanes.get(peer)
            if lane is not None:
                lane.append((fn, args))
                while len(lane) > MAX_LANE:
                    lane.popleft()
                    dropped += 1
                self.lane_dropped += dropped
                start = False
            else:
                self._lanes[peer] = deque([(fn, args)])
                start = self._lanes_running < self._lane_workers
                if start:
                    self._lanes_running += 1
                else:
                    self._ready.append(peer)
        if dropped:
            log.warning("push lane to %s full: %d oldest vectors dropped", peer, dropped)
            if self.metrics is not None:
                self.metrics.record_lane_dropped(peer, dropped)
        if start:
            self._pool.submit(self._drain, peer)

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every job of :meth:`submit_in_order` has
        run; whether they all have. For a peer whose neighbours still need what it queued
        (exact-diloco's forwards of a run's last phase) before it leaves."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lanes_lock:
                if not self._lanes:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _drain(self, peer: str) -> None:
        """Run one job of ``peer``'s lane, then hand the worker to the next lane in line."""
        with self._lanes_lock:
            lane = self._lanes[peer]
            fn, args = lane.popleft()
        try:
            fn(*args)
        except Exception:
            log.exception("a push job to %s failed", peer)
        with self._lanes_lock:
            if lane:
                self._ready.append(peer)  # more to send: to the back of the line
            else:
                del self._lanes[peer]
            following = self._ready.popleft() if self._ready else None
            if following is None:
                self._lanes_running -= 1
        if following is not None:
            # RuntimeError: the pool was shut down (close), nothing more goes out.
            with contextlib.suppress(RuntimeError):
                self._pool.submit(self._drain, following)

    # ------------------------------------------------------------------ receiving

    def check(self, header: pb.UpdateHeader, kinds: tuple[int, ...]) -> None:
        """Refuse an update for another model, another peer or a kind we do not take."""
        ident = self.identity
        if header.model_fingerprint != ident.fingerprint:
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "fingerprint",
                f"model fingerprint {header.model_fingerprint!r} != ours {ident.fingerprint!r}",
            )
        if header.receiver != ident.me:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"update addressed to {header.receiver!r}, this is {ident.me!r}",
            )
        if header.kind not in kinds or (header.kind == pb.INIT and header.payload_size != 0):
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"update kind {header.kind} is not one this algorithm takes",
            )

    def heard(self, peer: str) -> None:
        """``peer`` sent something: count it and wake the waiting training thread."""
        with self.arrived:
            self._heard[peer] = self._heard.get(peer, 0) + 1
            self._events += 1
            self.arrived.notify_all()

    def notify(self) -> None:
        """Something changed (a push was answered): wake the waiting training thread."""
        with self.arrived:
            self._events += 1
            self.arrived.notify_all()

    def forget(self, peer: str) -> None:
        """Drop the bookkeeping of a peer that left."""
        with self.arrived:
            self._heard.pop(peer, None)
            self._lagging.pop(peer, None)

    # ------------------------------------------------------------------ waiting

    def alone(self) -> bool:
        """No other peer is alive, yet some are still present (suspect, not given up)."""
        return len(self.ids()) == 1 and len(self.view.present_ids()) > 1

    def await_company(self, timeout: float) -> float:
        """While :meth:`alone`, wait (at most ``timeout``) until a neighbour is heard from
        again or membership gives up on them, instead of running rounds alone and racing
        ahead of a swarm that is only briefly out of reach. Returns the seconds waited."""
        if not self.alone():
            return 0.0
        t0 = time.monotonic()
        suspects = len(self.view.present_ids()) - 1
        log.warning("no live neighbour, %d suspect: waiting up to %.0fs", suspects, timeout)
        while self.alone() and time.monotonic() - t0 < timeout:
            with self.arrived:
                self.arrived.wait(timeout=0.05)
        waited = time.monotonic() - t0
        if self.metrics is not None:
            self.metrics.record_alone(waited)
        return waited

    def wait(
        self,
        missing: Callable[[], list[str]],
        timeout: float,
        what: str,
        on_wake: Callable[[], None] | None = None,
        final: bool = False,
        describe: Callable[[str], str] | None = None,
    ) -> float:
        """Block until ``missing()`` names no live, non-lagging peer, at most ``timeout``.

        ``on_wake`` runs first and after every arrival (outside the lock): the caller's chance
        to act on what came in (mix it, push the next update). A neighbour that misses the
        deadline is not waited for again until it is heard from: a slow neighbour paces this
        peer, only a silent one is left behind. ``final``: the last wait of a run, which waits
        for lagging neighbours too (their exchange may be on its way, and the other end would
        mix it) and marks none. ``describe(peer)``: what the warning of a missed deadline says
        of the peer's exchange (its edge's state), so a stuck edge shows in the log. Returns the
        seconds spent.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            with self.arrived:
                seen = self._events
            if on_wake is not None:
                on_wake()
            with self.arrived:
                waiting = [
                    p
                    for p in missing()
                    if (final or p not in self._lagging) and self.view.is_alive(p)
                ]
                if not waiting:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "%s: nothing from %s in %.1fs%s",
                        what, waiting, timeout,
                        "".join(f"; {p}: {describe(p)}" for p in waiting) if describe else "",
                    )  # fmt: skip
                    for p in () if final else waiting:
                        self._lagging[p] = self._heard.get(p, 0)
                    break
                if self._events == seen:
                    self.arrived.wait(timeout=min(left, 0.1))
        with self.arrived:
            for p, heard in list(self._lagging.items()):
                if self._heard.get(p, 0) > heard:
                    del self._lagging[p]
        return time.monotonic() - t0

    def close(self) -> None:
        """Stop pushing: jobs not started are dropped, running ones finish."""
        with self._lanes_lock:
            for lane in self._lanes.values():
                lane.clear()
            self._ready.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


class _OtherGraph:
    """A :class:`Neighbourhood` seen through another topology (``Neighbourhood.over``): the
    three methods that read the graph are the layer's own, run on this one's ``topology``;
    everything else (the push pool, arrivals, lagging peers, round trips) is the layer's,
    shared, so one wait wakes on what either graph's algorithm receives."""

    def __init__(self, layer: Neighbourhood, topology: Topology) -> None:
        self._layer = layer
        self.topology = topology

    def __getattr__(self, name: str):
        return getattr(self._layer, name)

    neighbors_at = Neighbourhood.neighbors_at
    all_neighbors = Neighbourhood.all_neighbors
    weights_at = Neighbourhood.weights_at
