"""Heartbeats with peer exchange: how a peer learns who is in the swarm and keeps it fresh.

A peer needs one bootstrap address. Heartbeats exchange the two peers' views of the swarm, so
the peer list spreads epidemically; each side also sends a 64-bit digest of its view, and the
list itself travels only when the other side's digest differs (a steady swarm's heartbeats stay
a few dozen bytes however many peers it has; a sender that does not know the other's digest
for its current view sends none and follows up with the list only if the answer differs).
What a heartbeat tells goes into the peer table (``peers.py``).

Who is heartbeated, per interval (``membership.heartbeat_interval``):

1. the gossip neighbours (and former ones for ``dead_after`` after a rewire: a round begun
   before it may still wait on one), every peer whose last heartbeat went unanswered or
   that another peer reported dead (until it answers or is dead here), and every peer still
   checking how it can be called (``peers.py``: it hears at once when this one is done);
2. every ``far_every`` intervals, ``ceil(far_fanout * log2 n)`` of the other live peers, taken
   round-robin from a list shuffled anew on each pass, so each one is heartbeated at least once
   per pass (SWIM's round-robin probe selection: Das, Gupta, Motivala, DSN 2002, section 4.3);
3. peers dead by silence every 5th interval (to notice a return from a partition or a
   stall; not those that said they were leaving), and the bootstrap while alone;
4. peers heard of only second hand (not yet in the topology: ``peers.py``), *probed* on
   ``PROBE_THREADS`` threads of their own, never waited for by the round: an id a member
   made up, at an address that takes the connection and never answers, holds its probe for
   a whole heartbeat timeout, and waited for, it would delay the next heartbeat to every
   neighbour by as much. Per interval at most ``VERIFY_PER_INTERVAL`` probes, each id once,
   and per peer that told of them (``told_by``) at most ``VERIFY_PER_SOURCE``, at most
   ``PROBES_PER_SOURCE_IN_FLIGHT`` at a time, a random pick; a probe that ends starts the
   next. So a joiner, or a peer told of one, has it in its topology within an interval or
   two, while one member telling of made-up ids holds at most two probe threads and takes
   at most part of the budget from the ids honest peers told of;
5. peers whose address refused a call (*gone*: nothing listens there, the process has ended)
   every ``GONE_PROBE_EVERY``-th interval while they are suspect, instead of 1, and never once
   they are dead, instead of 3: only a new process can answer there, and a new process says
   so itself (it joins, and its new incarnation spreads with the peer lists). Probed every
   interval, the crashed peers of a churn run cost each survivor two refused probes a second,
   each on a channel of its own; probed while dead (every 10th interval, or every 5th where
   a certificate told of the crash, as it does most peers), until forgotten, still 1.6 a
   second.

So a peer sends ``degree + ceil(far_fanout * log2 n) / far_every`` heartbeats per interval in a
healthy swarm, where heartbeating every peer cost ``degree + n / far_every``. Why this is
enough, following SWIM rather than gossiped heartbeat counters (van Renesse, Minsky, Hayden,
Middleware 1998; those put every member's counter in every message, O(n) bytes): a peer is
judged dead only by heartbeats *it sent* that went unanswered, never by silence, so a far peer
heartbeated once a pass is not aged by the gaps between passes. Its gossip neighbours
heartbeat it every interval and see a death within ``dead_after``; the death then spreads as a
certificate in the peer lists (whose digests now differ), and every peer that receives one
confirms it with a heartbeat of its own before dropping the peer (a live peer answers, so a
stale or false report kills no one; see ``peers.py``). Who is dead is thus agreed swarm-wide
within ``death_agreed_within``: ``dead_after`` plus an interval and a heartbeat timeout per hop
of the certificate, ``ceil(log2 n) + 1`` hops (where heartbeating everyone took ``dead_after``
and a few intervals, but ``n / far_every`` heartbeats per interval).

The heartbeat thread waits for a round's answers (slow ones pace it: backpressure in a loaded
swarm), except from a target whose last heartbeat went unanswered: for that one only until
the interval is over. A member that takes connections and never answers holds its heartbeat
for a whole heartbeat timeout (twice the interval by default), and waited for every round, it
halved every neighbour's heartbeats. Its beat stays in flight, and it is left out of the
rounds until it ends (one beat in flight per target), so it holds one thread of the pool, not
one per round.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from gossipgrad.peer.membership.peers import DEAD, MAX_PEERS, PeerTable, to_probe
from gossipgrad.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipgrad.peer.config import MembershipSection

log = logging.getLogger(__name__)

#: A peer whose address refused a call is probed every this many intervals (module docstring).
GONE_PROBE_EVERY = 10
#: Peers heard of only second hand probed per interval, at most (module docstring).
VERIFY_PER_INTERVAL = 32
#: Of those, at most this many told of by one peer (module docstring).
VERIFY_PER_SOURCE = 16
#: Threads that probe peers heard of only second hand, apart from the heartbeat threads.
PROBE_THREADS = 4
#: Probes in flight of peers told of by one peer, at most (module docstring).
PROBES_PER_SOURCE_IN_FLIGHT = 2
#: Most entries a heartbeat's peer list may hold; a longer one is refused whole (the server
#: counts it as ``too_large``).
MAX_KNOWN = MAX_PEERS


class PeerListTooLong(ValueError):
    """A heartbeat whose peer list passes :data:`MAX_KNOWN` entries (refused whole)."""


def death_agreed_within(cfg: MembershipSection, n: int) -> float:
    """Seconds after a peer dies by which every table of an ``n``-peer swarm holds it dead.

    Its gossip neighbours heartbeat it every interval: the first unanswered one leaves within
    an interval, ``dead_after`` later the next sweep (at most an interval and a heartbeat
    timeout on) declares it dead. The certificate then moves one hop per interval, and each
    hop confirms it with one heartbeat (a timeout if the dead peer hangs instead of refusing);
    ``ceil(log2 n) + 1`` hops cover the random-regular and exponential graphs, and on a ring
    the far rounds (``log2 n`` random peers each) make up for its diameter of ``n / 2``.
    """
    timeout = max(cfg.heartbeat_interval, 1.0)
    hops = math.ceil(math.log2(max(n, 2))) + 1
    return (
        cfg.dead_after
        + 2 * cfg.heartbeat_interval
        + timeout
        + hops * (cfg.heartbeat_interval + timeout)
    )


class Membership(PeerTable):
    """The peer table of one peer, kept fresh by a background heartbeat thread.

    Args:
        me: this peer's own PeerInfo (its step/round fields are updated by the owner).
        swarm: swarm name; heartbeats from another swarm are refused by the server.
        cfg: the membership section of the config.
        bootstrap: addresses to contact until some peer answers.
        heartbeat: callable(address, peer_id, request, timeout) -> HeartbeatReply (the
            transport; ``peer_id`` is the peer held at ``address``, whose certificate the
            server must hold, or None for a bootstrap address, where any member will do);
            an exception it raises with a true ``refused`` attribute says nothing listens at
            the address, and the peer there is suspect at once (``PeerTable.refused``).
        on_change: called (from the heartbeat thread) when the set of present peers, a
            peer's state or its incarnation changes.
        near: ids of this peer's gossip neighbours among the given live ids (heartbeated every
            interval; the others round-robin, a few per far round).
    """

    def __init__(
        self,
        me: pb.PeerInfo,
        swarm: str,
        cfg: MembershipSection,
        bootstrap: list[str],
        heartbeat: Callable[[str, str | None, pb.HeartbeatRequest, float], pb.HeartbeatReply],
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
        # (address, peer id) of the heartbeats sent and not yet ended, and of those whose
        # last heartbeat went unanswered (under the lock)
        self._in_flight: set[tuple[str, str | None]] = set()
        self._unanswering: set[tuple[str, str | None]] = set()
        self._probe_pool = ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="probe")
        # probes of peers heard of only second hand: in flight (id -> who told of it), ids
        # probed this interval, and this interval's budgets left (all under the lock)
        self._probing: dict[str, str] = {}
        self._probed: set[str] = set()
        self._probes_left = 0
        self._source_left: dict[str, int] = {}
        self._probes_done = threading.Condition(self._lock)
        self._tick = 0
        self._rng = random.Random(me.id)
        # far peers still to heartbeat in this pass, popped from the end (SWIM round-robin)
        self._far_pass: list[str] = []
        # address -> (the view digest that peer last told us, ours when it did)
        self._their_digest: dict[str, tuple[int, int]] = {}
        # neighbours of the last round, and former ones -> when they stopped being one
        self._near_before: set[str] = set()
        self._formerly_near: dict[str, float] = {}

    # ------------------------------------------------------------------ heartbeats

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Server side of Heartbeat: learn the sender and its view, answer with ours.

        Raises PeerListTooLong, taking nothing from it, if its list passes ``MAX_KNOWN``."""
        if len(request.known) > MAX_KNOWN:
            raise PeerListTooLong(
                f"peer list of {len(request.known)} entries exceeds the limit of {MAX_KNOWN}"
            )
        self.merge(own=[request.sender], hearsay=request.known, told_by=request.sender.id)
        digest = self.view_digest()
        known = [] if request.view_digest == digest else self.known_infos()[:MAX_KNOWN]
        return pb.HeartbeatReply(responder=self.me, known=known, view_digest=digest)

    def _forget(self, peer_id: str) -> None:
        address = self._peers[peer_id].info.address
        super()._forget(peer_id)
        self._their_digest.pop(address, None)
        self._unanswering.discard((address, peer_id))

    def _beat(self, address: str, peer_id: str | None = None) -> bool:
        """Heartbeat ``address``; an answer from anyone but ``peer_id`` counts as none.
        Whether it was answered.

        The peer list goes along only where the other view is known to differ from ours as
        it is now. Where that is not known (never asked, or ours changed since it answered)
        the heartbeat goes without one, and only if the answer's digest then differs does a
        second heartbeat carry it: a far peer heartbeated once a pass is not sent the list
        for a view that has long caught up.
        """
        sent_at = time.monotonic()
        digest = self.view_digest()
        with self._lock:
            theirs, ours_then = self._their_digest.get(address, (None, None))
        differs = ours_then == digest and theirs != digest
        reply = self._exchange(address, peer_id, sent_at, digest, with_list=differs)
        if reply is None or differs or self.me.leaving:  # a goodbye needs no list
            return reply is not None
        digest = self.view_digest()
        if reply.view_digest != digest:
            self._exchange(address, peer_id, sent_at, digest, with_list=True)
        return True

    def _exchange(
        self, address: str, peer_id: str | None, sent_at: float, digest: int, *, with_list: bool
    ) -> pb.HeartbeatReply | None:
        """One heartbeat round trip, its answer merged; None if it went unanswered."""
        request = pb.HeartbeatRequest(
            swarm=self.swarm,
            sender=self.me,
            known=self.peer_list() if with_list else [],
            view_digest=digest,
        )
        try:
            reply = self._heartbeat(address, peer_id, request, self.heartbeat_timeout)
        except Exception as err:  # unreachable peers are expected; the sweep handles them
            log.debug("heartbeat to %s failed: %s", address, err)
            with self._lock:
                self._their_digest.pop(address, None)
            if peer_id is not None and getattr(err, "refused", False):
                self.refused(peer_id, sent_at)
            elif peer_id is not None:
                self.unanswered(peer_id, sent_at)
            return None
        # Only the peer dialled at the address held for it speaks for itself; any other
        # answer (someone else lives there now, a bootstrap address) is hearsay.
        itself = peer_id is not None and reply.responder.id == peer_id
        responder = [reply.responder]
        self.merge(
            own=responder if itself else (),
            hearsay=[*reply.known, *responder[: not itself]],
            told_by=peer_id or address,
        )
        with self._lock:
            # their digest, and ours as it stands after the merge (what it was compared to)
            self._their_digest[address] = (reply.view_digest, self.view_digest())
        if peer_id is not None and reply.responder.id != peer_id:
            self.unanswered(peer_id, sent_at)  # someone else lives at that address now
            return None
        return reply

    def peer_list(self) -> list[pb.PeerInfo]:
        """The peer list a heartbeat carries: self and the peers not dead, then the death
        certificates, at most :data:`MAX_PEERS` (the receivers' cap) in all."""
        return [*self.known_infos(), *self.certificates()][:MAX_PEERS]

    @property
    def heartbeat_timeout(self) -> float:
        """Deadline of one heartbeat, seconds."""
        return max(self.cfg.heartbeat_interval, 1.0)

    def far_fanout(self, n: int) -> int:
        """Non-neighbours heartbeated per far round in a swarm of ``n`` present peers."""
        if n < 2:
            return 0
        return max(1, math.ceil(self.cfg.far_fanout * math.log2(n)))

    def _next_far(self, candidates: set[str], count: int) -> list[str]:
        """``count`` far peers, round-robin over a pass shuffled anew each time it runs out."""
        chosen: list[str] = []
        count = min(count, len(candidates))
        while len(chosen) < count:
            if not self._far_pass:
                self._far_pass = sorted(candidates)
                self._rng.shuffle(self._far_pass)
            pid = self._far_pass.pop()
            if pid in candidates and pid not in chosen:
                chosen.append(pid)
        return chosen

    def targets(self) -> list[tuple[str, str | None]]:
        """This round's heartbeats as (address, peer id or None for a bootstrap address)."""
        self._tick += 1
        live = self.live_ids()
        near = self._recently_near(set(self._near(live)))
        far_due = self._tick % self.cfg.far_every == 0
        dead_due = self._tick % 5 == 0
        gone_due = self._tick % GONE_PROBE_EVERY == 0
        every: list[str] = []
        far: set[str] = set()
        with self._lock:
            for pid, r in self._peers.items():
                if r.state == DEAD:
                    # One that left, or whose process is gone, is not coming back as itself.
                    if dead_due and not r.info.leaving and not r.gone:
                        every.append(pid)
                elif r.gone and not r.condemned:  # condemned: one heartbeat confirms the death
                    if gone_due and not r.info.leaving:
                        every.append(pid)
                elif not r.heard_directly:
                    continue  # probed apart: _start_probes
                elif (
                    pid in near
                    or r.info.checking  # starting: it hears at once when this peer is done
                    or r.unanswered_since is not None
                    or r.condemned
                    or r.recheck
                ):
                    every.append(pid)
                else:
                    far.add(pid)
            chosen = self._next_far(far, self.far_fanout(len(live))) if far_due else []
            out = [(self._peers[pid].info.address, pid) for pid in [*every, *chosen]]
            alone = not any(r.state != DEAD for r in self._peers.values())
        if alone:
            out += [(a, None) for a in self.bootstrap]
        return out

    def _recently_near(self, near: set[str]) -> set[str]:
        """``near`` plus the peers that stopped being neighbours less than ``dead_after`` ago.

        A gossip round that began before a rewire (a joiner came between two neighbours) may
        still wait on the neighbour it lost; heartbeated every interval, a crash of that peer
        is seen within an interval, instead of at the next far round or death certificate,
        seconds later, while the round waits out its timeout and the swarm waits on it.
        """
        now = time.monotonic()
        for pid in self._near_before - near:
            self._formerly_near[pid] = now
        self._near_before = near
        self._formerly_near = {
            p: t
            for p, t in self._formerly_near.items()
            if p not in near and now - t < self.cfg.dead_after
        }
        return near | set(self._formerly_near)

    def beat_once(self, wait_probes: bool = True, until: float | None = None) -> None:
        """One heartbeat round (see the module docstring for who is heartbeated), then age
        the table. A death reported in this round's replies is checked at once, not an
        interval later, so a certificate spreads one hop per interval.

        ``wait_probes``: also wait (at most two heartbeat timeouts) for this interval's
        probes of peers heard of only second hand, as a starting peer does that needs them
        (a bootstrap's answer is such word); the heartbeat thread never waits for them.
        ``until``: wait for the answers of targets whose last heartbeat went unanswered only
        until this time (``time.monotonic()``; every other answer is waited for); their
        beats still out go on, and they are skipped until those end (the heartbeat thread's
        rounds). None: wait for every answer, each within its timeout."""
        with self._lock:  # a new interval: new probe budgets
            self._probes_left, self._source_left, self._probed = VERIFY_PER_INTERVAL, {}, set()
        self._start_probes()
        targets = list(dict.fromkeys(self.targets()))
        self._rng.shuffle(targets)
        self._beat_all(targets, until)
        asked = {pid for _, pid in targets}
        with self._lock:
            check = [
                (r.info.address, pid)
                for pid, r in self._peers.items()
                if r.condemned and r.state != DEAD and pid not in asked
            ]
        self._beat_all(check, until)
        if wait_probes:
            with self._lock:
                self._probes_done.wait_for(
                    lambda: not self._probing or self._stop.is_set(), 2 * self.heartbeat_timeout
                )
        self.sweep()

    def _start_probes(self) -> None:
        """Probe peers heard of only second hand, within this interval's budgets (module
        docstring, 4), on the probe threads; each probe that ends starts the next."""
        started = []
        with self._lock:
            in_flight: dict[str, int] = {}
            for source in self._probing.values():
                in_flight[source] = in_flight.get(source, 0) + 1
            waiting = [
                (pid, r)
                for pid, r in self._peers.items()
                if to_probe(r) and pid not in self._probing and pid not in self._probed
            ]
            self._rng.shuffle(waiting)
            for pid, r in waiting:
                if self._probes_left <= 0 or len(self._probing) >= PROBE_THREADS:
                    break
                source = r.told_by
                if (
                    in_flight.get(source, 0) >= PROBES_PER_SOURCE_IN_FLIGHT
                    or self._source_left.get(source, VERIFY_PER_SOURCE) <= 0
                ):
                    continue
                in_flight[source] = in_flight.get(source, 0) + 1
                self._source_left[source] = self._source_left.get(source, VERIFY_PER_SOURCE) - 1
                self._probes_left -= 1
                self._probing[pid] = source
                self._probed.add(pid)
                started.append((r.info.address, pid))
        for address, pid in started:
            try:
                self._probe_pool.submit(self._probe, address, pid)
            except RuntimeError:  # shut down: the process is exiting
                self._probe_ended(pid)

    def _probe(self, address: str, peer_id: str) -> None:
        try:
            self._beat(address, peer_id)
        except Exception:  # one bad probe must not stop the others
            log.exception("probe of %s failed", peer_id)
        finally:
            self._probe_ended(peer_id)
        if not self._stop.is_set():
            self._start_probes()

    def _probe_ended(self, peer_id: str) -> None:
        with self._lock:
            self._probing.pop(peer_id, None)
            self._probes_done.notify_all()

    def _beat_all(self, targets: list[tuple[str, str | None]], until: float | None = None) -> None:
        """Heartbeat ``targets`` on the pool, but none whose last beat is still out. Wait for
        every answer (each within the heartbeat timeout: a loaded swarm's slow answers pace
        the rounds, as backpressure), except from a target whose last heartbeat went
        unanswered: that one only until ``until`` (None: it too). An error a beat raised is
        raised here if it ended in time."""
        with self._lock:
            fresh = [t for t in dict.fromkeys(targets) if t not in self._in_flight]
            self._in_flight.update(fresh)
            unanswering = self._unanswering & set(fresh)
        futures: dict[tuple[str, str | None], Future] = {}
        for target in fresh:
            try:
                future = self._pool.submit(self._beat, *target)
            except RuntimeError:  # shut down: the process is exiting
                self._landed(target, None)
                raise
            future.add_done_callback(lambda f, t=target: self._landed(t, f))
            futures[target] = future
        wait_futures([f for t, f in futures.items() if t not in unanswering])
        timeout = None if until is None else max(0.0, until - time.monotonic())
        wait_futures([futures[t] for t in unanswering], timeout=timeout)
        for future in futures.values():
            if future.done():
                future.result()

    def _landed(self, target: tuple[str, str | None], future: Future | None) -> None:
        answered = (
            future is not None
            and not future.cancelled()
            and future.exception() is None
            and future.result()
        )
        with self._lock:
            self._in_flight.discard(target)
            if answered:
                self._unanswering.discard(target)
            else:
                self._unanswering.add(target)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                started = time.monotonic()
                until = started + self.cfg.heartbeat_interval
                try:
                    self.beat_once(wait_probes=False, until=until)
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

    def wait_for(self, count: int, timeout: float, stop: threading.Event | None = None) -> bool:
        """Block until `count` peers (self included) are present, or timeout, or ``stop``
        is set (a SIGTERM while waiting)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            if stop is not None and stop.is_set():
                break
            if len(self.present_ids()) >= count:
                return True
            time.sleep(0.05)
        return len(self.present_ids()) >= count

    def announce_leaving(self) -> None:
        """Tell every live peer we are leaving (best effort), so they rewire at once."""
        self.me.leaving = True
        with self._lock:
            targets = [(r.info.address, p) for p, r in self._peers.items() if r.state != DEAD]
        # Every one of them, a peer whose heartbeat is out too: that one did not say it.
        for future in [self._pool.submit(self._beat, a, pid) for a, pid in targets]:
            future.result()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._probes_done.notify_all()
