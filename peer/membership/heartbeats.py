"""Heartbeats with peer exchange: how a peer learns who is in the swarm and keeps it fresh.

A peer needs one bootstrap address. Heartbeats exchange the two peers' views of the swarm, so
the peer list spreads epidemically; each side also sends a 64-bit digest of its view, and the
list itself travels only when the other side's digest differs (a steady swarm's heartbeats stay
a few dozen bytes however many peers it has). What a heartbeat tells goes into the peer table
(``peers.py``), which ages silent peers to suspect and dead.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from gossipgrad.peer.membership.peers import DEAD, PeerTable
from gossipgrad.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipgrad.peer.config import MembershipSection

log = logging.getLogger(__name__)


class Membership(PeerTable):
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
        super().__init__(me, cfg, on_change)
        self.swarm = swarm
        self.bootstrap = [a for a in bootstrap if a != me.address]
        self._heartbeat = heartbeat
        self._near = near
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="heartbeat")
        self._tick = 0
        self._rng = random.Random(me.id)
        # address -> the view digest that peer last told us (skip the list when it matches ours)
        self._their_digest: dict[str, int] = {}

    # ------------------------------------------------------------------ heartbeats

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Server side of Heartbeat: learn the sender and its view, answer with ours."""
        self.observe(request.sender, direct=True)
        for info in request.known:
            self.observe(info, direct=False)
        digest = self.view_digest()
        known = [] if request.view_digest == digest else self.known_infos()
        return pb.HeartbeatReply(responder=self.me, known=known, view_digest=digest)

    def _forget(self, peer_id: str) -> None:
        address = self._peers[peer_id].info.address
        super()._forget(peer_id)
        self._their_digest.pop(address, None)

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
        self.sweep()

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
