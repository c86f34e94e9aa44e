"""Neighbourhood averaging of an error-feedback-compressed vector, one message per exchange.

Used by ``ef-gradient`` (the vector is a step's gradient; Deep Gradient Compression, Lin et
al., ICLR 2018; EF-SGD, Karimireddy et al., ICML 2019) and by ``diloco`` (a phase's
pseudo-gradient; SparseLoCo keeps error feedback on it the same way). For each exchange:

1. c_i = Q(e_i + v_i);  e_i += v_i − decode(c_i)      (compression.ErrorFeedback)
   With ``gossip.error_feedback = false`` (an ablation): c_i = Q(v_i), nothing kept.
2. c_i goes to every live neighbour (one encoding for all of them).
3. Wait, at most ``round_timeout``, for one c_j from each live neighbour, then return the
   Metropolis–Hastings average of decode(c_i) and the c_j that arrived (the weights of missing
   neighbours are left out and the rest renormalised).

Incoming vectors wait in a short FIFO per sender, so peers whose counters differ (a restart, a
late joiner) still pair up their messages. Pairing by arrival needs each sender's vectors to
arrive in the order they were sent, once: the pushes to one neighbour run one after another
on the push pool (``Neighbourhood.submit_in_order``; on parallel threads a slow push of
exchange r let r + 1 overtake it, and the receiver averaged r + 1 into its r), and a vector
whose exchange number (header ``seq``) repeats the sender's last one is a retried push that
had arrived, answered DUPLICATE. These vectors are not increments of any shared copy: a lost
message costs one exchange some information but breaks no invariant, so there are no
sessions or resyncs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc
import torch
from gossipgrad.compression import Codec, DecodeError, Encoded, ErrorFeedback, Received, from_spec
from gossipgrad.peer.algorithms.neighbours import Neighbourhood
from gossipgrad.peer.network.errors import UpdateRejected
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Vectors kept per sender before the oldest are dropped (a sender far ahead of us).
MAX_QUEUED = 8
_NAME = "v"


def kept_residual(feedback: ErrorFeedback | None, name: str) -> torch.Tensor | None:
    """What error feedback keeps for ``name`` (None without error feedback, or before the
    first compression of ``name``)."""
    if feedback is None or name not in feedback.names():
        return None
    return feedback.residual(name)


@dataclass(frozen=True)
class Ticket:
    """An exchange started and not yet collected."""

    step: int
    round: int
    ids: list[str]
    neighbors: list[str]
    payload_bytes: int


@dataclass(frozen=True)
class Average:
    """Σ_k w_k decode(c_k), kept as the compressed messages and their weights.

    Nothing model-sized holds it: ``add_to_`` decodes each message straight into its
    destination (the anchor, a momentum buffer, a gradient), in the order given, which is the
    same at every peer. A neighbour's message is what its receipt kept (``Received``: the
    sections it decompressed and checked); a peer's own may be what its encoder built
    (``Encoded``). Each adds the same bits as its bytes would, without reading them again.
    """

    codec: Codec
    terms: tuple[tuple[bytes | Received | Encoded, float], ...]

    def add_to_(self, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha · Σ_k w_k decode(c_k)`` in place; returns ``out``. A message whose
        indices do not decode (they are checked here, not on arrival) is left out, as a lost
        one would be, and logged."""
        live = [(payload, alpha * w) for payload, w in self.terms if w]
        for _, err in self.codec.add_all_(live, out):
            log.warning("a vector of the average did not decode, left out: %s", err)
        return out


@dataclass
class AverageStats:
    """What one exchange did (for logs and tests)."""

    step: int
    neighbors: list[str]
    averaged: list[str]
    waited_s: float
    payload_bytes: int
    residual_norm: float


