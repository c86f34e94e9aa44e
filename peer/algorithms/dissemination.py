"""Dissemination of one message per peer and phase to every peer: the routes and the store.

``exact-diloco`` (peer/algorithms/exact_diloco.py) needs every live peer to hold every live
peer's message of a phase. The rules, stated once (no I/O here):

1. **Routes.** The message of ``origin`` travels down the breadth-first spanning tree of the
   gossip graph rooted at ``origin`` (the union of the topology's rounds, over the sorted ids
   of the peers taking part; neighbours visited in id order). Every peer computes the same tree
   from the same ids, so a peer forwards a message only to its children in that message's
   tree: each peer receives it once and the swarm sends it n − 1 times, however many edges
   the graph has (flooding every edge would send it once per edge). Over the exponential and
   one-peer-exponential graphs the trees are binomial (log2 n hops deep); over a ring about
   n / 2 hops.
2. **Store.** One message per (origin, phase); a repeat is a duplicate, never stored twice. A
   phase is open until the peer closes it; a message of a closed phase is late and neither
   stored nor forwarded, so what a peer applied is exactly what it held at the close. Only
   ``MAX_AHEAD`` phases from the oldest open one are taken (the buffer is bounded by
   ``MAX_AHEAD`` × peers messages), and only from origins the peer knows. The messages of the
   latest ``KEEP_CLOSED`` closed phases are kept to answer a peer that asks for one (rule 3).
3. **Repair.** Peers whose views of the swarm differ for a moment (one has not heard of a
   newcomer yet) compute different trees, and a forwarder that dies takes its subtree's copy
   with it: a peer still missing a live origin's message a while into the wait asks its
   graph neighbours for it, and any neighbour that holds it sends it. A message arrives once
   in the common case and at most once per neighbour asked otherwise (duplicates are answered
   DUPLICATE, never applied twice).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from gossipgrad.compression import Received
from gossipgrad.peer.membership.topology import Topology

#: Phases a peer takes messages for, counting from its oldest open one (a faster peer may be
#: a phase or two ahead; one further ahead than this is refused and retried by its sender).
MAX_AHEAD = 4
#: Closed phases whose messages are kept for peers that ask for one (rule 3).
KEEP_CLOSED = 2


def spanning_children(topology: Topology, ids: Sequence[str], origin: str, me: str) -> list[str]:
    """``me``'s children in the breadth-first tree rooted at ``origin`` over the sorted ``ids``
    (rule 1): where ``me`` forwards ``origin``'s message. Empty if either is not in ``ids``."""
    if origin not in ids or me not in ids:
        return []
    n = len(ids)
    root = ids.index(origin)
    parent = {root: root}
    frontier = deque([root])
    while frontier:
        i = frontier.popleft()
        for j in topology.all_neighbors(i, n):
            if j not in parent:
                parent[j] = i
                frontier.append(j)
    mine = ids.index(me)
    return [ids[j] for j, p in sorted(parent.items()) if p == mine and j != root]


@dataclass(frozen=True)
class Message:
    """One peer's compressed pseudo-gradient of one phase."""

    origin: str
    phase: int
    payload: bytes  # as it travels on: forwarded and answered as it came
    checksum: int  # the origin's anchor at the phase's start
    #: What its receipt checked and decompressed, added at the phase's end without reading
    #: the bytes again (None: the peer's own, or one never checked here).
    kept: Received | None = field(default=None, compare=False, repr=False)


class Offer(enum.Enum):
    """What the store did with a message."""

    NEW = "new"  # stored: forward it
    DUPLICATE = "duplicate"  # held already
    LATE = "late"  # its phase is closed here
    EARLY = "early"  # MAX_AHEAD or more phases ahead of the oldest open one
    UNKNOWN = "unknown"  # from an origin this peer does not know


class PhaseStore:
    """The messages of the open phases (rule 2). Thread-safe: server threads offer, the
    training thread closes."""

    def __init__(self, first_open: int = 0, max_ahead: int = MAX_AHEAD) -> None:
        self.max_ahead = max_ahead
        self._first_open = first_open
        self._phases: dict[int, dict[str, Message]] = {}
        self._closed: dict[int, dict[str, Message]] = {}
        self._lock = threading.Lock()

    @property
    def first_open(self) -> int:
        """The oldest phase not closed yet."""
        return self._first_open

    def offer(self, message: Message, known: Collection[str]) -> Offer:
        """Store ``message`` if it is new, of an open phase in range, from a known origin."""
        with self._lock:
            if message.phase < self._first_open:
                return Offer.LATE
            if message.phase >= self._first_open + self.max_ahead:
                return Offer.EARLY
            if message.origin not in known:
                return Offer.UNKNOWN
            phase = self._phases.setdefault(message.phase, {})
            if message.origin in phase:
                return Offer.DUPLICATE
            phase[message.origin] = message
            return Offer.NEW

    def holds(self, phase: int) -> set[str]:
        """The origins whose message of ``phase`` is here."""
        with self._lock:
            return set(self._phases.get(phase, ()))

    def lookup(self, origin: str, phase: int) -> Message | None:
        """``origin``'s message of ``phase``, open or among the kept closed ones."""
        with self._lock:
            for phases in (self._phases, self._closed):
                found = phases.get(phase, {}).get(origin)
                if found is not None:
                    return found
            return None

    def close(self, phase: int) -> list[Message]:
        """Close every phase up to ``phase``; ``phase``'s messages in origin order (the order
        every peer sums them in). Messages of earlier phases still open are dropped."""
        with self._lock:
            held = self._phases.pop(phase, {})
            for p in [p for p in self._phases if p < phase]:
                del self._phases[p]
            self._first_open = max(self._first_open, phase + 1)
            self._closed[phase] = held
            for p in sorted(self._closed)[:-KEEP_CLOSED]:
                del self._closed[p]
            return [held[o] for o in sorted(held)]

    def advance(self, first_open: int) -> None:
        """Phases before ``first_open`` count as closed, their messages dropped (a replica
        that took another peer's anchor of that phase); later ones stay."""
        with self._lock:
            for p in [p for p in self._phases if p < first_open]:
                del self._phases[p]
            self._first_open = max(self._first_open, first_open)

    def reset(self, first_open: int) -> None:
        """Drop everything; phases before ``first_open`` count as closed (a resumed state)."""
        with self._lock:
            self._phases.clear()
            self._closed.clear()
            self._first_open = first_open

    def held(self) -> int:
        """Messages held, open and kept closed phases."""
        with self._lock:
            return sum(len(p) for d in (self._phases, self._closed) for p in d.values())
