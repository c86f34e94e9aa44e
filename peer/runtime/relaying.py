"""Which relay a peer that nobody can dial uses, and choosing another when it goes.

A peer the reachability check found unreachable (``peer.relay = "auto"``) is called through
a relay (:mod:`~gossipgrad.peer.network.relay`). :class:`RelayKeeper` chooses it:

1. the candidates are the live members called directly (no relay of their own);
2. each is heartbeated :data:`RTT_SAMPLES` times, which measures the round trip to it (the
   shortest counts: one sample carries the scheduling noise of both ends) and brings its
   load (the peers attached to it now, ``PeerInfo.relaying``); they are tried in the order
   of :func:`relay_score`, the lowest first;
3. the first that takes this peer (``Attach``; a member relaying for ``relay_capacity``
   peers refuses) is its relay: its id goes into this peer's ``PeerInfo.relay`` with a new
   ``relay_epoch``, so the next heartbeats tell the neighbours, and the peer lists the rest;
4. while attached, a thread watches the Attach call and the relay's record: when the call
   ends (the relay died, left or dropped this peer) or the relay is no longer alive in the
   peer table, the choice is made again without it, every heartbeat interval until one
   takes this peer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from gossipgrad.peer.membership.heartbeats import Membership
from gossipgrad.peer.network.relay import Attachment
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Seconds a relay has to take this peer (its first AttachEvent).
ATTACH_TIMEOUT_S = 5.0
#: Round trips shorter than this count as this long in :func:`relay_score`: on one host or
#: one LAN the difference between two members is the heartbeat's own handling, not
#: distance, and their loads should decide.
RTT_FLOOR_S = 0.005
#: Heartbeats sent to each candidate when choosing; the shortest round trip counts.
RTT_SAMPLES = 3


def relay_score(rtt: float, load: int) -> float:
    """How costly a member is as this peer's relay (lower is better):
    ``max(rtt, RTT_FLOOR_S) * (1 + load)``.

    Every call to this peer crosses the relay (the round trip), and the relay shares its
    uplink and CPU with its own training and with the ``load`` peers it already relays for
    (each one more divides what is left). A member twice as far away that relays for nobody
    ties with one that relays for one peer; a member on the same LAN that relays for three
    still beats an idle one 80 ms away (5 ms x 4 against 80 ms).
    """
    return max(rtt, RTT_FLOOR_S) * (1 + max(0, load))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A member that could relay: the heartbeat round trip measured to it, and the peers
    it relayed for as it answered (not counting this one)."""

    info: pb.PeerInfo
    rtt: float
    load: int = 0

    @property
    def score(self) -> float:
        """:func:`relay_score` of this member."""
        return relay_score(self.rtt, self.load)


class RelayKeeper:
    """This peer's relay: chosen by round trip and load, re-chosen when it goes.

    Args:
        membership: the peer table (candidates; this peer's own PeerInfo carries the choice).
        measure: ``measure(info)``: one heartbeat to a member: its round trip, seconds, and
            the member's PeerInfo as it answered (raises if it goes unanswered).
        attach: ``attach(info)``: an :class:`Attachment` to that member, started (raises
            TransportError if it does not take this peer).
        on_change: called with the new relay's id ("" when none) after every change.
    """

    def __init__(
        self,
        membership: Membership,
        measure: Callable[[pb.PeerInfo], tuple[float, pb.PeerInfo]],
        attach: Callable[[pb.PeerInfo], Attachment],
        on_change: Callable[[str], None] = lambda relay: None,
    ) -> None:
        self._membership = membership
        self._measure = measure
        self._attach = attach
        self._on_change = on_change
        self._current: Attachment | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Why each member tried last did not become the relay (member id -> words).
        self.refusals: dict[str, str] = {}

    @property
    def relay(self) -> str:
        """The relay's id ("" while none takes this peer)."""
        current = self._current
        return current.relay if current is not None and current.alive else ""

    def candidates(self, exclude: set[str] = frozenset()) -> list[Candidate]:
        """Live members called directly, the lowest :func:`relay_score` first (unanswered
        ones left out)."""
        m = self._membership
        mine = self.relay  # the relay this peer uses now counts this peer in its load
        out = []
        for info in m.known_infos():
            if info.id == m.me.id or info.relay or info.id in exclude or not m.is_alive(info.id):
                continue
            try:
                samples = [self._measure(info) for _ in range(RTT_SAMPLES)]
            except Exception as err:  # no answer: no relay
                self.refusals[info.id] = f"no heartbeat answer ({err})"
                continue
            rtt, answered = min(samples, key=lambda sample: sample[0])
            load = answered.relaying if answered.id == info.id else info.relaying
            out.append(Candidate(info, rtt, load - (info.id == mine)))
        return sorted(out, key=lambda c: c.score)

    def choose(self, exclude: set[str] = frozenset()) -> str:
        """Attach to the best-scored member that takes this peer; its id, or "" if none
        did (:attr:`refusals` says why)."""
        self.refusals = {}
        for c in self.candidates(exclude):
            try:
                attachment = self._attach(c.info)
            except Exception as err:  # refused, full, too old, gone
                self.refusals[c.info.id] = str(err)
                continue
            self._set(attachment)
            log.info(
                "called through relay %s (heartbeat round trip %.1f ms, relaying for %d more)",
                c.info.id,
                c.rtt * 1e3,
                c.load,
            )
            return c.info.id
        self._set(None)
        return ""

    def _set(self, attachment: Attachment | None) -> None:
        old, self._current = self._current, attachment
        if old is not None and old is not attachment:
            old.close()
        me = self._membership.me
        relay = attachment.relay if attachment is not None else ""
        if relay != me.relay or attachment is not None:
            me.relay, me.relay_epoch = relay, time.time_ns()
            self._on_change(relay)

    def start(self) -> None:
        """Watch the relay from a thread of its own; choose another when it goes."""
        self._thread = threading.Thread(target=self._run, name="relay-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(0.1, self._membership.cfg.heartbeat_interval)
        while not self._stop.is_set():
            current = self._current
            ended = current is None or current.wait_ended(interval)
            if not ended and (self._membership.is_alive(current.relay) or self._stop.is_set()):
                continue
            if self._stop.is_set():
                return
            lost = {current.relay} if current is not None else set()
            if current is not None:
                log.warning("relay %s lost: choosing another", current.relay)
            if not self.choose(exclude=lost):
                log.warning("no member takes this peer as a relay now: %s", self.refusals)
                self._stop.wait(interval)

    def close(self) -> None:
        """Stop watching and detach."""
        self._stop.set()
        if self._current is not None:
            self._current.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
