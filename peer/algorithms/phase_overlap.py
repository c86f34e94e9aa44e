"""``gossip.overlap = "auto"`` (diloco): overlap chosen from what the peer measures.

Without overlap a phase end waits for this phase's pseudo-gradients from the neighbours: at
least a one-way trip after the latest neighbour's phase end, every phase. Over a WAN that is
a large share of a phase (8 digits sites, 100 ms RTT, 150 ms phases: 0.71-0.89 of the ideal
speed, BENCHMARKS.md), and no staleness bound hides it, since the outer step needs the
average. With overlap the exchange of phase r runs while phase r + 1 computes (eager updates,
peer/algorithms/diloco.py), so the round trip hides behind a phase of compute. Overlap
applies the neighbours' part a phase late, which costs quality where nothing is to be won (the
char transformer, 4 peers, H = 10, local links: 1.96 against 1.76), so it is chosen only where
the round trip would stall the phase end, by staleness's measure of "negligible":

    overlap  iff  round trip >= LAN_ROUND_TRIP  and  round trip > NEGLIGIBLE * phase compute

The round trip is the neighbourhood's estimate (the least of the latest answered pushes); the
phase compute is the median of the latest phases' (from one phase end's finish to the next
one's start, so waits are not counted). The choice is made once ``MIN_PHASES`` phases are
measured and, once on, stays on for the run: turning it off would need the exchange in flight
settled first, and a link found slow is not expected to turn fast.

Opt-in, not the default: 4 digits sites at 100 ms RTT stepped 16 % faster with it and ended
0.8 points lower (BENCHMARKS.md, "Compute utilization at 100 ms RTT").
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from gossipgrad.peer.algorithms.staleness import LAN_ROUND_TRIP, NEGLIGIBLE

log = logging.getLogger(__name__)

#: Phases measured before the choice (the first ones carry start-up's slow pushes and steps).
MIN_PHASES = 3
#: Phases whose compute the median is taken over.
WINDOW = 8


def overlap_for(round_trip: float, phase_compute: float) -> bool:
    """Whether a phase end that waits a ``round_trip`` (seconds) after ``phase_compute``
    seconds of compute should overlap its exchange with the next phase: the module's rule."""
    return round_trip >= LAN_ROUND_TRIP and round_trip > NEGLIGIBLE * phase_compute


class PhaseOverlap:
    """Whether diloco's phase ends overlap: the user's choice, or chosen as measured.

    Args:
        setting: ``gossip.overlap``: a bool is used as it is; ``"auto"`` starts off and turns
            on when ``overlap_for`` says so.
    """

    def __init__(self, setting: bool | str) -> None:
        self.auto = setting == "auto"
        self.value = False if self.auto else bool(setting)
        self._compute: deque[float] = deque(maxlen=WINDOW)

    def observe_compute(self, seconds: float) -> None:
        """Seconds the training thread computed in one phase (between two phase ends)."""
        self._compute.append(seconds)

    def update(self, round_trip: float | None) -> bool:
        """Whether the phase end starting now overlaps, given the round-trip estimate (None:
        none measured yet); logged when chosen."""
        if not self.auto or self.value or round_trip is None:
            return self.value
        if len(self._compute) < MIN_PHASES:
            return self.value
        compute = statistics.median(self._compute)
        if overlap_for(round_trip, compute):
            self.value = True
            log.info(
                "gossip overlap on (auto: round trip %.1f ms against %.1f ms of compute per "
                "phase)", round_trip * 1e3, compute * 1e3,
            )  # fmt: skip
        return self.value
