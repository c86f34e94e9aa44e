"""Who is in the swarm: heartbeats with peer exchange, and timeout-based failure detection.

A peer needs one bootstrap address. Heartbeats exchange the two peers' views of the swarm, so
the peer list spreads epidemically; each side also sends a 64-bit digest of its view, and the
list itself travels only when the other side's digest differs (a steady swarm's heartbeats stay
a few dozen bytes however many peers it has). A peer silent for
``suspect_after`` seconds is *suspect* (kept in the topology, left out of mixing); silent for
``dead_after`` it is *dead* (dropped, the topology is recomputed). A peer that restarts comes
back with a higher incarnation number, which wins over anything said about its old self.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gossipgrad.peer.config import MembershipSection
from gossipgrad.proto import gossip_pb2 as pb

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


class Membership:
    """The peer table of one peer, kept fresh by a background heartbeat thread.

    Args:
        me: this peer's own PeerInfo (its step/round fields are updated by the owner).
        swarm: swarm name; heartbeats from another swarm are refused by the server.
        cfg: the membership section of the config.
        bootstrap: addresses to contact until some peer answers.
        heartbeat: callable(address, request, timeout) -> HeartbeatReply (the transport).
        on_change: called (from the heartbeat thread) when the set of present peers or a
            peer's incarnation changes.
        near: ids of this peer's gossip neighbours among the given live ids (heartbeated every
            interval; the others every ``far_every`` intervals).
    """

    def __init__(
        self,
        me: pb.PeerInfo,
        swarm: str,
        cfg: MembershipSection,
        bootstrap: list[str],
        heartbeat: Callable[[str, pb.HeartbeatRequest, float], pb.HeartbeatReply],
        on_change: Callable[[], None] = lambda: None,
        near: Callable[[list[str]], set[str]] = lambda ids: set(),
    ) -> None:
        self.me = me
        self.swarm = swarm
        self.cfg = cfg
        self.bootstrap = [a for a in bootstrap if a != me.address]
        self._heartbeat = heartbeat
        self._on_change = on_change
        self._near = near
        self._peers: dict[str, PeerRecord] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="heartbeat")
        self._tick = 0
        self._rng = random.Random(me.id)
        # address -> the view digest that peer last told us (skip the list when it matches ours)
        self._their_digest: dict[str, int] = {}

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

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Server side of Heartbeat: learn the sender and its view, answer with ours."""
        self.observe(request.sender, direct=True)
        for info in request.known:
            self.observe(info, direct=False)
        digest = self.view_digest()
        known = [] if request.view_digest == digest else self.known_infos()
        return pb.HeartbeatReply(responder=self.me, known=known, view_digest=digest)

    def _sweep(self) -> None:
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
                self._their_digest.pop(self._peers.pop(pid).info.address, None)
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

    def _beat(self, address: str) -> None:
        digest = self.view_digest()
        with self._lock:
            same = self._their_digest.get(address) == digest
        request = pb.HeartbeatRequest(
            swarm=self.swarm,
            sender=self.me,
            known=[] if same else self.known_infos(),
            view_digest=digest,
        )
        try:
            reply = self._heartbeat(address, request, max(self.cfg.heartbeat_interval, 1.0))
        except Exception as err:  # unreachable peers are expected; the sweep handles them
            log.debug("heartbeat to %s failed: %s", address, err)
            with self._lock:
                self._their_digest.pop(address, None)
            return
        with self._lock:
            self._their_digest[address] = reply.view_digest
        self.observe(reply.responder, direct=True)
        for info in reply.known:
            self.observe(info, direct=False)

    def beat_once(self) -> None:
        """One heartbeat round: neighbours every time, other live peers every ``far_every``
        rounds, dead ones now and then (to notice a return), bootstrap while alone."""
        self._tick += 1
        near = self._near(self.live_ids())
        far_due = self._tick % self.cfg.far_every == 0
        with self._lock:
            targets = [
                r.info.address
                for pid, r in self._peers.items()
                if (r.state != DEAD and (far_due or pid in near)) or self._tick % 5 == 0
            ]
            alone = not any(r.state != DEAD for r in self._peers.values())
        if alone:
            targets += self.bootstrap
        self._rng.shuffle(targets)
        futures = [self._pool.submit(self._beat, a) for a in dict.fromkeys(targets)]
        for f in futures:
            f.result()
        self._sweep()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    self.beat_once()
                except RuntimeError as err:
                    if "shutdown" in str(err):  # the pool is gone: the process is exiting
                        return
                    log.exception("heartbeat round failed; the next one goes on")
                except Exception:  # one bad beat must not stop heartbeats for good
                    log.exception("heartbeat round failed; the next one goes on")
                self._stop.wait(
                    max(0.0, self.cfg.heartbeat_interval - (time.monotonic() - started))
                )

        self._thread = threading.Thread(target=loop, name="membership", daemon=True)
        self._thread.start()

    def wait_for(self, count: int, timeout: float) -> bool:
        """Block until `count` peers (self included) are present, or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            if len(self.present_ids()) >= count:
                return True
            time.sleep(0.05)
        return len(self.present_ids()) >= count

    def announce_leaving(self) -> None:
        """Tell every live peer we are leaving (best effort), so they rewire at once."""
        self.me.leaving = True
        with self._lock:
            targets = [r.info.address for r in self._peers.values() if r.state != DEAD]
        futures = [self._pool.submit(self._beat, a) for a in targets]
        for f in futures:
            f.result()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
