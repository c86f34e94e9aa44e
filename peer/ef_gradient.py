"""Algorithm ``ef-gradient``: compressed gradient exchange with error feedback.

As in Deep Gradient Compression (Lin et al., ICLR 2018) and EF-SGD (Karimireddy et al., ICML
2019), each local step of peer i, before the optimizer step:

1. (optional, DGC momentum correction) u_i = m·u_i + g_i, and u_i takes the place of g_i.
2. e_i += g_i;  c_i = Q(e_i);  e_i -= decode(c_i)     (the residual keeps what Q dropped)
   With ``gossip.error_feedback = false`` (an ablation): c_i = Q(g_i), and e_i stays zero.
3. c_i goes to every neighbour of this step's topology (one encoding for all of them).
4. Wait, at most ``round_timeout``, for one c_j from each live neighbour, then set the
   gradient to the Metropolis–Hastings average of decode(c_i) and the c_j that arrived
   (the weights of missing neighbours are left out and the rest renormalised).

A neighbour that misses the deadline is not waited for again until it is heard from (a slow
peer paces its neighbours, a silent one is left behind). Incoming gradients wait in a short
FIFO per sender, so peers whose step counters differ (a restart, a late joiner) still pair
up their messages. Averaged gradients alone let the models drift apart, so the owner also
runs a CHOCO model-gossip round every ``gossip.consensus_every`` steps.

Gradients are not increments of any shared copy: a lost message costs that step some
information but breaks no invariant, so there are no sequence numbers or resyncs here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from gossipgrad.compression import DecodeError, from_spec
from gossipgrad.peer.config import GossipSection
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.transport import UpdateRejected
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Gradients kept per sender before the oldest are dropped (a sender far ahead of us).
MAX_QUEUED = 8


@dataclass
class ExchangeStats:
    """What one gradient exchange did (for logs and tests)."""

    step: int
    neighbors: list[str]
    averaged: list[str]
    waited_s: float
    payload_bytes: int
    residual_norm: float


class EFGradientExchange:
    """Error-feedback gradient exchange for one peer (see the module docstring).

    Args:
        flat: the model's parameters; gradients are read from and written to their ``.grad``.
        cfg: the gossip section (codec, round_timeout, ef_momentum).
        me: this peer's id; swarm: the swarm name.
        neighbors_at: callable(step, ids) -> neighbour ids at a step (the CHOCO topology).
        weights_at: callable(step, ids) -> Metropolis–Hastings weights w_ij, self excluded.
        present_ids: callable returning the sorted ids of peers present (self included).
        is_alive: callable(peer_id) -> bool.
        push: callable(peer_id, header, payload) -> (PushReply, wire bytes), blocking.
        metrics: a PeerMetrics or None.
    """

    def __init__(
        self,
        flat: FlatParameters,
        cfg: GossipSection,
        me: str,
        swarm: str,
        neighbors_at: Callable[[int, list[str]], list[str]],
        weights_at: Callable[[int, list[str]], dict[str, float]],
        present_ids: Callable[[], list[str]],
        is_alive: Callable[[str], bool],
        push: Callable[[str, pb.UpdateHeader, bytes], tuple[pb.PushReply, int]],
        metrics=None,
    ) -> None:
        # hyperparameters
        self.flat = flat
        self.cfg = cfg
        self.me = me
        self.swarm = swarm
        self.codec = from_spec(cfg.codec)
        self.momentum = cfg.ef_momentum
        self.error_feedback = cfg.error_feedback
        # collaborators
        self._neighbors_at = neighbors_at
        self._weights_at = weights_at
        self._present_ids = present_ids
        self._is_alive = is_alive
        self._push = push
        self.metrics = metrics
        # state: the error-feedback residual (Q is biased, what it drops must be sent later;
        # it stays zero with gossip.error_feedback = false) and the DGC momentum buffer; both
        # live on the parameters' device.
        self.residual = torch.zeros_like(flat.data)
        self.velocity = torch.zeros_like(flat.data) if self.momentum > 0 else None
        self._mine = torch.zeros_like(flat.data)
        self.step = 0
        # incoming gradients per sender, and liveness bookkeeping for the deadline
        self._inbox: dict[str, deque[torch.Tensor]] = {}
        self._heard: dict[str, int] = {}
        self._lagging: dict[str, int] = {}
        self._arrived = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="grad-push")
        # statistics
        self.dropped = 0

    # ------------------------------------------------------------------ sending

    def _send(self, peer: str, header: pb.UpdateHeader, payload: bytes) -> None:
        t0 = time.perf_counter()
        try:
            reply, wire_bytes = self._push(peer, header, payload)
        except Exception as err:
            log.warning("gradient push to %s failed: %s", peer, err)
            return
        if self.metrics is not None:
            self.metrics.observe_push(peer, time.perf_counter() - t0)
            self.metrics.record_sent(peer, "update", wire_bytes, dense_bytes=header.dense_size)
        if reply.status != pb.PushReply.ACCEPTED:
            log.info("%s did not take our gradient: %s", peer, reply.detail)

    def _compress(self) -> bytes:
        """Steps 1-2: fold the gradient into the residual, encode it, keep what was dropped."""
        g = self.flat.grad()
        if self.velocity is not None:
            # DGC momentum correction: accumulate velocity, not the raw gradient.
            g = self.velocity.mul_(self.momentum).add_(g)
        t0 = time.perf_counter()
        if self.error_feedback:
            self.residual.add_(g)
            payload = self.codec.encode(self.residual, seed=self.step + 1)
            self.codec.decode(payload, out=self._mine)
            self.residual.sub_(self._mine)
        else:
            # Ablation: c = Q(g), what Q drops is lost (the residual stays zero).
            payload = self.codec.encode(g, seed=self.step + 1)
            self.codec.decode(payload, out=self._mine)
        if self.velocity is not None:
            # DGC momentum factor masking: coordinates that were sent restart their velocity.
            self.velocity.masked_fill_(self._mine != 0, 0.0)
        if self.metrics is not None:
            self.metrics.observe_compress(time.perf_counter() - t0)
        return payload

    # ------------------------------------------------------------------ receiving

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Validate and queue one neighbour's compressed gradient (server thread)."""
        if header.model_fingerprint != self.flat.fingerprint:
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "fingerprint",
                f"model fingerprint {header.model_fingerprint!r} != ours {self.flat.fingerprint!r}",
            )
        if header.receiver != self.me or header.kind != pb.GRADIENT:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"gradient for {header.receiver!r} of kind {header.kind}, this is {self.me!r}",
            )
        try:
            grad = self.codec.decode(
                bytes(payload), device=self.flat.device, max_numel=self.flat.numel
            )
        except DecodeError as err:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT, "decode_error", str(err)
            ) from None
        if grad.shape != self.flat.data.shape or grad.dtype != self.flat.dtype:
            raise UpdateRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "malformed",
                f"gradient {list(grad.shape)} {grad.dtype} does not fit {self.flat.numel} params",
            )
        with self._arrived:
            queue = self._inbox.setdefault(header.sender, deque())
            queue.append(grad)
            while len(queue) > MAX_QUEUED:
                queue.popleft()
                self.dropped += 1
            self._heard[header.sender] = self._heard.get(header.sender, 0) + 1
            self._arrived.notify_all()
        return pb.PushReply(status=pb.PushReply.ACCEPTED, detail="gradient")

    def forget(self, peer: str) -> None:
        """Drop what is queued from a peer that left or restarted."""
        with self._arrived:
            self._inbox.pop(peer, None)

    # ------------------------------------------------------------------ one step

    def _wait(self, neighbors: list[str]) -> float:
        t0 = time.monotonic()
        deadline = t0 + self.cfg.round_timeout

        def missing() -> list[str]:
            return [
                p
                for p in neighbors
                if p not in self._lagging and self._is_alive(p) and not self._inbox.get(p)
            ]

        with self._arrived:
            waiting = missing()
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("step %d: no gradient from %s in time", self.step, waiting)
                    for p in waiting:
                        self._lagging[p] = self._heard.get(p, 0)
                    break
                self._arrived.wait(timeout=min(left, 0.1))
                waiting = missing()
            for p, heard in list(self._lagging.items()):
                if self._heard.get(p, 0) > heard:
                    del self._lagging[p]
        return time.monotonic() - t0

    def exchange(self) -> ExchangeStats:
        """Replace the parameters' gradients by the neighbourhood's compressed average.

        Call after ``backward()`` and before the optimizer step (training thread).
        """
        payload = self._compress()
        ids = self._present_ids()
        neighbors = self._neighbors_at(self.step, ids)
        for peer in neighbors:
            if not self._is_alive(peer):
                continue
            header = pb.UpdateHeader(
                swarm=self.swarm,
                sender=self.me,
                receiver=peer,
                seq=self.step,
                round=self.step,
                kind=pb.GRADIENT,
                payload_size=len(payload),
                model_fingerprint=self.flat.fingerprint,
                dense_size=self.flat.nbytes,
            )
            self._pool.submit(self._send, peer, header, payload)
        waited = self._wait(neighbors)
        weights = self._weights_at(self.step, ids)
        w_self = 1.0 - sum(weights.get(p, 0.0) for p in neighbors)
        avg = self._mine.mul_(w_self)
        total, averaged = w_self, []
        with self._arrived:
            for peer in neighbors:
                queue = self._inbox.get(peer)
                if queue:
                    w = weights.get(peer, 0.0)
                    avg.add_(queue.popleft(), alpha=w)
                    total += w
                    averaged.append(peer)
        if total > 0:
            avg.div_(total)
        self.flat.set_grad(avg)
        stats = ExchangeStats(
            step=self.step,
            neighbors=neighbors,
            averaged=averaged,
            waited_s=waited,
            payload_bytes=len(payload),
            residual_norm=float(torch.linalg.vector_norm(self.residual)),
        )
        if self.metrics is not None:
            self.metrics.set_error_feedback_norm(stats.residual_norm)
        self.step += 1
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
