"""CHOCO-SGD gossip over per-edge public copies (Koloskova, Stich, Jaggi, ICML 2019).

A round (every ``gossip.local_steps`` steps) opens one exchange per edge, q = Q(x_i − x̂_{i->j})
with x̂_{i->j} += q pushed in the background (or the session's INIT / dense RESYNC opening),
and mixes each completed exchange once: x_i += γ Σ_j w_ij (x̂_{j->i} − x̂_{i->j}). With
``max_staleness`` 0 it waits for this round's exchanges, with k >= 1 only for those opened
k rounds ago (so compute overlaps communication, and an edge slower than a round mixes every
few rounds instead of pacing the peer); every wait is bounded by ``round_timeout``. An update
that was not acknowledged is pushed again, the same bytes, and nothing is mixed before it
landed; what the codec drops stays in x_i − x̂_{i->j} (the error feedback;
``gossip.error_feedback = false``: Q(x_i − b), DCD-PSGD, Tang et al. 2018). The rules that
keep both ends identical and the mixing symmetric are peer/algorithms/edges.py's; this class
also keeps diloco's anchors together. Edges in sync (the same x̂; the codec's seed is the
round's: edges opened in the same round from the initial model, a ring's two most of all, and
a dense opening that starts from the public copy of an edge updated in its round, as a
joiner's neighbours' do) send the same update, encoded once a round (``SharedUpdate``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import torch
from gossipgrad.compression import Codec, DecodeError, from_spec
from gossipgrad.peer.algorithms.base import GossipAlgorithm, RoundStats
from gossipgrad.peer.algorithms.edges import (
    HELLO_RESTART_INTERVAL,
    Copies,
    Edge,
    EdgeTable,
    Incoming,
    Kind,
    Verdict,
)
from gossipgrad.peer.algorithms.mixing import Pair, consensus_step, difference_norm
from gossipgrad.peer.algorithms.neighbours import Neighbourhood
from gossipgrad.peer.algorithms.rounds import OpenRound
from gossipgrad.peer.algorithms.settings import ChocoSettings
from gossipgrad.peer.algorithms.staleness import Staleness
from gossipgrad.peer.algorithms.wire_kinds import KINDS, REFUSED, STATUS, VERDICT, WIRE_KIND
from gossipgrad.peer.flat import SpilledTensor, tensor_checksum
from gossipgrad.peer.network.errors import UpdateRejected
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

DENSE_SPEC = "none"
# Edges opened before this round start from the shared initial model (INIT, no payload);
# later ones (a late joiner, a rewired topology) from a dense copy of the current model.
INIT_ROUNDS = 50
# finish() waits up to this many round_timeouts for the exchanges still open (an interrupted
# run's, only for its own acknowledgements: at most one round_timeout).
FINISH_ROUNDS = 3


@dataclass(frozen=True)
class SharedUpdate:
    """A DELTA update made this round, for the other edges whose x̂ it started from (the
    round's thread is the only one that updates public copies, so ``edge`` holds it until
    that edge's next update changes its checksum)."""

    edge: Edge
    payload: bytes
    residual: float
    checksum: int  # tensor_checksum(edge.public) after the update

    @property
    def current(self) -> bool:
        """``edge``'s public copy is still the one this update left."""
        return self.edge.public_checksum == self.checksum


class ChocoGossip(GossipAlgorithm):
    """CHOCO-SGD over the tensor ``x`` (see the module docstring).

    Args:
        x: the vector gossiped (updated in place): the parameters, or diloco's anchor.
        initial: the shared seeded initial value of x (INIT openings).
        settings: codec, γ, H, staleness, timeouts.
        neighbourhood: the neighbour layer (topology, pushes, checks, waiting).
        state_lock: held while x is read for an update or written by mixing, so a state
            download never sees a half-mixed model.
        metrics: a PeerMetrics or None.
    """

    name = "choco"
    kinds = (pb.DELTA, pb.RESYNC, pb.INIT, pb.FINAL)

    def __init__(
        self,
        x: torch.Tensor,
        initial: SpilledTensor,
        settings: ChocoSettings,
        neighbourhood: Neighbourhood,
        state_lock: threading.RLock,
        metrics=None,
    ) -> None:
        self.x = x
        self.settings = settings
        self.codec: Codec = from_spec(settings.codec)
        self.dense_codec: Codec = from_spec(DENSE_SPEC)
        dtype = getattr(torch, settings.copy_dtype)
        self.copies = Copies(self.codec, self.dense_codec, initial, settings.error_feedback, dtype)
        self.nb = neighbourhood
        self.state_lock = state_lock
        self.metrics = metrics
        self.edges = EdgeTable(x, neighbourhood.me, dtype)
        self._round = 0
        self._scratch: torch.Tensor | None = None  # x − x̂ while a round encodes
        # This round's DELTA updates by delta_key: an edge whose x̂ another edge has just
        # updated from (the same copy, the same seed) sends that update again.
        self._updates: dict[tuple[int, int], SharedUpdate] = {}
        self.shared_updates = 0  # updates sent on a second edge without encoding again
        self.staleness = Staleness(settings.max_staleness)
        self._round_end: float | None = None  # when the previous round returned
        self._finished = False  # finish() ran: no exchange is opened or taken any more
        # A tensor every consensus pass also writes x into (``write_x_also``), and whether
        # one has since it was given.
        self._x_also: torch.Tensor | None = None
        self._x_also_written = False

    @property
    def round(self) -> int:
        return self._round

    def write_x_also(self, t: torch.Tensor | None) -> bool:
        """From now on every consensus pass also writes the new x into ``t`` (x's shape and
        dtype), in the same pass (diloco's parameters during its anchors' round: θ = a with
        no copy of its own); None stops it. Returns whether the tensor given before now
        equals x (a pass wrote it; every pass since did too). Called with ``state_lock``."""
        written = self._x_also is not None and self._x_also_written
        self._x_also, self._x_also_written = t, False
        return written

    # ------------------------------------------------------------------ edges

    def edge(self, peer: str) -> Edge:
        """The edge with ``peer`` (made on first use)."""
        return self.edges.edge(peer)

    @contextlib.contextmanager
    def _table_edge(self, peer: str) -> Iterator[Edge]:
        """The table's edge with ``peer``, its lock held. A view change may prune the edge
        between the lookup and the lock; an update applied to the pruned object would be lost
        to the table (and the leader, whose opening it acknowledged, would wait in that
        session for good), so the lookup is made again until the edge locked is the table's.
        Pruned after the check, the edge is recorded as it is once the lock is let go."""
        while True:
            edge = self.edge(peer)
            with edge.lock:
                if self.edges.get(peer) is edge:
                    yield edge
                    return

    def forget(self, peer: str) -> None:
        """``peer`` left or restarted: end its session. A neighbour that finished (FINAL)
        decided its last exchanges before it left, and mixed one complete at its end: one
        complete here is mixed here first, or its leaving (seen before our next round) would
        leave it mixed at that end only. A crashed neighbour's may not have been: dropped."""
        edge = self.edges.get(peer)
        if edge is not None and edge.peer_final is not None:
            self._mix_ready([peer])
        self._end_session(peer)

    def _end_session(self, peer: str) -> None:
        self.edges.restart(peer)
        self.nb.forget(peer)

    def prune(self, present: set[str]) -> None:
        self.edges.prune(present)

    # ------------------------------------------------------------------ sending

    def _encode(self, peer: str, edge: Edge, weight: float) -> tuple[pb.UpdateHeader, bytes]:
        """The edge's next update with its header (edge lock held)."""
        t0 = time.perf_counter()
        seed = self._round + 1  # every edge's this round: edges in sync encode alike
        key = edge.delta_key(self.copies, seed)
        shared = self._updates.get(key) if key is not None else None
        if shared is not None and shared.current:
            # In sync with an edge updated this round (a ring's two edges, most rounds):
            # the same bytes and the same x̂ after them, without encoding x − x̂ again. (The
            # receiver checks x̂'s checksum: a stale x is merely an older point to send.)
            edge.take_update(shared.edge.public, shared.residual)
            kind, payload, checksum = Kind.DELTA, shared.payload, shared.checksum
            self.shared_updates += 1
        else:
            if self._scratch is None and self.copies.codec.sparse:
                # One difference buffer for the round's edges, then freed (a dense codec's
                # encoder reads x and x̂ a chunk at a time and needs none).
                self._scratch = torch.empty_like(self.x)
            early = self._round < INIT_ROUNDS
            kind, payload = edge.encode_next(
                self.x,
                self.copies,
                early=early,
                seed=seed,
                scratch=self._scratch,
                resync_from=self._in_sync_copy() if edge.opens_dense(early) else None,
            )
            checksum = tensor_checksum(edge.public)
            if key is not None:
                self._updates[key] = SharedUpdate(edge, payload, edge.residual, checksum)
        edge.public_checksum = checksum
        if self.metrics is not None:
            if kind is Kind.RESYNC:
                self.metrics.record_resync(peer)
            elif kind is Kind.DELTA:
                self.metrics.observe_compress(time.perf_counter() - t0)
        header = self.nb.header(
            peer,
            WIRE_KIND[kind],
            payload,
            seq=edge.sent + 1,
            round=self._round,
            checksum=checksum,
            edge_epoch=edge.epoch,
            weight=weight,
        )
        edge.record_sent((header, payload), weight, self._round)
        return header, payload

    def _in_sync_copy(self) -> tuple[torch.Tensor, float] | None:
        """A public copy updated this round and unchanged since, with its ||x − x̂||, for a
        RESYNC opening to start from (``Edge.encode_next``); None without one (no error
        feedback: an edge's updates then depend on its own last x, never shared)."""
        if not self.copies.error_feedback:
            return None
        shared = next((u for u in self._updates.values() if u.current), None)
        return None if shared is None else (shared.edge.public, shared.residual)

    def _hello(self, peer: str, edge: Edge) -> tuple[pb.UpdateHeader, bytes]:
        """A follower without a session asks the leader for one (epoch 0, no payload)."""
        header = self.nb.header(
            peer,
            pb.INIT,
            b"",
            round=self._round,
            edge_epoch=0,
            dropped_epoch=edge.dropped,
            dense_size=0,
        )
        return header, b""

    def _send(self, peer: str, edge: Edge, header: pb.UpdateHeader, payload: bytes) -> None:
        verdict, late, code = None, False, None
        try:
            reply = self.nb.push(peer, header, payload, patience=edge.patience())
            verdict = VERDICT.get(reply.status, Verdict.NEED_RESYNC)
            if verdict is Verdict.NEED_RESYNC and header.edge_epoch:
                log.info("%s ends the session of our edge (%s)", peer, reply.detail)
        except Exception as err:
            # Not acknowledged: the same update goes again next round (unless the receiver
            # refused its contents, which a new session heals), with a longer deadline if
            # this one ran out.
            code = err.code() if isinstance(err, grpc.RpcError) else None
            late = code is grpc.StatusCode.DEADLINE_EXCEEDED
            log.warning(
                "push to %s failed (%d bytes, %.0fx the push deadline): %s",
                peer, len(payload), edge.patience(), err,
            )  # fmt: skip
            if code in REFUSED:
                verdict = Verdict.NEED_RESYNC
        with edge.lock:
            edge.timeouts = edge.timeouts + 1 if late else 0
            edge.release()
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                edge.refused_for_now()
            if verdict is not None:
                edge.answered(header.edge_epoch, header.seq, verdict)
        self.nb.notify()

    def _push(self, peer: str, weight: float, turn: dict[str, int]) -> str:
        """Move the edge with ``peer`` on, if it can: say hello (no session yet; once a round),
        push an unacknowledged update again, or open this round's exchange (once per session
        and round). ``turn`` remembers, per peer, the session this round opened one in
        (0: a hello). Returns what it did ("" for nothing)."""
        edge = self.edge(peer)
        with edge.lock:
            edge.restart_if_due()
            if edge.busy or edge.ended:
                return ""
            if edge.epoch == 0:
                if self._finished or turn.get(peer) == 0:
                    return ""
                turn[peer] = 0
                update = self._hello(peer, edge)
            elif edge.unacked is not None:
                if not edge.may_retry():
                    return ""
                update = edge.unacked  # not acknowledged: the same bytes again
            elif edge.can_send() and turn.get(peer) != edge.epoch:
                turn[peer] = edge.epoch
                # x is only read here (the state lock guards its writers: the optimizer
                # and mixing), so a training step may go on meanwhile; an x read halfway
                # through a step is as good a point to send from as any.
                update = self._encode(peer, edge, weight)
            else:
                return ""
            edge.claim()
        self.nb.submit(self._send, peer, edge, *update)
        return "pushed"

    def _edge_state(self, peer: str) -> str:
        """The edge with ``peer`` in one line (for the log of a round that waited it out)."""
        edge = self.edges.get(peer)
        return "no edge" if edge is None else edge.describe()

    # ------------------------------------------------------------------ receiving

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Apply one incoming update to its edge's mirror (server thread)."""
        self.nb.check(header, self.kinds)
        if header.kind == pb.FINAL:
            with self._table_edge(header.sender) as edge:
                edge.note_final(header.edge_epoch, header.seq)
            self.nb.heard(header.sender)
            return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="final")
        update = Incoming(
            epoch=header.edge_epoch,
            seq=header.seq,
            kind=KINDS[header.kind],
            checksum=header.checksum,
            weight=header.weight,
            payload=bytes(payload),
            dropped=header.dropped_epoch,
        )
        if not 0.0 <= update.weight <= 1.0:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"weight {update.weight}"
            )
        with self._table_edge(header.sender) as edge:
            verdict = edge.admit(update)
            if verdict is None:
                try:
                    verdict = edge.apply(update, self.copies)
                except DecodeError as err:
                    edge.fail()
                    raise UpdateRejected(
                        grpc.StatusCode.INVALID_ARGUMENT, "decode_error", str(err)
                    ) from None
            if verdict is Verdict.LIMITED:  # not refused: an honest sender tries it again
                raise UpdateRejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "rate_limited",
                    f"update failed a check; the edge's next session waits (one per "
                    f"{HELLO_RESTART_INTERVAL:g} s)",
                )
            verdict = edge.reply(update, verdict)
            received = edge.received
        if verdict is Verdict.NEED_RESYNC and update.epoch:
            log.info(
                "edge %s->%s: %s seq %d of session %d refused",
                header.sender,
                self.nb.me,
                update.kind.value,
                update.seq,
                update.epoch,
            )
        self.nb.heard(header.sender)
        return pb.PushReply(status=STATUS[verdict], expected_seq=received + 1, detail=verdict.value)

    # ------------------------------------------------------------------ the round

    def _mix_ready(self, peers: list[str], close: bool = False) -> tuple[list[str], float]:
        """Mix every edge whose exchange is complete at this end, each exactly once.

        ``close`` (the end of ``finish``): then every edge also takes part in no exchange
        beyond the ones mixed now, decided under its lock together with the readiness check,
        so an update that lands meanwhile is either in this mix or refused (FINISHED), never
        acknowledged and left unmixed."""
        pairs, mixed, due = [], [], []
        dist = float("nan")
        # The ready edges stay locked until the step is taken, so it reads their copies in
        # place (no model-sized clone per edge) and no update lands in a mirror meanwhile;
        # the others are let go at once (a server thread may be applying an update to one).
        with torch.no_grad(), self.state_lock, contextlib.ExitStack() as locked:
            for peer in peers:
                edge = self.edges.get(peer)
                if edge is None:
                    continue
                edge.lock.acquire()
                if not edge.exchange_ready():
                    if close:
                        edge.close(edge.mixed)
                    edge.lock.release()
                    continue
                locked.callback(edge.lock.release)
                w = edge.weight()
                if w > 0:
                    pairs.append(Pair(edge.mirror, edge.public, w))
                    mixed.append(peer)
                due.append((peer, edge))
            # Most calls (every wake of a round's wait) find nothing to mix: no pass over x.
            if pairs:
                dist = consensus_step(
                    self.x,
                    pairs,
                    self.settings.gamma,
                    self.settings.robust_clip,
                    also_into=self._x_also,
                )
                self._x_also_written = self._x_also is not None
            for peer, _ in due:
                if self.metrics is not None:
                    self.metrics.record_exchange(peer)
            due = [(edge, edge.done_mixing()) for _, edge in due]
            if close:  # a held update is still applied below (the copies stay identical)
                for edge, _ in due:
                    edge.close(edge.mixed)
        for edge, held in due:
            if held is not None:
                with edge.lock:
                    try:
                        edge.apply(held, self.copies)
                    except DecodeError as err:
                        log.warning("held update undecodable: %s", err)
                        edge.fail()
        return mixed, dist

    def step_round(self, trained: bool = True) -> RoundStats:
        """Run one gossip round (see the module docstring). Called by the training thread;
        ``trained`` false for a gossip-only round (no compute since the last: ``Staleness``).

        After ``finish()`` a round opens and mixes nothing: every exchange was decided then."""
        if self._finished:
            log.warning("a gossip round after finish(): nothing exchanged")
            return RoundStats(round=self._round, neighbors=[], mixed=[], pushed=[])
        t_round = time.perf_counter()
        if trained and self._round_end is not None:  # what the steps since then computed
            self.staleness.observe_compute(t_round - self._round_end)
        self.nb.await_company(self.settings.round_timeout)
        ids = self.nb.ids()
        neighbors = self.nb.neighbors_at(self._round, ids)
        owed = [p for p, e in list(self.edges.items()) if p not in neighbors and e.owed()]
        for p in neighbors:
            self.edge(p)  # made now: a round's edges exist from its start
        rnd = OpenRound(
            [*neighbors, *owed],
            self.edges,
            self.nb.weights_at(self._round, ids),
            self.staleness.update(self.nb.round_trip()),
            self._round,
        )

        asked: list[str] = []

        def progress() -> None:
            rnd.record_mixed(*self._mix_ready(list(self.edges)))
            # A follower that asked for a session in the middle of this round (a newcomer,
            # or a neighbour bridging over one that died) gets it now, not a round later: it
            # waits in its own round until then, and its neighbours wait on it. This round
            # does not wait for it in turn.
            for p, e in list(self.edges.items()):
                if e.requested and p not in rnd.peers and p not in asked:
                    asked.append(p)
            # Openings go last: a RESYNC starts from a copy the round's updates left in sync.
            order = sorted([*rnd.peers, *asked], key=lambda p: self.edge(p).sent == 0)
            for p in order:
                if self.nb.view.is_alive(p) and self._push(p, rnd.weights.get(p, 0.0), rnd.turn):
                    rnd.pushed.add(p)

        waited = self.nb.wait(
            rnd.unfinished,
            self.settings.round_timeout,
            f"round {self._round}",
            progress,
            describe=self._edge_state,
        )
        stats = RoundStats(
            round=self._round,
            neighbors=neighbors,
            mixed=rnd.mixed(),
            pushed=sorted(rnd.pushed),
            waited_s=waited,
            consensus_distance=rnd.distance,
            residual_norm=self._residual_norm(neighbors),
            max_staleness=rnd.max_staleness,
        )
        self._scratch = None
        self._updates.clear()
        if self.metrics is not None:
            self.metrics.observe_round(time.perf_counter() - t_round)
            if stats.mixed:
                self.metrics.set_consensus_distance(stats.consensus_distance)
            self.metrics.set_error_feedback_norm(stats.residual_norm)
            self.metrics.set_neighbors(len(stats.mixed))
        self._round += 1
        self._round_end = time.perf_counter()
        return stats

    def finish(self, interrupted: bool = False) -> None:
        """The run is over: tell each neighbour the last exchange we opened (FINAL), then
        mix the exchanges still open, opening no new ones, and decide every edge for good
        (``_mix_ready(close=True)``; peer/algorithms/edges.py, the end of a run). An
        exchange the neighbour says it will never complete is neither waited for nor mixed,
        at both ends. ``interrupted`` (a SIGTERM, an exception): wait only for our own
        pushes of exchanges whose other half is here, at most one ``round_timeout``, not for
        a neighbour's next update. Once only; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        started = time.monotonic()
        self.edges.close()  # from here on, updates beyond what we opened are refused
        notices: list[threading.Event] = []
        for peer, edge in list(self.edges.items()):
            with edge.lock:
                epoch, sent = edge.epoch, edge.sent
            if epoch and self.nb.view.is_alive(peer):
                header = self.nb.header(
                    peer, pb.FINAL, b"", seq=sent, edge_epoch=epoch, dense_size=0
                )
                notices.append(threading.Event())
                self.nb.submit(self._notify_final, peer, header, notices[-1])
        # Read live, as a round does: an edge a view change dropped and made anew (a new
        # session) has nothing of the old one left to mix.
        due = {p: (e.epoch, e.sent) for p, e in list(self.edges.items()) if e.outstanding()}

        def open_edge(peer: str) -> Edge | None:
            e = self.edges.get(peer)
            return e if e is not None and e.epoch == due[peer][0] else None

        def missing() -> list[str]:
            return [
                p
                for p, (_, sent) in due.items()
                if (e := open_edge(p)) is not None
                and e.mixed < sent
                and not e.ended
                and (not interrupted or e.received > e.mixed)
            ]

        def progress() -> None:
            self._mix_ready(list(due))
            for peer in due:
                edge = open_edge(peer)
                if edge is not None and edge.unacked is not None and self.nb.view.is_alive(peer):
                    self._push(peer, 0.0, {peer: edge.epoch})  # a retry, never a new exchange

        # Longer than a round's wait: a neighbour may still be in its last rounds; its FINAL
        # notice, or its leaving, ends the wait for it at once.
        rounds = 1 if interrupted else FINISH_ROUNDS
        self.nb.wait(missing, rounds * self.settings.round_timeout, "finish", progress, final=True)
        self._mix_ready(list(self.edges), close=True)
        for peer, (_, sent) in due.items():
            if (e := open_edge(peer)) is not None and e.mixed < sent:
                log.info("finish: exchange %d with %s left open: mixed at neither end", sent, peer)
        # The notices land before this peer's leaving is announced (it follows finish): a
        # neighbour that hears of the leaving first would drop an exchange complete at its
        # end that this one mixed (``forget``). Bounded: a notice is best effort.
        for done in notices:
            done.wait(max(0.0, started + self.settings.round_timeout - time.monotonic()))

    def _notify_final(self, peer: str, header: pb.UpdateHeader, done: threading.Event) -> None:
        try:
            self.nb.push(peer, header, b"")
        except Exception as err:  # best effort: the neighbour's own finish wait is bounded
            log.debug("final notice to %s failed: %s", peer, err)
        finally:
            done.set()

    def _residual_norm(self, peers: list[str]) -> float:
        """RMS over edges of ||x − x̂_{i->j}||, what error feedback still has to send, as of
        each edge's last update (taken then from the difference it encoded: no extra pass;
        without error feedback, a pass per edge)."""
        edges = [e for p in peers if (e := self.edges.get(p)) is not None and e.sent]
        norms = [e.residual for e in edges]
        if not all(math.isfinite(n) for n in norms):
            with torch.no_grad(), self.state_lock:
                norms = [
                    n if math.isfinite(n) else difference_norm(self.x, e.public)
                    for n, e in zip(norms, edges, strict=True)
                ]
        return (sum(n * n for n in norms) / len(norms)) ** 0.5 if norms else 0.0

    # ------------------------------------------------------------------ interface

    def round_due(self, local_step: int) -> bool:
        return local_step % self.settings.local_steps == 0

    def after_step(self, local_step: int) -> RoundStats | None:
        if not self.round_due(local_step):
            return None
        return self.step_round()

    def consensus_round(self) -> RoundStats:
        return self.step_round(trained=False)

    def state_dict(self, for_joiner: bool = False, copy: bool = True) -> dict:
        return {"round": self._round}

    def load_state_dict(self, state: dict) -> None:
        self._round = int(state.get("round", 0))
        # Our public copies are gone or stale: every edge starts a new session (nothing is
        # mixed into the x just loaded).
        for peer in list(self.edges):
            self._end_session(peer)

    def close(self) -> None:
        self.nb.close()
