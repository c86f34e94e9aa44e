"""Algorithm ``exact-diloco``: DiLoCo whose outer step takes the exact mean of every peer's
compressed pseudo-gradient, disseminated over the gossip graph (no all-reduce, no coordinator).

``diloco`` averages each pseudo-gradient over a neighbourhood and keeps the anchors together by
gossiping them: the replicas differ (consensus error) and each outer step sees a partial
average. Here every peer's message reaches every peer, as in the systems that train across the
internet with sparse updates (SparseLoCo: top-k + 2-bit values with error feedback, H = 30;
DeMo), so all replicas apply the same mean and stay bit-identical. It is a ``gossip.algorithm``
of its own rather than a ``diloco`` option because it shares none of diloco's exchange: no
anchors' CHOCO gossip (``anchor_codec``, ``anchor_gamma`` mean nothing), no neighbourhood
weights, a wire kind of its own. Each peer i keeps an anchor a (the same at every peer) and
runs phases of H = ``gossip.local_steps`` inner steps of its own optimizer. At the end of phase
r:

1. c_i = Q(e_i + a − θ_i);  e_i += a − θ_i − decode(c_i)   (error feedback: what Q drops stays
   in e_i and goes out in a later phase; nothing is lost).
2. c_i goes down the breadth-first tree of the gossip graph rooted at i; every peer forwards
   each message it receives for the first time to its children in the message's tree
   (peer/algorithms/dissemination.py): each peer receives each message once, and uploads about
   n − 1 messages per phase on average.
3. Wait (at most ``round_timeout``) until the messages of phase r of every live peer are here;
   the phase is then closed with the messages held: later ones are late, neither applied nor
   forwarded.
4. Δ̄ = (1/m) Σ_o decode(c_o) over the m messages held, summed in origin-id order, and the
   outer step a −= η (Δ̄ + ...) (peer/algorithms/outer.py; SparseLoCo puts error feedback in
   place of outer momentum, so μ = 0 by default). Same anchor, same bytes, same order: the
   same bits at every peer.
5. θ = a; the checksum of the new anchor goes with the next phase's message, so a peer whose
   replica differs from the sender's sees it (``gossipgrad_anchor_mismatches_total``), and the
   history is in status.json and summary.json (``anchor_checksum``, ``anchor_checksums``).

A message the tree did not bring (views that differ for a moment, a forwarder that died) is
asked for from the graph neighbours a while into the wait. Under churn a phase still closes
with what arrived by the deadline, and a replica can end a phase apart from the others (it
missed a message that the rest applied, or it restarted from an older checkpoint). The
checksums bring it back:

* a peer whose phase's messages show that most origins (ties: the smallest origin's group)
  started the phase from another anchor asks that group's smallest origin for its anchor of
  the next phase (an empty ANCHOR update; answered once the asked peer has reached that
  phase), waits for it at its next phase end (at most ``round_timeout``) and takes it, the
  steps since the phase began kept on top (θ += a' − a);
* a peer phases behind (its message is answered late by a peer two phases or more past it,
  or a message comes from four or more phases ahead) asks the same, stops waiting for its
  stale phase once an anchor of a later phase is here, puts its own late message back into
  its residual, and starts the swarm's phase from that anchor.

A replica is therefore apart for at most a phase or two (tested: a peer killed and restarted
from its checkpoint 30 phases behind). The outer momentum of a peer that took an anchor
restarts at 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc
import torch
from gossipgrad.compression import DecodeError, ErrorFeedback, from_spec
from gossipgrad.compression.engine import Encoded
from gossipgrad.peer.algorithms.averaging import Average, kept_residual
from gossipgrad.peer.algorithms.base import GossipAlgorithm, RoundStats
from gossipgrad.peer.algorithms.dissemination import (
    Message,
    Offer,
    PhaseStore,
    spanning_children,
)
from gossipgrad.peer.algorithms.neighbours import Neighbourhood
from gossipgrad.peer.algorithms.outer import OuterSettings, outer_step, restore_outer
from gossipgrad.peer.algorithms.phase_clock import PhaseClock
from gossipgrad.peer.flat import FlatParameters, copy_with_checksum, tensor_checksum
from gossipgrad.peer.network.errors import UpdateRejected
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Phases whose anchor checksum is kept for the records (the latest ones).
CHECKSUM_HISTORY = 4096
#: Tries of one forward to one peer (a failed push of a message its subtree needs).
PUSH_TRIES = 3
_NAME = "pseudo_gradient"


@dataclass(frozen=True)
class _Anchor:
    """An anchor another peer sent (whole): the one it starts ``phase`` from."""

    phase: int
    anchor: torch.Tensor
    checksum: int
    sender: str


class ExactDiLoCo(GossipAlgorithm):
    """Exact-aggregation DiLoCo for one peer (module docstring).

    Args:
        flat: the model's parameters θ (updated in place).
        codec: compression spec of the pseudo-gradients.
        error_feedback: keep what the codec drops (False: the ablation without).
        neighbourhood: the neighbour layer (ids, topology, pushes, waiting).
        outer: H, outer lr and momentum.
        round_timeout: seconds a phase waits for the messages of the live peers.
        state_lock: held while θ and the anchor are read or written.
        metrics: a PeerMetrics or None.
    """

    name = "exact-diloco"
    kinds = (pb.SHARED, pb.ANCHOR)

    def __init__(
        self,
        flat: FlatParameters,
        codec: str,
        error_feedback: bool,
        neighbourhood: Neighbourhood,
        outer: OuterSettings,
        round_timeout: float,
        state_lock: threading.RLock,
        metrics=None,
    ) -> None:
        # hyperparameters
        self.outer = outer
        self.round_timeout = round_timeout
        self.codec = from_spec(codec)
        self.dense = from_spec("none")  # an anchor sent whole, to a peer that resyncs
        # collaborators
        self.flat = flat
        self.nb = neighbourhood
        self.state_lock = state_lock
        self.metrics = metrics
        # internal state
        self.anchor = flat.data.detach().clone()  # θ at the phase's start, alike everywhere
        self.momentum = torch.zeros_like(self.anchor) if outer.momentum > 0 else None
        self.feedback = ErrorFeedback(self.codec) if error_feedback else None
        self.store = PhaseStore()
        self.clock = PhaseClock(outer.local_steps, outer.qsr_alpha)
        self._lr = 0.0  # the learning rate of the latest inner step (QSR's η)
        self._ended_step = 0  # the latest step whose phase end is applied (under state_lock)
        self._phase = 0
        self._checksum = tensor_checksum(self.anchor)
        self._finished = False
        self._resync: _Anchor | None = None  # an anchor received, adopted at a phase's end
        self._resync_lock = threading.Lock()
        self._asked_anchor = -1  # the latest phase whose anchor this peer asked for
        self._awaited: str | None = None  # the peer asked, until its anchor came
        # peer -> the phase whose anchor it asked for, answered once reached (one per peer)
        self._anchor_requests: dict[str, int] = {}
        # statistics
        self.checksums: OrderedDict[int, int] = OrderedDict({0: self._checksum})
        self.mismatches = 0  # messages whose origin's anchor differed from ours
        self.late = 0  # messages that arrived after their phase closed here
        self.received = 0  # other peers' messages taken (each once)
        self.asked = 0  # messages asked for (a phase's wait found them missing)
        self.forwarded = 0  # messages handed to the push lanes (own ones included)
        self.last_applied: list[str] = []  # the origins of the latest phase's mean
        self.resyncs = 0  # anchors adopted from another peer

    @property
    def round(self) -> int:
        return self._phase

    @property
    def residual(self) -> torch.Tensor:
        """e: what the codec has dropped so far and will send later (zeros without EF)."""
        e = kept_residual(self.feedback, _NAME)
        return torch.zeros_like(self.anchor) if e is None else e

    def anchor_checksums(self) -> dict[int, str]:
        """Phase -> checksum (hex) of the anchor each phase started from (the latest ones)."""
        return {p: f"{c:016x}" for p, c in self.checksums.items()}

    # ------------------------------------------------------------------ dissemination

    def _children(self, origin: str) -> list[str]:
        return spanning_children(self.nb.topology, self.nb.ids(), origin, self.nb.me)

    def _forward(self, message: Message, skip: str = "") -> list[str]:
        """Push ``message`` to this peer's children in its origin's tree (rule 1)."""
        children = [p for p in self._children(message.origin) if p != skip]
        for peer in children:
            self.nb.submit_in_order(peer, self._push, peer, message)
        self.forwarded += len(children)
        return children

    def _push(self, peer: str, message: Message) -> None:
        header = self.nb.header(
            peer,
            pb.SHARED,
            message.payload,
            seq=message.phase,
            round=message.phase,
            origin=message.origin,
            checksum=message.checksum,
            **({} if message.payload else {"dense_size": 0}),  # a want is no model update
        )
        for attempt in range(PUSH_TRIES):
            if not self.nb.view.is_alive(peer):
                return
            try:
                reply = self.nb.push(peer, header, message.payload)
            except Exception as err:
                log.info("push of %s's phase %d to %s failed: %s", message.origin,
                         message.phase, peer, err)  # fmt: skip
                if isinstance(err, UpdateRejected) or attempt + 1 == PUSH_TRIES:
                    return
                continue
            if reply.status not in (pb.PushReply.ACCEPTED, pb.PushReply.DUPLICATE):
                log.info("%s did not take %s's phase %d: %s", peer, message.origin,
                         message.phase, reply.detail)  # fmt: skip
            elif reply.detail == Offer.LATE.value and reply.expected_seq > message.phase + 1:
                # The peer is two phases or more past the one of this message: so is the
                # swarm (this peer restarted from an older state, or was cut off).
                self._ask_anchor(peer, reply.expected_seq)
            return

    def _ask(self, phase: int, missing: list[str]) -> None:
        """Ask every graph neighbour for the messages of ``phase`` still missing (rule 3 of
        dissemination.py): an empty SHARED update naming the origin."""
        for peer in sorted(self.nb.all_neighbors()):
            for origin in missing:
                want = Message(origin, phase, b"", 0)
                self.nb.submit_in_order(peer, self._push, peer, want)
        self.asked += len(missing)

    def _answer(self, header: pb.UpdateHeader) -> pb.PushReply:
        """A neighbour asks for (origin, phase): send it if held here."""
        found = self.store.lookup(header.origin, header.round)
        if found is not None:
            self.nb.submit_in_order(header.sender, self._push, header.sender, found)
        return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="want")

    # ------------------------------------------------------------------ resyncing a replica

    def _ask_anchor(self, peer: str, phase: int) -> None:
        """Ask ``peer`` for the anchor it starts ``phase`` from (an empty ANCHOR update), once
        per phase: this replica differs from the swarm's, or the swarm is phases ahead. The
        next phase end waits for it (at most ``round_timeout``) and takes it."""
        if peer == self.nb.me:
            return
        with self._resync_lock:
            if self._asked_anchor >= phase:
                return
            self._asked_anchor = phase
            self._awaited = peer
        log.warning("this replica is not the swarm's; asking %s for its anchor of phase %d",
                    peer, phase)  # fmt: skip
        header = self.nb.header(peer, pb.ANCHOR, b"", round=phase, dense_size=0)
        self.nb.submit_in_order(peer, self._push_anchor, peer, header, b"")

    def _answer_anchors(self) -> None:
        """Answer the requests for an anchor of a phase this peer has now reached."""
        with self._resync_lock:
            due = [p for p, ph in self._anchor_requests.items() if ph <= self._phase]
            for p in due:
                del self._anchor_requests[p]
        for peer in due:
            self.nb.submit_in_order(peer, self._send_anchor, peer)

    def _await_anchor(self) -> None:
        """An anchor was asked for: wait for it (at most ``round_timeout``)."""
        with self._resync_lock:
            peer = self._awaited
        if peer is None:
            return
        self.nb.wait(
            lambda: [] if self._awaited is None else [peer], self.round_timeout, "an anchor"
        )
        with self._resync_lock:
            self._awaited = None

    def _send_anchor(self, peer: str) -> None:
        """Answer a peer that asked: this peer's anchor, whole, and the phase it starts."""
        with torch.no_grad(), self.state_lock:
            data = self.dense.encode(self.anchor)
            phase, checksum = self._phase, self._checksum
        header = self.nb.header(peer, pb.ANCHOR, data, round=phase, checksum=checksum, dense_size=0)
        self._push_anchor(peer, header, data)

    def _push_anchor(self, peer: str, header: pb.UpdateHeader, data: bytes) -> None:
        if not self.nb.view.is_alive(peer):
            return
        try:
            self.nb.push(peer, header, data)
        except Exception as err:
            log.info("anchor push to %s failed: %s", peer, err)

    def _take_anchor(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """An ANCHOR update: a request (empty: send ours) or an anchor to adopt at the next
        phase end (kept if it is the newest phase offered and its checksum holds)."""
        if header.payload_size == 0:  # answered once this peer has reached that phase
            with self._resync_lock:
                self._anchor_requests[header.sender] = header.round
            self._answer_anchors()
            return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="anchor wanted")
        anchor = torch.zeros_like(self.anchor)
        try:
            self.dense.decode_add_(bytes(payload), anchor)
        except (DecodeError, ValueError, RuntimeError) as err:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "decode_error", f"anchor: {err}"
            ) from None
        if tensor_checksum(anchor) != header.checksum:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", "anchor checksum mismatch"
            )
        with self._resync_lock:
            if self._resync is None or header.round > self._resync.phase:
                self._resync = _Anchor(header.round, anchor, header.checksum, header.sender)
            if self._awaited == header.sender:
                self._awaited = None
        self.nb.heard(header.sender)
        return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="anchor")

    def _resync_ahead(self, phase: int) -> bool:
        """An anchor of a later phase than ``phase`` is here: this peer is behind."""
        with self._resync_lock:
            return self._resync is not None and self._resync.phase > phase

    def _adopt(self, keep_progress: bool) -> bool:
        """Take the anchor received, if it starts this phase or a later one: the anchor, its
        phase and checksum become this peer's (the outer momentum restarts at 0); with
        ``keep_progress`` the parameters keep the steps taken since the phase began on top
        of it (θ += a' − a), else they start from it."""
        with self._resync_lock:
            got, self._resync = self._resync, None
        if got is None or got.phase < self._phase:
            return False
        with torch.no_grad(), self.state_lock:
            if keep_progress:
                self.flat.data.add_(got.anchor).sub_(self.anchor)
            else:
                self.flat.data.copy_(got.anchor)
            self.anchor.copy_(got.anchor)
            if self.momentum is not None:
                self.momentum.zero_()
            self._phase, self._checksum = got.phase, got.checksum
        self.store.advance(got.phase)
        self._remember(got.phase, got.checksum)
        self.resyncs += 1
        if self.metrics is not None:
            self.metrics.record_resync(got.sender)
        log.warning("took %s's anchor: phase %d, %016x", got.sender, got.phase, got.checksum)
        self._answer_anchors()
        return True

    def _reference(self, messages: list[Message], started: int) -> Message | None:
        """The message whose origin holds the swarm's replica at this phase: of the
        checksum most origins share (ties: the one the smallest origin has), the smallest
        origin's message; None if this peer started the phase from that replica
        (``started``: its checksum)."""
        groups: dict[int, list[str]] = {}
        for m in messages:
            groups.setdefault(m.checksum, []).append(m.origin)
        best = min(groups, key=lambda c: (-len(groups[c]), min(groups[c])))
        if best == started:
            return None
        first = min(groups[best])
        return next(m for m in messages if m.origin == first)

    # ------------------------------------------------------------------ receiving

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Take one message (a server thread): store it if new, forward it down its tree; an
        empty one asks for a message (rule 3 of dissemination.py); an ANCHOR asks for or
        brings an anchor (a replica that resyncs)."""
        self.nb.check(header, self.kinds)
        if header.kind == pb.ANCHOR:
            return self._take_anchor(header, payload)
        if header.payload_size == 0:
            return self._answer(header)
        data = bytes(payload)
        try:
            kept = self.codec.receive(data, max_numel=max(self.anchor.numel(), 1))
        except DecodeError as err:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "decode_error", str(err)
            ) from None
        if kept.shape != tuple(self.anchor.shape) or kept.dtype != self.anchor.dtype:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"vector {list(kept.shape)} {kept.dtype} does not fit {self.anchor.numel()} values",
            )
        message = Message(header.origin, header.round, data, header.checksum, kept)
        offer = self.store.offer(message, set(self.nb.view.present_ids()) | {self.nb.me})
        if offer is Offer.EARLY:
            self._ask_anchor(header.sender, message.phase)  # we are phases behind
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "stale",
                f"phase {message.phase} is too far ahead of {self.store.first_open}",
            )
        if offer is Offer.UNKNOWN:
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "unknown_sender",
                f"origin {message.origin!r} is not a peer of this swarm",
            )
        self.nb.heard(header.sender)
        if offer is Offer.NEW:
            self.received += 1
            if message.origin != header.sender:
                self.nb.heard(message.origin)  # its message travels: it is not lagging
            self._forward(message, skip=header.sender)
            return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="shared")
        if offer is Offer.LATE:
            self.late += 1
        # expected_seq: the oldest phase still open here (a sender far behind it resyncs).
        return pb.PushReply(
            status=pb.PushReply.DUPLICATE, detail=offer.value, expected_seq=self.store.first_open
        )

    # ------------------------------------------------------------------ a phase's end

    def observe_learning_rate(self, lr: float) -> None:
        self._lr = lr

    def round_due(self, local_step: int) -> bool:
        return self.clock.due(local_step)

    def phase_end_pending(self, local_step: int) -> bool:
        return self.round_due(local_step) and self._ended_step != local_step

    def after_step(self, local_step: int) -> RoundStats | None:
        if not self.round_due(local_step) or self._finished:
            return None
        return self._phase_end(local_step)

    def _ended(self, local_step: int | None) -> None:
        """Under the state lock, with the anchor the next phase starts from: the step this
        phase ended at and the next one's end, so that a joiner's state is never taken
        between them (None: the run's last, partial phase)."""
        if local_step is None:
            return
        self._ended_step = local_step
        length = self.clock.length
        if self.clock.ended(local_step, self._lr) != length:
            log.info("phase %d: %d inner steps (QSR at learning rate %.3g)", self._phase,
                     self.clock.length, self._lr)  # fmt: skip

    def _phase_end(self, local_step: int | None) -> RoundStats:
        """Steps 1-5 of the module docstring, at the end of step ``local_step``."""
        t0 = time.perf_counter()
        self._await_anchor()
        self._adopt(keep_progress=True)  # an anchor received during the phase
        phase = self._phase
        with torch.no_grad(), self.state_lock:
            payload, built = self._compress()
        own = Message(self.nb.me, phase, payload, self._checksum)
        self.store.offer(own, {self.nb.me})
        pushed = self._forward(own)
        ids = self.nb.ids()

        def missing() -> list[str]:
            if self._resync_ahead(phase):
                return []  # the swarm is past this phase: nothing more will come for it
            return [p for p in self.nb.ids() if p not in self.store.holds(phase)]

        next_ask = time.monotonic() + self._ask_after()

        def repair() -> None:
            nonlocal next_ask
            if time.monotonic() >= next_ask:
                if lacking := missing():
                    self._ask(phase, lacking)
                next_ask = time.monotonic() + self._ask_after()

        waited = self.nb.wait(missing, self.round_timeout, f"phase {phase}", on_wake=repair)
        if self._resync_ahead(phase):
            return self._skip_to_swarm(phase, payload, waited, t0, local_step)
        messages = self.store.close(phase)
        self.last_applied = [m.origin for m in messages]
        started = self._checksum  # the anchor this phase started from
        mismatched = [m.origin for m in messages if m.checksum != started]
        # The own message as its encoder built it, the others' as their receipt kept them:
        # the same bits as their bytes, which are not read again.
        w = 1.0 / len(messages)
        terms = [(m.payload if m.kept is None else m.kept, w) for m in messages]
        if built is not None:
            terms = [(built if c is payload else c, w) for c, w in terms]
        step = Average(self.codec, tuple(terms))
        with torch.no_grad(), self.state_lock:
            outer_step(self.anchor, step, self.momentum, self.outer)
            self._checksum = copy_with_checksum(self.flat.data, self.anchor)
            self._phase += 1
            self._ended(local_step)
        self._remember(self._phase, self._checksum)
        self._answer_anchors()
        if mismatched:
            self.mismatches += len(mismatched)
            log.warning("phase %d: the replicas of %s started it from another anchor",
                        phase, mismatched)  # fmt: skip
            reference = self._reference(messages, started)
            if reference is not None:
                self._ask_anchor(reference.origin, self._phase)
        stats = RoundStats(
            round=phase,
            neighbors=ids,
            mixed=[m.origin for m in messages],
            pushed=pushed,
            waited_s=waited,
            consensus_distance=0.0 if not mismatched else float("nan"),
            residual_norm=self._residual_norm(),
            anchor_checksum=f"{self._checksum:016x}",
        )
        if self.metrics is not None:
            self.metrics.observe_round(time.perf_counter() - t0)
            self.metrics.set_error_feedback_norm(stats.residual_norm)
            self.metrics.set_neighbors(len(messages) - 1)
            if mismatched:
                self.metrics.record_anchor_mismatches(len(mismatched))
        return stats

    def _skip_to_swarm(
        self, phase: int, payload: bytes, waited: float, t0: float, local_step: int | None
    ) -> RoundStats:
        """The swarm is past ``phase`` (an anchor of a later one came): its own message was
        late everywhere, so what it carried goes back into the residual (sent later), and
        the peer takes the anchor, the parameters starting from it."""
        if kept_residual(self.feedback, _NAME) is not None:
            with torch.no_grad():
                self.feedback.put_back(_NAME, payload)
        self.store.close(phase)
        self._adopt(keep_progress=False)
        with self.state_lock:
            self._ended(local_step)
        if self.metrics is not None:
            self.metrics.observe_round(time.perf_counter() - t0)
        return RoundStats(
            round=phase,
            neighbors=self.nb.ids(),
            mixed=[],
            pushed=[],
            waited_s=waited,
            anchor_checksum=f"{self._checksum:016x}",
        )

    def _ask_after(self) -> float:
        """Seconds into a phase's wait before missing messages are asked for, and between
        asks: a few round trips, at most a quarter of the wait."""
        trip = self.nb.round_trip() or 0.05
        return min(self.round_timeout / 4, max(1.0, 8 * trip))

    def _compress(self) -> tuple[bytes, Encoded | None]:
        """Step 1: c = Q(e + a − θ), with no model-sized a − θ where error feedback is on;
        with it, what the encoder built (the own term of the mean, ``Average``)."""
        t0 = time.perf_counter()
        seed = self._phase + 1
        built = None
        if self.feedback is not None:
            data, built = self.feedback.compress_difference_parts(
                _NAME, self.anchor, self.flat.data, seed
            )
        else:
            data = self.codec.encode(self.anchor - self.flat.data, seed=seed)
        if self.metrics is not None:
            self.metrics.observe_compress(time.perf_counter() - t0)
        return data, built

    def _residual_norm(self) -> float:
        return 0.0 if self.feedback is None else self.feedback.residual_norm(_NAME)

    def _remember(self, phase: int, checksum: int) -> None:
        self.checksums[phase] = checksum
        while len(self.checksums) > CHECKSUM_HISTORY:
            self.checksums.popitem(last=False)

    # ------------------------------------------------------------------ the rest

    def consensus_round(self) -> RoundStats:
        """Gossip-only: the replicas are the same already; nothing to exchange."""
        return RoundStats(
            round=self._phase,
            neighbors=[],
            mixed=[],
            pushed=[],
            consensus_distance=0.0,
            anchor_checksum=f"{self._checksum:016x}",
        )

    def finish(self, interrupted: bool = False) -> None:
        """A last, partial phase (every peer took the same steps, so every peer runs it), and
        the forwards still queued (at most ``round_timeout``); then nothing more: the
        parameters end on the anchor. Interrupted: nothing new is sent."""
        if self._finished:
            return
        if not interrupted:
            with torch.no_grad(), self.state_lock:
                partial = not torch.equal(self.anchor, self.flat.data)
            if partial:
                self._phase_end(None)
        # The forwards of the last phase: a subtree waits for them, and leaving cancels them.
        if not self.nb.drain(self.round_timeout if not interrupted else 1.0):
            log.warning("finished with forwards still queued: the neighbours may miss some")
        self._finished = True

    def state_dict(self, for_joiner: bool = False, copy: bool = True) -> dict:
        taken = torch.Tensor.clone if copy else torch.Tensor.detach
        with self.state_lock:
            state = {
                "anchor": taken(self.anchor),
                "phase": self._phase,
                "clock": self.clock.state_dict(),
                "ended_step": self._ended_step,
            }
            if self.momentum is not None:
                state["momentum"] = taken(self.momentum)
            if self.feedback is not None and not for_joiner:
                state["feedback"] = self.feedback.state_dict(copy)
            return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad(), self.state_lock:
            self._phase = restore_outer(self.anchor, self.momentum, state)
            self._checksum = tensor_checksum(self.anchor)
            self.clock.load_state_dict(state.get("clock"))
            self._ended_step = int(state.get("ended_step", 0))
        if self.feedback is not None:
            if "feedback" in state:
                self.feedback.load_state_dict(state["feedback"])
            else:
                self.feedback.reset()
        self.store.reset(self._phase)
        self._remember(self._phase, self._checksum)

    def forget(self, peer: str) -> None:
        """A restarted or departed peer: its messages already held stay (they are part of
        the phase at every peer that holds them)."""
        return

    def prune(self, present: set[str]) -> None:
        return

    def close(self) -> None:
        self.nb.close()
