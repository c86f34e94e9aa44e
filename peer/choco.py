"""CHOCO-SGD gossip over per-edge public copies (Koloskova, Stich, Jaggi, ICML 2019).

One round, run by the training thread every H local steps:

1. For each neighbour j (after its previous push landed; a dead or stuck link is skipped and
   loses nothing, its backlog stays in x_i − x̂_{i->j}):
   q = Q(x_i − x̂_{i->j});  x̂_{i->j} += q;  push q (or a dense RESYNC) in the background.
   With ``gossip.error_feedback = false`` (an ablation) q = Q(x_i − b_{i->j}) instead, b
   being x_i at the previous send on that edge (DCD-PSGD, Tang et al., NeurIPS 2018): what Q
   drops is lost for good.
2. Wait, bounded by ``round_timeout``, until every live neighbour's update of round
   r − max_staleness has arrived (0: lock-step; 1: one round of overlap between compute and
   communication).
3. x_i += γ Σ_j w_ij (x̂_{j->i} − x̂_{i->j}), Metropolis–Hastings weights over the peers present.

Incoming updates are applied by the gRPC server threads as they arrive (``handle_update``),
each edge under its own lock, in sequence order -- except those from a round ahead of this
peer's, which are held until it gets there, so both ends of an edge mix the same copies and the
swarm average is preserved. Gaps and checksum mismatches are answered with NEED_RESYNC, which
makes the sender push its whole public copy next; duplicates are ignored.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from gossipgrad.compression import DecodeError, from_spec
from gossipgrad.peer.config import GossipSection
from gossipgrad.peer.edges import InEdge, OutEdge, Verdict
from gossipgrad.peer.flat import FlatParameters, tensor_checksum
from gossipgrad.peer.topology import metropolis_hastings_weights, topology_from_name
from gossipgrad.peer.transport import UpdateRejected
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

DENSE_SPEC = "none"
# A sender's seq can run ahead of what we took (pushes that failed still advance it), but not
# by billions; rounds likewise. Larger values are malformed, not progress.
MAX_SEQ_JUMP = 1 << 31
# Edges opened before this round start from the shared initial model (INIT, no payload);
# later ones (a late joiner, a rewired topology) from a dense copy of the current model.
INIT_ROUNDS = 50
MAX_ROUND = 1 << 48


@dataclass
class RoundStats:
    """What one gossip round did (for logs, metrics and tests)."""

    round: int
    neighbors: list[str]
    mixed: list[str]
    pushed: list[str]
    skipped_busy: list[str]
    waited_s: float
    consensus_distance: float
    residual_norm: float


def _clipped(diff: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``diff`` scaled down in place to L2 norm ``max_norm`` if longer (ClippedGossip,
    He, Karimireddy, Jaggi 2022): one neighbour moves us at most gamma * w * max_norm per
    round, whatever it sends. A non-finite pull is dropped entirely."""
    norm = float(torch.linalg.vector_norm(diff))
    if not math.isfinite(norm):
        return diff.zero_()
    if norm > max_norm:
        diff.mul_(max_norm / norm)
    return diff


