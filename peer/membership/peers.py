"""The peer table of one peer: who is known, in which state, at which incarnation.

Failure detection by unanswered heartbeats (timeouts, no phi accrual): a peer that has left
this peer's heartbeats unanswered for ``suspect_after`` seconds, with no word from it since, is
*suspect* (kept in the topology, left out of mixing) -- at once if a call found its address
refusing connections (its process is gone; a crashed peer's neighbours then bridge over it
without waiting); for ``dead_after`` it is *dead* (dropped, the topology is recomputed); dead
for ``FORGET_DEAD_AFTER`` periods it is forgotten. Silence
alone proves nothing here, because far peers are heartbeated only now and then
(``heartbeats.py``): only a heartbeat that went unanswered starts the clock.

What a peer says about itself and what others say about it are kept apart (``merge``). Its
incarnation, address and departure are taken only from its own word: a heartbeat it sent
(under mutual TLS the transport has matched the sender to its certificate) or its answer to
a heartbeat sent to the address held here. Another peer's word (hearsay) can add a peer to
probe, never kill it, move it or raise its incarnation, so one member, or one bug in one,
cannot take others out of every table. Nor can it put a peer into anyone's topology: a peer
is *present* (a neighbour candidate, counted, passed on in peer lists) only once it has
spoken for itself in its current life. Until then it is only probed; an id a member made up,
at an address where no server holds that id's certificate, never answers, so it takes no
neighbour slot and spreads no further than the tables the member told it to. A peer that
says it is still *checking* how it is called (its dial-back at start, ``PeerInfo.checking``)
is not present either; it is heartbeated every interval (so it hears at once when this
peer is done checking too), but calls to it may have no way in yet, so an unanswered one is
not held against it: its own silence for ``dead_after`` is the clock of its death.

A death travels as a certificate: the dead peer's PeerInfo with ``leaving`` set. A table that
receives one for a peer it holds alive does not believe it; it marks the peer *condemned*, and
the peer is dead here as soon as one of this table's own heartbeats to it goes unanswered (a
live peer answers and the rumour is dropped), the "suspect, then confirm" rule of SWIM (Das,
Gupta, Motivala, DSN 2002) with the confirmation made locally. A restart heard second hand
(another incarnation or address) is checked the same way: the peer is heartbeated at the
address held here, and its own answer, or its silence, settles it; once its old life is dead
or gone here, the new one is taken to probe. A restarted peer's own word wins over anything
held about its old self, whether its new incarnation is higher or (a clock behind) lower.
The table holds no thread and sends nothing: the heartbeats feed it what they hear.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipgrad.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipgrad.peer.config import MembershipSection

log = logging.getLogger(__name__)

ALIVE, SUSPECT, DEAD = "alive", "suspect", "dead"
#: A peer dead for this many ``dead_after`` periods is forgotten (no more probes).
FORGET_DEAD_AFTER = 6
#: Most peers a table holds: beyond it, peers heard of second hand are not added (a peer
#: heard from directly always is). Also the cap on a heartbeat's peer list.
MAX_PEERS = 4096


@dataclass
class PeerRecord:
    """What this peer knows of another."""

    info: pb.PeerInfo
    last_seen: float
    state: str = ALIVE
    heard_directly: bool = False
    #: When a heartbeat to it first went unanswered since it last spoke (None: it answers).
    unanswered_since: float | None = None
    #: A peer reported it dead at its incarnation; dead here once it leaves us unanswered.
    condemned: bool = False
    #: A call found nothing listening at its address (its process is gone) and it has not
    #: answered since: calls to it go on channels closed after each (see ``gone_addresses``).
    gone: bool = False
    #: Another peer said it lives at another incarnation or address: heartbeated once at the
    #: address held here, whose answer (or silence) settles it.
    recheck: bool = False
    #: Who told of it, while it is heard of only second hand (probes are shared out fairly
    #: among those who told: ``heartbeats.py``).
    told_by: str = ""


def _present(r: PeerRecord) -> bool:
    """In the topology: not dead, not leaving, heard from itself in its current life, and
    done checking how it is called."""
    return r.state != DEAD and not r.info.leaving and r.heard_directly and not r.info.checking


def _spoke_for_itself(r: PeerRecord) -> bool:
    """Not dead, and heard from directly in its current life: known first hand."""
    return r.state != DEAD and r.heard_directly


def to_probe(r: PeerRecord) -> bool:
    """Heard of only second hand in its current life, not dead, not leaving: to probe."""
    return r.state != DEAD and not r.info.leaving and not r.heard_directly


class PeerTable:
    """Every other peer this one knows of, aged by silence.

    Args:
        me: this peer's own PeerInfo (its step/round fields are updated by the owner).
        cfg: the membership section of the config (the silence timeouts).
        on_change: called when the set of present peers, a peer's state or its incarnation
            changes.
    """

    def __init__(
        self,
        me: pb.PeerInfo,
        cfg: MembershipSection,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.me = me
        self.cfg = cfg
        self._on_change = on_change
        self._peers: dict[str, PeerRecord] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ views

    def present_ids(self) -> list[str]:
        """Sorted ids of peers in the topology (alive or suspect, and heard from themselves
        in their current life), self included."""
        with self._lock:
            ids = [pid for pid, r in self._peers.items() if _present(r)]
        return sorted([*ids, self.me.id])

    def live_ids(self) -> list[str]:
        """Sorted ids of the peers taking part now: self and the alive present ones."""
        with self._lock:
            ids = [pid for pid, r in self._peers.items() if _present(r) and r.state == ALIVE]
        return sorted([*ids, self.me.id])

    def heard_ids(self) -> list[str]:
        """Sorted ids of the peers not dead that spoke for themselves in their current life,
        those still checking how they are called included: whom a starting peer has found
        (two peers starting together, each the other's bootstrap, are both checking)."""
        with self._lock:
            return sorted(pid for pid, r in self._peers.items() if _spoke_for_itself(r))

    def unverified_ids(self) -> list[str]:
        """Ids heard of only second hand in their current life and not dead: to probe."""
        with self._lock:
            return sorted(pid for pid, r in self._peers.items() if to_probe(r))

    def is_alive(self, peer_id: str) -> bool:
        with self._lock:
            r = self._peers.get(peer_id)
            return r is not None and r.state == ALIVE

    def record(self, peer_id: str) -> PeerRecord | None:
        with self._lock:
            return self._peers.get(peer_id)

    def address_of(self, peer_id: str) -> str | None:
        r = self.record(peer_id)
        return r.info.address if r else None

    def gone_addresses(self) -> set[str]:
        """Addresses of peers whose process is gone (a call was refused; no answer since).

        A gRPC channel whose call was refused keeps reconnecting in the background (0.1 s,
        then growing) until closed: kept for a crashed neighbour until it is dead here
        (``dead_after``), a dozen connects for nothing, on every peer that called it."""
        with self._lock:
            return {r.info.address for r in self._peers.values() if r.gone and r.state != DEAD}

    def counts(self) -> dict[str, int]:
        """Number of known peers per state (self counted alive)."""
        out = {ALIVE: 1, SUSPECT: 0, DEAD: 0}
        with self._lock:
            for r in self._peers.values():
                out[r.state] += 1
        return out

    def known_infos(self) -> list[pb.PeerInfo]:
        """PeerInfos worth spreading: self and every peer not known dead that has spoken for
        itself in its current life (what is only hearsay here is not passed on)."""
        with self._lock:
            infos = [r.info for r in self._peers.values() if _spoke_for_itself(r)]
        return [self.me, *infos]

    def certificates(self) -> list[pb.PeerInfo]:
        """Death certificates: each dead (not yet forgotten) peer's PeerInfo with ``leaving``
        set, sent with the peer list so a death spreads beyond the peers that saw it."""
        with self._lock:
            dead = [r.info for r in self._peers.values() if r.state == DEAD]
        certs = []
        for info in dead:
            cert = pb.PeerInfo()
            cert.CopyFrom(info)
            cert.leaving = True
            certs.append(cert)
        return certs

    def view_digest(self) -> int:
        """64-bit digest of who is in this view: ids, addresses, incarnations, leaving,
        relay and checking fields of self and every peer not dead (progress fields left
        out: they change every beat)."""
        items = sorted(
            (i.id, i.address, i.incarnation, i.leaving, i.relay, i.checking)
            for i in self.known_infos()
        )
        digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    # ------------------------------------------------------------------ updates

    def observe(self, info: pb.PeerInfo, *, direct: bool) -> None:
        """Merge what we heard about a peer: from the peer itself (``direct``) or second
        hand (see :meth:`merge`)."""
        if direct:
            self.merge(own=[info])
        else:
            self.merge(hearsay=[info])

    def merge(
        self,
        own: Iterable[pb.PeerInfo] = (),
        hearsay: Iterable[pb.PeerInfo] = (),
        told_by: str = "",
    ) -> None:
        """Merge PeerInfos, reporting at most one change to the owner (its rewire costs
        O(n), so a long peer list costs one rewire, not one per entry).

        ``own``: each is its peer's own word (the sender of a heartbeat, which the transport
        matched against its certificate, or the answer of the peer heartbeated at the
        address this table holds for it). Only that may set a peer's incarnation, address
        or departure, and it may set a *lower* incarnation (a restart on a clock that is
        behind). ``hearsay``: what another peer said. It only adds a peer to probe (up to
        :data:`MAX_PEERS`), condemns one (a departure: dead here only if it then leaves one
        of our heartbeats unanswered), or asks for one heartbeat to it (a new life: taken
        second hand only once the old life is gone or dead here). ``told_by``: who said it
        (a peer id, or an address where none is known).
        """
        changed = False
        with self._lock:
            now = time.monotonic()
            for info in own:
                if info.id != self.me.id and info.id and info.address:
                    changed = self._from_itself(info, now) or changed
            for info in hearsay:
                if info.id != self.me.id and info.id and info.address:
                    changed = self._from_hearsay(info, now, told_by) or changed
        if changed:
            self._on_change()

    def _from_itself(self, info: pb.PeerInfo, now: float) -> bool:
        """Merge a peer's own word about itself (under the lock); whether anything changed."""
        rec = self._peers.get(info.id)
        if rec is None:
            self._peers[info.id] = rec = PeerRecord(info=info, last_seen=now, heard_directly=True)
            log.info("peer %s joined at %s", info.id, info.address)
            changed = True
        elif (info.incarnation, info.address) != (rec.info.incarnation, rec.info.address):
            log.info(
                "peer %s restarted (incarnation %d at %s)", info.id, info.incarnation, info.address
            )
            rec.info, rec.last_seen, rec.state = info, now, ALIVE
            rec.heard_directly = True
            rec.unanswered_since, rec.condemned, rec.gone, rec.recheck = None, False, False, False
            changed = True
        else:
            if (info.relay, info.relay_epoch) != (rec.info.relay, rec.info.relay_epoch):
                log.info("peer %s is called through %s", info.id, info.relay or "no relay")
                changed = True  # its callers dial another way now
            else:
                changed = info.checking != rec.info.checking  # it joins the topology now
            rec.info = info
            rec.last_seen = now
            rec.heard_directly = True
            rec.unanswered_since, rec.condemned, rec.gone, rec.recheck = None, False, False, False
            # A goodbye is no return: it is handled below (dead at once), and a second one
            # (its heartbeat loop and its farewell both say it) changes nothing.
            if rec.state != ALIVE and not info.leaving:
                changed = True  # back from suspect or dead: the counts changed too
                log.info("peer %s is back (%s -> alive)", info.id, rec.state)
                rec.state = ALIVE
        if rec.info.leaving and rec.state != DEAD:  # it said so itself: gone at once
            log.info("peer %s left", info.id)
            rec.state, changed = DEAD, True
        return changed

    def _from_hearsay(self, info: pb.PeerInfo, now: float, told_by: str = "") -> bool:
        """Merge what ``told_by`` said of ``info.id`` (under the lock); whether anything
        changed. Never kills, moves or restarts a peer this table holds."""
        rec = self._peers.get(info.id)
        if rec is None:
            if info.leaving or len(self._peers) >= MAX_PEERS:
                return False  # the death of a peer we never knew: nothing to drop
            self._peers[info.id] = PeerRecord(info=info, last_seen=now, told_by=told_by)
            log.info("peer %s joined at %s (second hand)", info.id, info.address)
            return True
        if info.incarnation < rec.info.incarnation or (rec.state == DEAD and info.leaving):
            return False  # news of an older life, or of a death already taken
        if info.leaving:
            if not rec.condemned:
                log.info("peer %s reported dead; checking", info.id)
                rec.condemned = True
            return False
        if (info.incarnation, info.address) == (rec.info.incarnation, rec.info.address):
            newer_relay = info.relay_epoch > rec.info.relay_epoch
            settled = rec.info.checking and not info.checking
            if not newer_relay and not settled:
                return False
            moved = pb.PeerInfo()
            moved.CopyFrom(rec.info)
            if newer_relay:
                # A newer choice of relay, heard second hand: where to call it (a wrong one
                # only fails the calls; under TLS it cannot answer as the peer).
                moved.relay, moved.relay_epoch = info.relay, info.relay_epoch
                log.info(
                    "peer %s is called through %s (second hand)", info.id, moved.relay or "none"
                )
            # Done checking how it is called, heard second hand: a peer to probe now (its
            # own word could only say so again; word that it checks is never taken here).
            moved.checking = moved.checking and info.checking
            rec.info = moved
            return True
        if rec.state == DEAD or rec.gone:
            # The old life is over here (dead, or nothing listens at its address): take the
            # new one to probe. Should nobody answer there, it dies again, harming no one.
            log.info("peer %s restarted (incarnation %d, second hand)", info.id, info.incarnation)
            rec.info, rec.last_seen, rec.state = info, now, ALIVE
            rec.heard_directly, rec.told_by = False, told_by
            rec.unanswered_since, rec.condemned, rec.gone, rec.recheck = None, False, False, False
            return True
        rec.recheck = True  # said to live elsewhere or anew: ask it where this table holds it
        return False

    def unanswered(self, peer_id: str, since: float) -> None:
        """A heartbeat to ``peer_id`` sent at ``since`` (monotonic) got no answer from it.
        Not held against a peer still checking how it is called: no call may reach it yet
        (its silence is the clock, ``sweep``)."""
        with self._lock:
            rec = self._peers.get(peer_id)
            if rec is None or rec.info.checking:
                return
            rec.recheck = False  # asked, and no word: suspicion as for any silence
            if rec.unanswered_since is None:
                rec.unanswered_since = since

    def refused(self, peer_id: str, since: float) -> None:
        """A call to ``peer_id`` sent at ``since`` (monotonic) found nothing listening at its
        address: its process is gone. Suspect at once (left out of mixing, its neighbours
        bridged) rather than after ``suspect_after`` seconds of unanswered heartbeats; dead
        still waits for ``dead_after``, and an answer brings it back. Marked *gone* until it
        answers (``gone_addresses``)."""
        with self._lock:
            rec = self._peers.get(peer_id)
            if rec is None or rec.state == DEAD or rec.info.checking:
                return
            self.unanswered(peer_id, since)  # the dead_after clock (an RLock: re-entered)
            newly_gone, rec.gone = not rec.gone, True
            if rec.state == ALIVE:
                log.info("peer %s suspect (connection refused)", peer_id)
                rec.state = SUSPECT
            elif not newly_gone:
                return
        self._on_change()

    def sweep(self) -> None:
        """Age peers: alive -> suspect -> dead by unanswered heartbeats (or a confirmed report)."""
        now = time.monotonic()
        changed = False
        with self._lock:
            # Dead for long: forgotten (no more probes; a restart is a new incarnation anyway).
            for pid in [
                p
                for p, r in self._peers.items()
                if r.state == DEAD and now - r.last_seen > FORGET_DEAD_AFTER * self.cfg.dead_after
            ]:
                self._forget(pid)
            for pid, r in self._peers.items():
                if r.state == DEAD:
                    continue
                if r.info.checking and (
                    r.condemned if not r.heard_directly else now - r.last_seen > self.cfg.dead_after
                ):
                    # Unanswered calls are not held against it while it checks: its own
                    # silence is the clock, or, known only second hand, the word of one
                    # that heard it.
                    log.warning("peer %s dead while checking how it is called", pid)
                    r.state, changed = DEAD, True
                    continue
                if r.info.leaving:
                    log.info("peer %s left", pid)
                    r.state, changed = DEAD, True
                    continue
                if r.unanswered_since is None:
                    continue
                silent = now - r.unanswered_since
                if silent > self.cfg.dead_after:
                    log.warning("peer %s dead (unanswered %.1fs)", pid, silent)
                    r.state, changed = DEAD, True
                elif r.condemned:
                    log.warning("peer %s dead (reported dead, unanswered here)", pid)
                    r.state, changed = DEAD, True
                elif r.state == ALIVE and silent > self.cfg.suspect_after:
                    log.info("peer %s suspect (unanswered %.1fs)", pid, silent)
                    r.state, changed = SUSPECT, True  # for the gauge of peers by state
        if changed:
            self._on_change()

    def _forget(self, peer_id: str) -> None:
        """Drop a long-dead peer (called under the lock); a subclass drops what it keeps."""
        self._peers.pop(peer_id)
