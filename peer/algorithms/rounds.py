"""The bookkeeping of one CHOCO round: which edges it serves, what it opened and mixed, and
when it is done (the ``max_staleness`` rule)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gossipgrad.peer.algorithms.edges import Edge


@dataclass
class OpenRound:
    """One round in progress.

    The round names the peers it serves and reads their edges from the live table each time
    it asks: a view change in the middle of the round may drop an edge (its peer was not in
    the view yet: a joiner whose opening came before its first heartbeat) and the peer's
    next update make it anew, and only the new edge moves on. Held as objects from the
    round's start, the dropped edge would never look done and the round would wait out its
    whole timeout, and its neighbours with it.

    Args:
        peers: the peers the round serves (this round's neighbours and those owed an answer).
        edges: the edge table (peer -> edge), read live.
        weights: this round's proposed mixing weight per neighbour.
        max_staleness: 0: done once this round's exchange with the edge is mixed; k >= 1:
            once no exchange opened k or more rounds ago is still unmixed, and the edge has
            one in flight (opened this round if the previous one is mixed). An edge carries
            one exchange at a time, so one whose round trip is longer than a round mixes
            every few rounds instead of pacing the peer, up to k rounds behind.
        round: this round's label.
    """

    peers: list[str]
    edges: Mapping[str, Edge]
    weights: dict[str, float]
    max_staleness: int
    round: int = 0
    turn: dict[str, int] = field(default_factory=dict)  # per peer: the session opened in
    pushed: set[str] = field(default_factory=set)
    mixes: dict[str, int] = field(default_factory=dict)
    distance: float = float("nan")  # the consensus distance of the latest mix

    def record_mixed(self, peers: list[str], distance: float) -> None:
        for p in peers:
            self.mixes[p] = self.mixes.get(p, 0) + 1
        if peers:
            self.distance = distance

    def mixed(self) -> list[str]:
        return [p for p, n in self.mixes.items() if n]

    def done(self, peer: str) -> bool:
        e = self.edges.get(peer)
        if e is not None and e.ended:
            return True  # the neighbour finished: nothing more to exchange on this edge
        if e is None or e.epoch == 0:
            return False
        if self.max_staleness == 0:
            return self.mixes.get(peer, 0) > 0
        if e.sent > e.mixed:  # an exchange in flight: fine while younger than max_staleness
            return e.opened_round > self.round - self.max_staleness
        return self.turn.get(peer) == e.epoch

    def unfinished(self) -> list[str]:
        """The edges the round still waits for."""
        return [p for p in self.peers if not self.done(p)]
