"""``gossip.max_staleness = "auto"``: the bound chosen from what the peer measures.

An edge carries one exchange at a time and an exchange takes at least a round trip, so with
staleness k a round waits for the exchange opened k rounds before: k rounds of compute must
cover a round trip, or the link paces the peer (BENCHMARKS.md, 100 ms RTT: 0.65 compute
utilization with k = 1, 1.03 with 2). The rule is the smallest such k:

    k = 1                                    round trip < LAN_ROUND_TRIP, or
                                             round trip <= compute per round / 4
    k = ceil(round trip / compute)           otherwise, at most MAX_AUTO

k = 1 mixes every round: the most consensus per step. It stays where the link costs little
against a round, and on a LAN or this host, where a push's time is mostly the hosts' CPU
(two digits peers on one loaded 2-core host: 7-22 ms pushes against 1-9 ms steps, where a
larger k would trade a 5x larger consensus distance for it). No round of margin on top: a
larger k mixes an edge less often per step, and diloco's anchors, which mix once a phase,
lost most (8 digits sites at 100 ms RTT, 150 ms phases: k = 2 ran 0.0140 s per step at 0.8556
accuracy, k = 1 0.0174 s at 0.9240, on ideal links 0.0154 s at 0.9236).

The round trip is the fewest seconds among the neighbourhood's latest answered pushes (the
link's delay, with the least CPU delay in it); the compute is the median of the latest
``WINDOW`` rounds' (the time between one round's end and the next one's start; gossip-only
rounds are not counted). A choice holds for ``HOLD`` rounds, so one slow push or step does
not make it flap. A larger k never changes what is mixed, only how long a round waits
(peer/algorithms/rounds.py), so the bound may change at any round and differ between the two
ends of an edge.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

log = logging.getLogger(__name__)

#: The largest bound the rule picks (a user may set up to 64). Where a round trip is many
#: rounds of compute, a larger k buys speed with consensus: 8 digits sites at 100 ms RTT and
#: 3-7 ms per round took 0.0167 s per step with k = 8 (relative consensus distance 1.97e-2,
#: accuracy 0.9420) and 0.0510 with k = 4 (9.5e-3, 0.9483), on ideal links 0.0578 with k = 1.
MAX_AUTO = 4
#: Rounds whose compute the median is taken over.
WINDOW = 16
#: Rounds measured before the first choice (start-up's first pushes and rounds are slow).
MIN_ROUNDS = 8
#: Rounds a choice holds before the rule is applied again.
HOLD = 16
#: A round trip up to this share of a round's compute keeps k = 1.
NEGLIGIBLE = 0.25
#: A round trip shorter than this (seconds) keeps k = 1: a LAN, or peers on one host.
LAN_ROUND_TRIP = 0.010


def staleness_for(round_trip: float, compute: float) -> int:
    """The bound for a ``round_trip`` and a round's ``compute`` (seconds): the module's
    rule."""
    if round_trip < LAN_ROUND_TRIP or round_trip <= NEGLIGIBLE * compute:
        return 1
    if compute <= 0:
        return MAX_AUTO
    return max(1, min(MAX_AUTO, math.ceil(round_trip / compute)))


class Staleness:
    """The staleness bound of one CHOCO instance: the user's, or chosen as measured.

    Args:
        setting: ``gossip.max_staleness``: an int is used as it is; ``"auto"`` starts at 1
            and follows ``staleness_for`` once a round trip and a round's compute are known.
    """

    def __init__(self, setting: int | str) -> None:
        self.auto = setting == "auto"
        self.value = 1 if self.auto else int(setting)
        self._compute: deque[float] = deque(maxlen=WINDOW)
        self._held = 0  # rounds since the last choice (None made yet: no hold)
        self._chosen = False  # a first choice is logged even when it keeps 1

    def observe_compute(self, seconds: float) -> None:
        """Seconds the training thread computed between two rounds."""
        self._compute.append(seconds)

    def update(self, round_trip: float | None) -> int:
        """The bound for the round starting now, given the round-trip estimate (None: none
        measured yet); logged when first chosen and when it changes."""
        if not self.auto or round_trip is None or len(self._compute) < MIN_ROUNDS:
            return self.value
        self._held += 1
        if self._chosen and self._held < HOLD:
            return self.value
        compute = statistics.median(self._compute)
        chosen = staleness_for(round_trip, compute)
        if chosen != self.value or not self._chosen:
            log.info(
                "gossip max_staleness %d (auto: round trip %.1f ms, %.1f ms of compute per "
                "round)", chosen, round_trip * 1e3, compute * 1e3,
            )  # fmt: skip
        self.value, self._chosen, self._held = chosen, True, 0
        return self.value