class CompressedAverage:
    """Error-feedback-compressed neighbourhood averaging of one vector (module docstring).

    Args:
        like: a tensor of the vector's shape, dtype and device.
        codec: compression spec.
        error_feedback: keep what the codec drops (False: the ablation without).
        neighbourhood: the neighbour layer.
        round_timeout: seconds to wait for a neighbour's vector.
        metrics: a PeerMetrics or None.
        kind: the update kind its messages carry (GRADIENT; BUFFERS for a model's buffers),
            so that two averages of one peer never take each other's vectors.
    """

    def __init__(
        self,
        like: torch.Tensor,
        codec: str,
        error_feedback: bool,
        neighbourhood: Neighbourhood,
        round_timeout: float,
        metrics=None,
        kind: int = pb.GRADIENT,
    ) -> None:
        self.kind = kind
        self.codec = from_spec(codec)
        self.feedback = ErrorFeedback(self.codec) if error_feedback else None
        self.nb = neighbourhood
        self.round_timeout = round_timeout
        self.metrics = metrics
        self.shape, self.dtype, self.device = tuple(like.shape), like.dtype, like.device
        self.numel = like.numel()
        self._mine = b""  # c_i of the last exchange, as sent: the own term of the average
        # What the encoder built for c_i, until its term is taken once (``_own_term``).
        self._mine_built: Encoded | None = None
        self._dense: torch.Tensor | None = None  # the dense average, for collect() only
        self._inbox: dict[str, deque[Received]] = {}
        self._last_seq: dict[str, int] = {}  # per sender, the exchange it sent last
        self._lock = threading.Lock()
        self.step = 0
        self.dropped = 0

    # ------------------------------------------------------------------ state

    @property
    def residual(self) -> torch.Tensor:
        """e: what the codec has dropped so far and will send later (zeros without EF)."""
        e = self._kept_residual()
        return torch.zeros(self.shape, dtype=torch.float32, device=self.device) if e is None else e

    def _kept_residual(self) -> torch.Tensor | None:
        return kept_residual(self.feedback, _NAME)

    def _residual_norm(self) -> float:
        """||e|| as the last compression left it (0 without error feedback)."""
        return 0.0 if self.feedback is None else self.feedback.residual_norm(_NAME)

    @property
    def mine(self) -> torch.Tensor:
        """decode(c_i) of the last exchange, as a new dense tensor (zeros before the first)."""
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        if self._mine:
            self.codec.decode_add_(self._mine, out)
        return out

    def state_dict(self, for_joiner: bool = False, copy: bool = True) -> dict:
        if for_joiner or self.feedback is None:
            return {"step": self.step}
        return {"step": self.step, "feedback": self.feedback.state_dict(copy)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))
        if self.feedback is not None:
            if "feedback" in state:
                self.feedback.load_state_dict(state["feedback"])
            else:
                self.feedback.reset()
        with self._lock:
            self._inbox.clear()
            self._last_seq.clear()

    def queued(self, peer: str) -> int:
        """Vectors from ``peer`` waiting to be averaged."""
        with self._lock:
            return len(self._inbox.get(peer, ()))

    def forget(self, peer: str) -> None:
        """Drop what is queued from a peer that left or restarted."""
        with self._lock:
            self._inbox.pop(peer, None)
            self._last_seq.pop(peer, None)

    def prune(self, present: set[str]) -> None:
        with self._lock:
            for peer in [p for p in self._inbox if p not in present]:
                del self._inbox[peer]
                self._last_seq.pop(peer, None)

    # ------------------------------------------------------------------ sending

    def compress(self, v: torch.Tensor) -> bytes:
        """Step 1: c = Q(e + v), keep what was dropped; c is the own term of the average."""
        return self._compressed(
            lambda seed: (
                self.feedback.compress(_NAME, v, seed=seed)
                if self.feedback is not None
                else self.codec.encode(v, seed=seed),
                None,
            )
        )

    def compress_difference(self, a: torch.Tensor, b: torch.Tensor) -> bytes:
        """``compress(a − b)`` with no model-sized ``a − b`` where error feedback is on (the
        difference goes into the residual a slice at a time)."""
        return self._compressed(
            lambda seed: (
                self.feedback.compress_difference_parts(_NAME, a, b, seed=seed)
                if self.feedback is not None
                else (self.codec.encode(a - b, seed=seed), None)
            )
        )

    def _compressed(self, encode) -> bytes:
        """``encode(seed)`` gives c_i and what the encoder built for it (or None)."""
        t0 = time.perf_counter()
        self._mine, self._mine_built = encode(self.step + 1)
        if self.metrics is not None:
            self.metrics.observe_compress(time.perf_counter() - t0)
        return self._mine

    def _own_term(self) -> bytes | Encoded:
        """c_i for the average: what the encoder built the first time (no indices read
        again; it holds them, so it is let go here), its bytes after."""
        built, self._mine_built = self._mine_built, None
        return self._mine if built is None else built

    def _send(self, peer: str, header: pb.UpdateHeader, payload: bytes) -> None:
        if not self.nb.view.is_alive(peer):
            return  # it went silent while this push waited behind the earlier ones
        try:
            reply = self.nb.push(peer, header, payload)
        except Exception as err:
            log.warning("push of a compressed vector to %s failed: %s", peer, err)
            return
        if reply.status not in (pb.PushReply.ACCEPTED, pb.PushReply.DUPLICATE):
            log.info("%s did not take our vector: %s", peer, reply.detail)

    def send(self, payload: bytes, neighbors: list[str], round_: int) -> None:
        """Step 2: push c to every live neighbour in the background."""
        for peer in neighbors:
            if self.nb.view.is_alive(peer):
                # Only gradients count towards the compression ratio's dense bytes.
                dense = {} if self.kind == pb.GRADIENT else {"dense_size": 0}
                header = self.nb.header(peer, self.kind, payload, seq=round_, round=round_, **dense)
                self.nb.submit_in_order(peer, self._send, peer, header, payload)

    # ------------------------------------------------------------------ receiving

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Validate and queue one neighbour's vector (server thread)."""
        self.nb.check(header, (self.kind,))
        try:
            v = self.codec.receive(bytes(payload), max_numel=max(self.numel, 1))
        except DecodeError as err:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "decode_error", str(err)
            ) from None
        if v.shape != self.shape or v.dtype != self.dtype:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"vector {list(v.shape)} {v.dtype} does not fit {self.numel} values",
            )
        with self._lock:
            if self._last_seq.get(header.sender) == header.seq:
                return pb.PushReply(status=pb.PushReply.DUPLICATE, detail="vector")
            self._last_seq[header.sender] = header.seq
            queue = self._inbox.setdefault(header.sender, deque())
            queue.append(v)
            while len(queue) > MAX_QUEUED:
                queue.popleft()
                self.dropped += 1
        self.nb.heard(header.sender)
        return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="vector")

    # ------------------------------------------------------------------ one exchange

    def start(self, v: torch.Tensor, round_: int) -> Ticket:
        """Steps 1-2 for vector ``v``: compress it and push it to this round's neighbours.
        ``round_`` picks the topology's round. ``collect`` the ticket before the next start."""
        return self._launch(self.compress(v), round_)

    def start_difference(self, a: torch.Tensor, b: torch.Tensor, round_: int) -> Ticket:
        """``start(a − b, round_)`` without a model-sized ``a − b`` (``compress_difference``)."""
        return self._launch(self.compress_difference(a, b), round_)

    def _launch(self, payload: bytes, round_: int) -> Ticket:
        ids = self.nb.ids()
        neighbors = self.nb.neighbors_at(round_, ids)
        self.send(payload, neighbors, round_)
        ticket = Ticket(self.step, round_, ids, neighbors, len(payload))
        self.step += 1
        return ticket

    def own_share(self, ticket: Ticket) -> Average:
        """This peer's part of the average of a started exchange, w_ii · decode(c_i)."""
        weights = self.nb.weights_at(ticket.round, ticket.ids)
        w_self = 1.0 - sum(weights.get(p, 0.0) for p in ticket.neighbors)
        return Average(self.codec, ((self._own_term(), w_self),))

    def collect(
        self, ticket: Ticket, wait: bool = True, own: bool = True
    ) -> tuple[torch.Tensor, AverageStats]:
        """``collect_average`` as a dense tensor (a buffer reused by the next call): for
        ef-gradient's gradients and the buffers' average, which need the vector itself."""
        average, stats = self.collect_average(ticket, wait, own)
        if self._dense is None:
            self._dense = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return average.add_to_(self._dense.zero_()), stats

    def collect_average(
        self, ticket: Ticket, wait: bool = True, own: bool = True
    ) -> tuple[Average, AverageStats]:
        """Step 3: the neighbourhood's average, as the messages and their weights (applied
        where it is needed by ``Average.add_to_``); without ``wait``, over the vectors that
        have arrived (none is waited for or marked lagging).

        The own vector averaged in is the last one ``start`` compressed, which need not be
        the ticket's (diloco's eager overlap mixes this phase's own vector with the
        neighbours' of the phase before). ``own=False``: the neighbours' part alone, with
        their weights as they are (the own share was applied before), not renormalised.
        """
        neighbors = ticket.neighbors

        def missing() -> list[str]:
            return [p for p in neighbors if not self._inbox.get(p)]

        waited = 0.0
        if wait:
            waited = self.nb.wait(missing, self.round_timeout, f"exchange {ticket.step}")
        weights = self.nb.weights_at(ticket.round, ticket.ids)
        w_self = 1.0 - sum(weights.get(p, 0.0) for p in neighbors)
        with self._lock:
            terms = {
                p: (q.popleft(), weights.get(p, 0.0))
                for p in neighbors
                if (q := self._inbox.get(p))
            }
        averaged = list(terms)
        if own:
            terms[self.nb.me] = (self._own_term(), w_self)
        # One summation order (by peer id) at every peer: where the weights agree (a complete
        # graph), every peer computes the bit-identical average, and exact peers stay equal.
        total = sum(w for _, w in terms.values()) if own else 1.0
        scale = 1.0 / total if total > 0 else 0.0
        avg = Average(self.codec, tuple((terms[p][0], terms[p][1] * scale) for p in sorted(terms)))
        stats = AverageStats(
            step=ticket.step,
            neighbors=neighbors,
            averaged=averaged,
            waited_s=waited,
            payload_bytes=ticket.payload_bytes,
            residual_norm=self._residual_norm(),
        )
        if self.metrics is not None:
            self.metrics.set_error_feedback_norm(stats.residual_norm)
        return avg, stats

    def average(self, v: torch.Tensor, round_: int) -> tuple[torch.Tensor, AverageStats]:
        """Steps 1-3 at once (no overlap)."""
        return self.collect(self.start(v, round_))
