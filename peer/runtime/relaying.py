"""Which relay a peer that nobody can dial uses, and choosing another when it goes.

A peer the reachability check found unreachable (``peer.relay = "auto"``) is called through
a relay (:mod:`~gossipgrad.peer.network.relay`). :class:`RelayKeeper` chooses it:

1. the candidates are the live members called directly (no relay of their own);
2. each is heartbeated once, and they are tried in the order of the round trips measured,
   the nearest first: the relay is on the path of every call to this peer;
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


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A member that could relay, with the heartbeat round trip measured to it."""

    info: pb.PeerInfo
    rtt: float


class RelayKeeper:
    """This peer's relay: chosen by round trip, re-chosen when it goes.

    Args:
        membership: the peer table (candidates; this peer's own PeerInfo carries the choice).
        measure: ``measure(info)``: one heartbeat's round trip to a member, seconds (raises
            if it goes unanswered).
        attach: ``attach(info)``: an :class:`Attachment` to that member, started (raises
            TransportError if it does not take this peer).
        on_change: called with the new relay's id ("" when none) after every change.
    """

    def __init__(
        self,
        membership: Membership,
        measure: Callable[[pb.PeerInfo], float],
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
        """Live members called directly, nearest first (unanswered ones left out)."""
        m = self._membership
        out = []
        for info in m.known_infos():
            if info.id == m.me.id or info.relay or info.id in exclude or not m.is_alive(info.id):
                continue
            try:
                out.append(Candidate(info, self._measure(info)))
            except Exception as err:  # no answer: no relay
                self.refusals[info.id] = f"no heartbeat answer ({err})"
        return sorted(out, key=lambda c: c.rtt)

    def choose(self, exclude: set[str] = frozenset()) -> str:
        """Attach to the nearest member that takes this peer; its id, or "" if none did
        (:attr:`refusals` says why)."""
        self.refusals = {}
        for c in self.candidates(exclude):
            try:
                attachment = self._attach(c.info)
            except Exception as err:  # refused, full, too old, gone
                self.refusals[c.info.id] = str(err)
                continue
            self._set(attachment)
            log.info(
                "called through relay %s (heartbeat round trip %.1f ms)", c.info.id, c.rtt * 1e3
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
