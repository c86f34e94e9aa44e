"""Algorithm ``diloco``: local phases, compressed pseudo-gradients gossiped, an outer optimizer.

DiLoCo (Douillard et al. 2023) without an all-reduce. Each peer i keeps an *anchor* a_i and
runs phases of H = ``gossip.local_steps`` steps of the user's own optimizer (its state never
leaves the peer). At the end of phase r:

1. Δ_i = s_i − θ_i, the phase's pseudo-gradient (s_i: θ_i at the phase's start, = a_i).
2. Δ̄_i = the neighbourhood's Metropolis–Hastings average of error-feedback-compressed Δ's
   (peer/algorithms/averaging.py; SparseLoCo's error feedback on the pseudo-gradient).
3. Outer step on the anchor (peer/algorithms/outer.py): a_i −= η Δ̄_i, or with momentum μ > 0
   SGD with (Nesterov) momentum: m_i = μ m_i + Δ̄_i;  a_i −= η (Δ̄_i + μ m_i).
4. The anchors are kept together by a CHOCO round over them (compressed, public copies per
   edge, the sessions and agreed weights of peer/algorithms/edges.py): neighbourhood averages
   differ from peer to peer, and the anchors would otherwise drift apart.
5. θ_i = a_i: the next phase starts from the anchor.

With ``gossip.overlap`` (or ``"auto"``: on where the measured round trip would stall a phase
end, peer/algorithms/phase_overlap.py) the exchange of phase r runs while phase
r + 1 computes (eager updates, Kale et al. 2025, "Eager Updates for Overlapped Communication
and Computation in DiLoCo"): at the end of phase r the peer sends Δ_r and takes its outer step on
w_ii Q(Δ_r) + Σ_j w_ij Q(Δ_{r−1}^j), its own vector of this phase and the neighbours' of the
phase before (arrived during phase r), so every vector is applied once, with its weight; the
next phase starts from the anchor. A WAN round trip then hides behind a phase of compute.
(Continuing from a − Δ_r, the own progress at full weight until its average arrives, ended
at 2.46, these eager updates at 1.96, against 1.76 without overlap on the char transformer,
4 peers, H = 10.)

With ``gossip.background_rounds`` the end of phase r runs beside the first steps of phase
r + 1: a thread of its own first keeps θ_r (the parameters at the phase's end: a copy taken
while the training thread computes the next step's forward and backward, which only read
them; the next optimizer step waits for it, ``before_step``), then compresses
Δ_r = a − θ_r, averages, takes the outer step and the anchors' CHOCO round, and moves the
parameters by what the phase's start moved, θ ← θ + (a' − θ_r) = a' + p, the progress p
made meanwhile kept on top of the new anchor a'. Every step's progress lands in exactly one
pseudo-gradient (the next one measures from θ_r), and the round costs the training thread
nothing while the copy is done before its next optimizer step; the copy is one model more
(peer/algorithms/footprint.py).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from gossipgrad.compression import native
from gossipgrad.peer.algorithms.averaging import AverageStats, CompressedAverage, Ticket
from gossipgrad.peer.algorithms.base import GossipAlgorithm, RoundStats
from gossipgrad.peer.algorithms.choco import ChocoGossip
from gossipgrad.peer.algorithms.outer import OuterSettings, outer_step, restore_outer
from gossipgrad.peer.algorithms.phase_overlap import PhaseOverlap
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.proto import gossip_pb2 as pb


class DiLoCo(GossipAlgorithm):
    """Gossip DiLoCo for one peer (module docstring).

    Args:
        flat: the model's parameters θ (updated in place).
        anchor: a_i, the vector the anchors' CHOCO gossips (same shape as θ).
        average: compressed neighbourhood averaging of the pseudo-gradient.
        anchors: CHOCO gossip over ``anchor``.
        outer: H, outer lr and momentum, overlap.
        state_lock: held while θ and the anchor are read or written.
    """

    name = "diloco"
    kinds = (pb.GRADIENT, *ChocoGossip.kinds)

    def __init__(
        self,
        flat: FlatParameters,
        anchor: torch.Tensor,
        average: CompressedAverage,
        anchors: ChocoGossip,
        outer: OuterSettings,
        state_lock: threading.RLock,
    ) -> None:
        self.flat = flat
        self.anchor = anchor  # also s_i, θ at the phase's start: a phase starts on the anchor
        self.average = average
        self.anchors = anchors
        self.outer = outer
        self.state_lock = state_lock
        # Only an outer step with momentum has a buffer to keep.
        self.momentum = torch.zeros_like(anchor) if outer.momentum > 0 else None
        self._phase = 0
        self._ended_step = 0  # the latest step whose phase end is applied (under state_lock)
        self._pending: Ticket | None = None
        # θ at the end of the phase whose round runs in the background (background only),
        # and whether it is taken (the training thread's next optimizer step waits for it).
        self._phase_end: torch.Tensor | None = None
        self._phase_end_kept = threading.Event()
        self._phase_end_kept.set()
        self.last_exchange: AverageStats | None = None
        # gossip.overlap as set, or "auto": chosen from the round trip (phase_overlap.py).
        self.overlap = PhaseOverlap(outer.overlap)
        self._phase_done: float | None = None  # when the last phase end finished

    @property
    def round(self) -> int:
        return self._phase

    @property
    def residual(self) -> torch.Tensor:
        return self.average.residual

    # ------------------------------------------------------------------ the outer round

    def _outer_round(
        self,
        overlap: bool,
        phase_end: torch.Tensor | None = None,
        local_step: int | None = None,
    ) -> RoundStats:
        """The end of a phase: steps 1-5, or with ``overlap`` the eager variant (module
        docstring): this phase's own pseudo-gradient and the neighbours' of the phase
        before, whose exchange ran while this phase computed. With ``phase_end`` (θ_r, kept by
        ``hand_over`` for a round in the background) Δ is taken from it, without the lock, as
        training goes on, and the parameters move by a' − θ_r instead of restarting from a'.
        ``local_step``: the step the phase ends at (None: the run's last, partial phase),
        recorded with the new parameters under the lock (``phase_end_pending``)."""
        theta = self.flat.data if phase_end is None else phase_end
        reads_params = self.state_lock if phase_end is None else contextlib.nullcontext()
        with torch.no_grad(), reads_params:
            # Δ = a − θ goes straight into the error-feedback residual (no dense copy).
            ticket = self.average.start_difference(self.anchor, theta, self._phase)
        if not overlap:
            step, self.last_exchange = self.average.collect_average(ticket)
        else:
            previous, self._pending = self._pending, ticket
            if previous is None:  # the first phase: no neighbour's vector yet
                step = self.average.own_share(ticket)
            else:
                step, self.last_exchange = self.average.collect_average(previous)
        with torch.no_grad(), self.state_lock:
            outer_step(self.anchor, step, self.momentum, self.outer)
        # In the foreground θ = a' comes with the anchors' round; in the background, below.
        stats = self._anchors_round() if phase_end is None else self.anchors.step_round()
        with torch.no_grad(), self.state_lock:
            if phase_end is not None and native.usable(self.flat.data, self.anchor, phase_end):
                native.add_difference(self.flat.data, self.anchor, phase_end)  # one pass
            elif phase_end is not None:  # a' − θ_r in θ_r's buffer, then onto the parameters
                torch.sub(self.anchor, phase_end, out=phase_end)
                self.flat.data.add_(phase_end)
            self._phase += 1
            if local_step is not None:
                self._ended_step = local_step
        return stats

    def _anchors_round(self, trained: bool = True) -> RoundStats:
        """The anchors' CHOCO round, then θ = a: written by the round's consensus passes,
        in the same pass as the anchor (one copy of the model less a round), or copied where
        no pass ran."""
        with torch.no_grad(), self.state_lock:
            self.anchors.write_x_also(self.flat.data)
        try:
            stats = self.anchors.step_round(trained=trained)
        finally:
            with torch.no_grad(), self.state_lock:
                written = self.anchors.write_x_also(None)
        if not written:
            with torch.no_grad(), self.state_lock:
                self.flat.data.copy_(self.anchor)
        return stats

    # ------------------------------------------------------------------ interface

    def round_due(self, local_step: int) -> bool:
        return local_step % self.outer.local_steps == 0

    def phase_end_pending(self, local_step: int) -> bool:
        return self.round_due(local_step) and self._ended_step != local_step

    def hand_over(self, local_step: int) -> None:
        if self.outer.background and self.round_due(local_step):
            self._phase_end_kept.clear()  # the round's thread keeps θ_r first

    def before_step(self) -> None:
        self._phase_end_kept.wait()  # θ_r is kept before the parameters change

    def _keep_phase_end(self) -> torch.Tensor:
        """θ_r into its buffer (the round's thread, while training computes the next step's
        gradients: the parameters are only read until its optimizer step)."""
        try:
            with torch.no_grad(), self.state_lock:
                if self._phase_end is None:
                    self._phase_end = torch.empty_like(self.flat.data)
                self._phase_end.copy_(self.flat.data)
            return self._phase_end
        finally:
            self._phase_end_kept.set()

    def after_step(self, local_step: int) -> RoundStats | None:
        if not self.round_due(local_step):
            return None
        if not self.outer.background:
            started = time.perf_counter()
            if self._phase_done is not None:
                self.overlap.observe_compute(started - self._phase_done)
            overlap = self.overlap.update(self.average.nb.round_trip())
            stats = self._outer_round(overlap, local_step=local_step)
            stats.overlap = overlap
            self._phase_done = time.perf_counter()
            return stats
        if self._phase_end_kept.is_set():
            raise RuntimeError("hand_over() comes before a round goes to the background")
        phase_end = self._keep_phase_end()
        return self._outer_round(overlap=False, phase_end=phase_end, local_step=local_step)

    def consensus_round(self) -> RoundStats:
        """Gossip-only: a CHOCO round over the anchors, the parameters follow them."""
        self._settle()
        return self._anchors_round(trained=False)

    def finish(self, interrupted: bool = False) -> None:
        """Settle the phases (``_settle``), then the anchors' last exchanges, mixed at both
        ends, and the anchors' FINAL notices; the parameters end on the anchor. Interrupted,
        only the anchors' exchanges under way are settled (the parameters stay as trained)."""
        if not interrupted:
            self._settle()
        self.anchors.finish(interrupted)
        if not interrupted:
            with torch.no_grad(), self.state_lock:
                self.flat.data.copy_(self.anchor)

    def _settle(self) -> None:
        """Apply the neighbours' part still in flight (overlap), then any partial last phase,
        so the parameters end on the anchor with every peer's progress averaged in."""
        if self._pending is not None:
            ticket, self._pending = self._pending, None
            rest, self.last_exchange = self.average.collect_average(ticket, own=False)
            with torch.no_grad(), self.state_lock:
                progress = self.flat.data - self.anchor  # since the phase began (transient)
                # The own share went into the last outer step: the rest is added as it is,
                # without a momentum step of its own.
                rest.add_to_(self.anchor, alpha=-self.outer.lr)
            self.anchors.step_round()
            with torch.no_grad(), self.state_lock:
                self.flat.data.copy_(self.anchor).add_(progress)
            del progress
        with torch.no_grad(), self.state_lock:
            partial = not torch.equal(self.anchor, self.flat.data)
        if partial:
            self._outer_round(overlap=False)

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        if header.kind == pb.GRADIENT:
            return self.average.handle_update(header, payload)
        return self.anchors.handle_update(header, payload)

    def state_dict(self, for_joiner: bool = False, copy: bool = True) -> dict:
        taken = torch.Tensor.clone if copy else torch.Tensor.detach
        with self.state_lock:
            state = {
                "anchor": taken(self.anchor),
                "phase": self._phase,
                "ended_step": self._ended_step,
                "average": self.average.state_dict(for_joiner, copy),
                "anchors": self.anchors.state_dict(for_joiner, copy),
            }
            if self.momentum is not None:
                state["momentum"] = taken(self.momentum)
            return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad(), self.state_lock:
            self._phase = restore_outer(self.anchor, self.momentum, state)
            self._ended_step = int(state.get("ended_step", 0))
        self._pending = None
        self.average.load_state_dict(state.get("average", {}))
        self.anchors.load_state_dict(state.get("anchors", {}))

    def forget(self, peer: str) -> None:
        self.average.forget(peer)
        self.anchors.forget(peer)

    def prune(self, present: set[str]) -> None:
        self.average.prune(present)
        self.anchors.prune(present)

    def close(self) -> None:
        self.anchors.close()
