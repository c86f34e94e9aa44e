"""The peer table of one peer: who is known, in which state, at which incarnation.

Failure detection by silence (timeouts, no phi accrual): a peer silent for ``suspect_after``
seconds is *suspect* (kept in the topology, left out of mixing); silent for ``dead_after`` it
is *dead* (dropped, the topology is recomputed); dead for ``FORGET_DEAD_AFTER`` periods it is
forgotten. A peer that restarts comes back with a higher incarnation number, which wins over
anything said about its old self. The table holds no thread and sends nothing: the heartbeats
(``heartbeats.py``) feed it what they hear.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipgrad.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipgrad.peer.config import MembershipSection

log = logging.getLogger(__name__)

ALIVE, SUSPECT, DEAD = "alive", "suspect", "dead"
#: A peer dead for this many ``dead_after`` periods is forgotten (no more probes).
FORGET_DEAD_AFTER = 6


@dataclass
class PeerRecord:
    """What this peer knows of another."""

    info: pb.PeerInfo
    last_seen: float
    state: str = ALIVE
    heard_directly: bool = False


class PeerTable:
    """Every other peer this one knows of, aged by silence.

    Args:
        me: this peer's own PeerInfo (its step/round fields are updated by the owner).
        cfg: the membership section of the config (the silence timeouts).
        on_change: called when the set of present peers or a peer's incarnation changes.
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
        """Sorted ids of peers in the topology (alive or suspect), self included."""
        with self._lock:
            ids = [pid for pid, r in self._peers.items() if r.state != DEAD and not r.info.leaving]
        return sorted([*ids, self.me.id])

    def live_ids(self) -> list[str]:
        """Sorted ids of the peers taking part now: self and the alive ones."""
        with self._lock:
            ids = [pid for pid, r in self._peers.items() if r.state == ALIVE and not r.info.leaving]
        return sorted([*ids, self.me.id])

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

    def counts(self) -> dict[str, int]:
        """Number of known peers per state (self counted alive)."""
        out = {ALIVE: 1, SUSPECT: 0, DEAD: 0}
        with self._lock:
            for r in self._peers.values():
                out[r.state] += 1
        return out

    def known_infos(self) -> list[pb.PeerInfo]:
        """PeerInfos worth spreading: self and every peer not known dead."""
        with self._lock:
            infos = [r.info for r in self._peers.values() if r.state != DEAD]
        return [self.me, *infos]

    def view_digest(self) -> int:
        """64-bit digest of who is in this view: ids, addresses, incarnations, leaving flags
        of self and every peer not dead (progress fields left out: they change every beat)."""
        items = sorted((i.id, i.address, i.incarnation, i.leaving) for i in self.known_infos())
        digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    # ------------------------------------------------------------------ updates

    def observe(self, info: pb.PeerInfo, *, direct: bool) -> None:
        """Merge what we heard about a peer (directly from it, or second hand)."""
        if info.id == self.me.id or not info.id or not info.address:
            return
        changed = False
        now = time.monotonic()
        with self._lock:
            rec = self._peers.get(info.id)
            if rec is None:
                self._peers[info.id] = PeerRecord(info=info, last_seen=now, heard_directly=direct)
                changed = True
                log.info("peer %s joined at %s", info.id, info.address)
            elif info.incarnation > rec.info.incarnation:
                log.info("peer %s restarted (incarnation %d)", info.id, info.incarnation)
                rec.info, rec.last_seen, rec.state = info, now, ALIVE
                rec.heard_directly = direct
                changed = True
            elif info.incarnation == rec.info.incarnation and direct:
                rec.info = info
                rec.last_seen = now
                rec.heard_directly = True
                if rec.state != ALIVE:
                    changed = rec.state == DEAD or info.leaving
                    log.info("peer %s is back (%s -> alive)", info.id, rec.state)
                    rec.state = ALIVE
                if info.leaving:
                    changed = True
        if changed:
            self._on_change()

    def sweep(self) -> None:
        """Age peers: alive -> suspect -> dead by silence."""
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
                silent = now - r.last_seen
                if r.state != DEAD and r.info.leaving:
                    log.info("peer %s left", pid)
                    r.state, changed = DEAD, True
                elif r.state != DEAD and silent > self.cfg.dead_after:
                    log.warning("peer %s dead (silent %.1fs)", pid, silent)
                    r.state, changed = DEAD, True
                elif r.state == ALIVE and silent > self.cfg.suspect_after:
                    log.info("peer %s suspect (silent %.1fs)", pid, silent)
                    r.state = SUSPECT
        if changed:
            self._on_change()

    def _forget(self, peer_id: str) -> None:
        """Drop a long-dead peer (called under the lock); a subclass drops what it keeps."""
        self._peers.pop(peer_id)