class ChocoGossip:
    """CHOCO-SGD state and rounds for one peer.

    Args:
        flat: the model's parameters as one flat tensor (x_i, updated in place).
        cfg: the gossip section of the config.
        me: this peer's id; swarm: the swarm name.
        present_ids: callable returning the sorted ids of peers in the topology (self included).
        is_alive: callable(peer_id) -> bool, False for suspect or dead peers.
        push: callable(peer_id, header, payload) -> (PushReply, wire bytes), blocking.
        metrics: a PeerMetrics or None.
    """

    def __init__(
        self,
        flat: FlatParameters,
        cfg: GossipSection,
        me: str,
        swarm: str,
        present_ids: Callable[[], list[str]],
        is_alive: Callable[[str], bool],
        push: Callable[[str, pb.UpdateHeader, bytes], tuple[pb.PushReply, int]],
        metrics=None,
        seed: int = 0,
        state_lock: threading.RLock | None = None,
    ) -> None:
        self.flat = flat
        self.cfg = cfg
        self.me = me
        self.swarm = swarm
        self.codec = from_spec(cfg.codec)
        self.dense_codec = from_spec(DENSE_SPEC)
        self.topology = topology_from_name(cfg.topology, seed=seed, degree=cfg.degree)
        self._present_ids = present_ids
        self._is_alive = is_alive
        self._push = push
        self.metrics = metrics
        self.round = 0
        self.out_edges: dict[str, OutEdge] = {}
        self.in_edges: dict[str, InEdge] = {}
        self._edges_lock = threading.Lock()
        self._arrived = threading.Condition()
        self._lagging: set[str] = set()
        self._lag_heard: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="push")
        # Held while x is read for an update or written by mixing (not while waiting), so
        # a state download never sees a half-mixed model and never waits on the network.
        self.state_lock = state_lock if state_lock is not None else threading.RLock()
        self._direction = torch.zeros_like(flat.data)
        self._pulled = torch.zeros_like(flat.data)
        # Set by the owner: the incarnation membership knows for a peer (0: unknown).
        self.incarnation_of: Callable[[str], int] = lambda peer: 0

    # ------------------------------------------------------------------ topology

    def neighbors_at(self, round_: int, ids: list[str] | None = None) -> list[str]:
        """This peer's neighbours in a round, over the peers present now."""
        ids = ids if ids is not None else self._present_ids()
        n = len(ids)
        if n < 2:
            return []
        i = ids.index(self.me)
        return [ids[j] for j in self.topology.neighbors(i, n, round_)]

    def all_neighbors(self) -> set[str]:
        """Every peer this one gossips with in some round (for time-varying topologies)."""
        ids = self._present_ids()
        if len(ids) < 2:
            return set()
        i = ids.index(self.me)
        return {ids[j] for j in self.topology.all_neighbors(i, len(ids))}

    def weights_at(self, round_: int, ids: list[str]) -> dict[str, float]:
        """Metropolis–Hastings weights w_ij for this round (self excluded)."""
        n = len(ids)
        if n < 2:
            return {}
        i = ids.index(self.me)
        w = metropolis_hastings_weights(i, lambda k: self.topology.neighbors(k, n, round_))
        return {ids[j]: wij for j, wij in w.items() if j != i}

    # ------------------------------------------------------------------ edges

    def _out_edge(self, peer: str) -> OutEdge:
        with self._edges_lock:
            e = self.out_edges.get(peer)
            if e is None:
                e = self.out_edges[peer] = OutEdge(public=torch.zeros_like(self.flat.data))
            return e

    def _in_edge(self, peer: str) -> InEdge:
        with self._edges_lock:
            e = self.in_edges.get(peer)
            if e is None:
                e = self.in_edges[peer] = InEdge(
                    mirror=torch.zeros_like(self.flat.data),
                    incarnation=self.incarnation_of(peer),
                )
            return e

    def reset_peer(self, peer: str, restarted: bool = False) -> None:
        """Both edges with a peer resync. ``restarted``: the peer is a new incarnation whose
        sequence numbers start again at 0 (else its old seqs stay the replay floor)."""
        with self._edges_lock:
            out = self.out_edges.get(peer)
            inn = self.in_edges.get(peer)
        if out is not None:
            with out.lock:
                out.need_resync = True
        if inn is not None:
            with inn.lock:
                inn.invalidate()
                if restarted:
                    inn.expected_seq = 0

    def prune(self) -> None:
        """Drop edges to peers no longer present (frees their public copies)."""
        present = set(self._present_ids())
        with self._edges_lock:
            for table in (self.out_edges, self.in_edges):
                for peer in [p for p in table if p not in present]:
                    del table[peer]

    # ------------------------------------------------------------------ sending

    def _make_update(self, peer: str, edge: OutEdge) -> tuple[pb.UpdateHeader, bytes]:
        """Compress x - x̂ for one edge (or its whole x̂ for a resync) and advance x̂."""
        x = self.flat.data
        with edge.lock:
            if edge.need_resync and edge.seq < 0 and self.round < INIT_ROUNDS:
                # A fresh edge early in the run starts from the shared seeded initial model:
                # nothing to send but its checksum; q's then carry x - x0, compressed.
                edge.public.copy_(self.flat.initial)
                if not self.cfg.error_feedback:
                    edge.mark_sent(edge.public)
                payload = b""
                kind = pb.INIT
                edge.seq += 1
                edge.need_resync = False
            elif edge.need_resync:
                edge.public.copy_(x)
                if not self.cfg.error_feedback:
                    edge.mark_sent(x)
                payload = self.dense_codec.encode(edge.public)
                kind = pb.RESYNC
                edge.seq += 1
                edge.need_resync = False
                if self.metrics is not None:
                    self.metrics.record_resync(peer)
            else:
                t0 = time.perf_counter()
                if self.cfg.error_feedback:
                    # CHOCO: what Q dropped stays in x - x̂ and is sent later.
                    payload = self.codec.encode(x - edge.public, seed=edge.seq + 1)
                else:
                    # Ablation without error feedback (DCD-PSGD, Tang et al., NeurIPS 2018):
                    # compress the change of x since the last send; what Q drops is lost,
                    # and x̂ drifts away from x. The receiver's side is unchanged.
                    payload = self.codec.encode(x - edge.last_sent, seed=edge.seq + 1)
                    edge.mark_sent(x)
                self.codec.decode_add_(payload, edge.public)
                if self.metrics is not None:
                    self.metrics.observe_compress(time.perf_counter() - t0)
                kind = pb.DELTA
                edge.seq += 1
            header = pb.UpdateHeader(
                swarm=self.swarm,
                sender=self.me,
                receiver=peer,
                seq=edge.seq,
                round=self.round,
                kind=kind,
                checksum=tensor_checksum(edge.public),
                payload_size=len(payload),
                model_fingerprint=self.flat.fingerprint,
                dense_size=self.flat.nbytes,
            )
        return header, payload

    def _send(self, peer: str, edge: OutEdge, header: pb.UpdateHeader, payload: bytes) -> None:
        kind = "update" if header.kind == pb.DELTA else "resync"
        t0 = time.perf_counter()
        try:
            reply, wire_bytes = self._push(peer, header, payload)
        except Exception as err:
            # The receiver may or may not have applied it; if not, it sees a gap next time
            # and asks for a resync. Nothing to undo here.
            log.warning("push to %s failed: %s", peer, err)
            with edge.lock:
                if isinstance(err, grpc.RpcError) and err.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    edge.need_resync = True
                edge.release()
            return
        if self.metrics is not None:
            self.metrics.observe_push(peer, time.perf_counter() - t0)
            self.metrics.record_sent(peer, kind, wire_bytes, dense_bytes=header.dense_size)
        with edge.lock:
            if reply.status == pb.PushReply.NEED_RESYNC:
                log.info("%s asks for a resync (%s)", peer, reply.detail)
                edge.need_resync = True
            edge.release()

    # ------------------------------------------------------------------ receiving

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Apply one incoming update to the mirror of its edge (server thread)."""
        if header.model_fingerprint != self.flat.fingerprint:
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "fingerprint",
                f"model fingerprint {header.model_fingerprint!r} != ours {self.flat.fingerprint!r}",
            )
        if header.receiver != self.me:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"update addressed to {header.receiver!r}, this is {self.me!r}",
            )
        if header.kind not in (pb.DELTA, pb.RESYNC, pb.INIT) or (
            header.kind == pb.INIT and len(payload) != 0
        ):
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"unknown kind {header.kind}"
            )
        edge = self._in_edge(header.sender)
        with edge.lock:
            if header.seq > edge.expected_seq + MAX_SEQ_JUMP or header.round > MAX_ROUND:
                # Implausible counters would set a floor no genuine update can pass.
                raise UpdateRejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "malformed",
                    f"implausible seq {header.seq} / round {header.round} "
                    f"(expected seq {edge.expected_seq})",
                )
            before = (edge.synced, edge.expected_seq)
            edge.heard_round = max(edge.heard_round, header.round)
            try:
                verdict = edge.admit(header.kind != pb.DELTA, header.seq)
                if verdict is None:
                    # An update from a round ahead of ours waits, so that this round's
                    # mixing sees the sender's copy as of this round (symmetric exchange).
                    if edge.pending or header.round > self.round:
                        edge.hold(header, bytes(payload))
                        verdict = Verdict.ACCEPTED
                    else:
                        verdict = self._apply(edge, header, payload)
            except DecodeError as err:
                # Nothing was applied; if the sender's copy moved on, the next seq is a gap.
                raise UpdateRejected(
                    grpc.StatusCode.INVALID_ARGUMENT, "decode_error", str(err)
                ) from None
            expected = edge.expected_seq
        if verdict is Verdict.NEED_RESYNC:
            log.info(
                "edge %s->%s needs a resync: got %s seq %d (round %d), edge synced=%s expected %d",
                header.sender,
                self.me,
                pb.UpdateKind.Name(header.kind),
                header.seq,
                header.round,
                *before,
            )
        with self._arrived:
            self._arrived.notify_all()
        status = {
            Verdict.ACCEPTED: pb.PushReply.ACCEPTED,
            Verdict.DUPLICATE: pb.PushReply.DUPLICATE,
            Verdict.NEED_RESYNC: pb.PushReply.NEED_RESYNC,
        }[verdict]
        return pb.PushReply(status=status, expected_seq=expected, detail=verdict.value)

    def _apply(self, edge: InEdge, header: pb.UpdateHeader, payload) -> Verdict:
        """Fold one admitted update into the edge's mirror (edge lock held)."""
        if header.kind == pb.INIT:
            # Our own initial model; a different one fails the checksum -> NEED_RESYNC.
            return edge.apply_resync(header.seq, header.round, self.flat.initial, header.checksum)
        if header.kind == pb.RESYNC:
            dense = self.dense_codec.decode(payload, max_numel=self.flat.numel)
            return edge.apply_resync(header.seq, header.round, dense, header.checksum)
        self.codec.decode_add_(payload, edge.mirror)
        return edge.finish_delta(header.seq, header.round, header.checksum)

    def _drain(self, edge: InEdge) -> None:
        """Apply held updates of rounds up to the current one, in order (edge lock held)."""
        while edge.pending and edge.pending[0][0].round <= self.round:
            header, payload = edge.pending.popleft()
            try:
                verdict = self._apply(edge, header, payload)
            except DecodeError as err:
                log.warning("held update from %s undecodable: %s", header.sender, err)
                verdict = Verdict.NEED_RESYNC
            if verdict is not Verdict.ACCEPTED:
                edge.invalidate()

    # ------------------------------------------------------------------ the round

    def _wait_target(self, peer: str, ids: list[str]) -> int | None:
        """The round whose update from `peer` we wait for, or None if none is due."""
        r = self.round - self.cfg.max_staleness
        period = self.topology.period(len(ids)) if self.topology.time_varying else 1
        for back in range(period):
            cand = r - back
            if cand < 0:
                return None
            if peer in self.neighbors_at(cand, ids):
                return cand
        return None

    def _wait_for_neighbors(self, ids: list[str], neighbors: list[str]) -> float:
        """Block until lagging-free neighbours' due updates arrived, at most round_timeout."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.round_timeout
        # The round due from each neighbour does not change while we wait: compute it once.
        targets = {p: self._wait_target(p, ids) for p in neighbors}
        due = {p: t for p, t in targets.items() if t is not None}

        def missing() -> list[str]:
            out = []
            for peer, target in due.items():
                if peer in self._lagging or not self._is_alive(peer):
                    continue
                edge = self.in_edges.get(peer)
                # Heard counts, applied or not: a refused update means the sender resyncs
                # next round, and waiting for that would deadlock the pair.
                if edge is None or edge.heard_round < target:
                    out.append(peer)
            return out

        with self._arrived:
            waiting = missing()
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("round %d: no update from %s in time", self.round, waiting)
                    for peer in waiting:
                        self._lagging.add(peer)
                        edge = self.in_edges.get(peer)
                        self._lag_heard[peer] = edge.heard_round if edge is not None else -1
                    break
                self._arrived.wait(timeout=min(left, 0.1))
                waiting = missing()
        # A lagging peer is waited for again as soon as it is heard from: a slow neighbour
        # paces this peer (bounded by max_staleness), only a silent one is left behind.
        for peer in list(self._lagging):
            edge = self.in_edges.get(peer)
            if edge is not None and edge.heard_round > self._lag_heard.get(peer, -1):
                self._lagging.discard(peer)
        return time.monotonic() - t0

    def step_round(self) -> RoundStats:
        """Run one gossip round (see the module docstring). Called by the training thread."""
        t_round = time.perf_counter()
        ids = self._present_ids()
        neighbors = self.neighbors_at(self.round, ids)
        pushed, skipped = [], []
        deadline = time.monotonic() + self.cfg.round_timeout
        for peer in neighbors:
            edge = self._out_edge(peer)
            # Back-pressure: the previous push on this edge must land first (the neighbour
            # may be waiting for this round's update). A dead or stuck link is skipped, and
            # what it misses stays in x - x̂ for later: nothing is lost.
            if edge.busy and self._is_alive(peer):
                edge.idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            with edge.lock:
                if not edge.claim():
                    skipped.append(peer)
                    continue
            try:
                with self.state_lock:
                    header, payload = self._make_update(peer, edge)
            except Exception:
                with edge.lock:
                    edge.release()
                raise
            self._pool.submit(self._send, peer, edge, header, payload)
            pushed.append(peer)

        waited = self._wait_for_neighbors(ids, neighbors)

        weights = self.weights_at(self.round, ids)
        x = self.flat.data
        direction, pulled = self._direction, self._pulled
        direction.zero_()
        pulled.zero_()
        mixed, residual_sq = [], 0.0
        with torch.no_grad(), self.state_lock:
            for peer in neighbors:
                out = self.out_edges.get(peer)
                inn = self.in_edges.get(peer)
                if out is None or inn is None or not self._is_alive(peer):
                    continue
                # Both locks: a concurrent apply must not tear the copies we read.
                with inn.lock, out.lock:
                    self._drain(inn)
                    if not inn.valid or out.seq < 0:
                        continue
                    w = weights.get(peer, 0.0)
                    clip = self.cfg.robust_clip
                    if clip > 0:
                        direction.add_(_clipped(inn.mirror - out.public, clip), alpha=w)
                    else:
                        direction.add_(inn.mirror, alpha=w).sub_(out.public, alpha=w)
                    pulled.add_(inn.mirror - x, alpha=w)
                    residual_sq += float(torch.linalg.vector_norm(x - out.public)) ** 2
                mixed.append(peer)
            # ||x_i - (w_ii x_i + sum_j w_ij xhat_j)||: distance to the neighbourhood average.
            dist = float(torch.linalg.vector_norm(pulled))
            x.add_(direction, alpha=self.cfg.gamma)
        stats = RoundStats(
            round=self.round,
            neighbors=neighbors,
            mixed=mixed,
            pushed=pushed,
            skipped_busy=skipped,
            waited_s=waited,
            consensus_distance=dist,
            residual_norm=(residual_sq / max(1, len(mixed))) ** 0.5,
        )
        if self.metrics is not None:
            self.metrics.observe_round(time.perf_counter() - t_round)
            self.metrics.set_consensus_distance(dist)
            self.metrics.set_error_feedback_norm(stats.residual_norm)
            self.metrics.set_neighbors(len(mixed))
        self.round += 1
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
