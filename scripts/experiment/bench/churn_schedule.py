"""When churn happens and what it may do: the schedule a
:class:`~gossipgrad.experiment.bench.churn.ChurnDriver` follows (see that module for the events)."""

from __future__ import annotations

import random
from dataclasses import dataclass

EVENT_KINDS = ("sigkill", "restart", "sigterm", "join")
ORDERS = ("cycle", "random")


@dataclass(frozen=True)
class ChurnSchedule:
    """When churn happens and what it may do.

    Args:
        every_rounds: swarm rounds (median over the working peers) between two events.
        min_live: never stop a peer when this few are alive.
        max_live: never start one when this many are alive.
        order: ``cycle`` (sigkill, restart, sigterm, join, ...; an event that does not fit the
            bounds gives way to the next that does) or ``random`` (seeded draw among those
            that fit).
        seed: seeds the draw of events (``random``) and of victims and bootstrap peers.
        first_round: no event before this swarm round (let the swarm start).
        last_round: no event from this round on (let it finish; None: no limit).
    """

    every_rounds: int
    min_live: int
    max_live: int
    order: str = "cycle"
    seed: int = 0
    first_round: int = 0
    last_round: int | None = None

    def __post_init__(self) -> None:
        if self.every_rounds < 1:
            raise ValueError(f"every_rounds must be at least 1, got {self.every_rounds}")
        if not 1 <= self.min_live <= self.max_live:
            raise ValueError(
                f"need 1 <= min_live <= max_live, got {self.min_live} and {self.max_live}"
            )
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")

    def due(self, swarm_round: int, last_event_round: int | None) -> bool:
        """Is an event due at this swarm round?"""
        if swarm_round < self.first_round:
            return False
        if self.last_round is not None and swarm_round >= self.last_round:
            return False
        if last_event_round is None:
            return swarm_round >= max(self.first_round, self.every_rounds)
        return swarm_round >= last_event_round + self.every_rounds

    def feasible(self, live: int, stopped: int, working: int | None = None) -> list[str]:
        """The event kinds that keep the live count within bounds: ``live`` processes
        running, ``stopped`` peers that could restart, ``working`` of the live ones past
        start-up (a peer is stopped only while more than ``min_live`` train; default: all
        live ones)."""
        working = live if working is None else working
        fits = {
            "sigkill": working > self.min_live,
            "sigterm": working > self.min_live,
            "restart": stopped > 0 and live < self.max_live,
            "join": live < self.max_live,
        }
        return [kind for kind in EVENT_KINDS if fits[kind]]

    def pick(
        self,
        index: int,
        live: int,
        stopped: int,
        rng: random.Random,
        working: int | None = None,
    ) -> str | None:
        """The kind of event number ``index`` (0-based), or None if none fits."""
        kinds = self.feasible(live, stopped, working)
        if not kinds:
            return None
        if self.order == "random":
            return rng.choice(kinds)
        for k in range(len(EVENT_KINDS)):
            kind = EVENT_KINDS[(index + k) % len(EVENT_KINDS)]
            if kind in kinds:
                return kind
        return None  # pragma: no cover - kinds is a subset of EVENT_KINDS
