"""Probes of peers heard of only second hand cannot slow the heartbeats (issue 40).

A member can tell a peer of ids it made up, at an address that takes connections and never
answers. Each such id is probed (``heartbeats.py``): the probe waits out a whole heartbeat
timeout. The probes ran in the heartbeat round, 32 per interval on its 8 threads, and the
round waited for them, so the next heartbeat to every neighbour came seconds late. Now they
run on threads of their own that the round never waits for, at most two at a time per peer
that told of them. Real peers and gRPC on 127.0.0.1; the silent address is a real listening
socket that accepts and never answers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from gossipgrad.peer.config import MembershipSection
from gossipgrad.peer.membership.heartbeats import PROBES_PER_SOURCE_IN_FLIGHT, Membership
from gossipgrad.peer.network import PeerClient, TransportOptions
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import start_peers

pytestmark = pytest.mark.timeout(90)

GHOSTS = 64
WATCH_S = 4.0


@contextlib.contextmanager
def silent_listener() -> Iterator[tuple[str, list[socket.socket]]]:
    """``host:port`` of a socket that accepts every connection and never sends a byte; the
    connections it took."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    taken: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                taken.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}", taken
    finally:
        stop.set()
        thread.join(5)
        for conn in taken:
            conn.close()
        server.close()


def sent_heartbeats(peer: Peer) -> float:
    """Heartbeats ``peer`` sent that were answered (here: those to its one neighbour)."""
    value = peer.metrics.registry.get_sample_value("gossipgrad_sent_heartbeats_total")
    return value or 0.0


def watch_heartbeats(peer: Peer) -> tuple[list[float], int]:
    """For WATCH_S seconds, the gaps between ``peer``'s answered heartbeats (the last one
    to the end of the watch included) and how many there were."""
    gaps, count, last, t_last = [], 0, sent_heartbeats(peer), time.monotonic()
    end = t_last + WATCH_S
    while time.monotonic() < end:
        time.sleep(0.01)
        now, value = time.monotonic(), sent_heartbeats(peer)
        if value != last:
            gaps.append(now - t_last)
            count += int(value - last)
            last, t_last = value, now
    gaps.append(time.monotonic() - t_last)
    return gaps, count


def test_probes_of_made_up_ids_never_delay_a_heartbeat_to_a_neighbour() -> None:
    p0, p1 = start_peers(2)  # heartbeats every 0.1 s, a heartbeat timeout of 1 s
    timeout = p0.membership.heartbeat_timeout
    with silent_listener() as (nowhere, taken):
        ghosts = [
            pb.PeerInfo(id=f"ghost-{k}", address=nowhere, incarnation=time.time_ns())
            for k in range(GHOSTS)
        ]
        liar = pb.PeerInfo(id="liar", address="127.0.0.1:9", incarnation=1)  # nothing there
        with PeerClient(p0.address, TransportOptions(retries=0)) as client:
            client.heartbeat(
                pb.HeartbeatRequest(swarm=p0.cfg.peer.swarm, sender=liar, known=ghosts)
            )
        assert len(p0.membership.unverified_ids()) == GHOSTS
        # Watch p0's answered heartbeats (all to p1) while it probes the ghosts.
        gaps, count = watch_heartbeats(p0)
        probes = len(taken)
    print(f"heartbeats to p1 in {WATCH_S:.0f} s: {count}, longest gap {max(gaps):.2f} s, "
          f"connections to the silent address: {probes}")  # fmt: skip
    assert probes >= 2, "the ghosts were never probed"
    # The heartbeats to p1 go on at the interval (0.1 s), not once per probe batch.
    assert max(gaps) < timeout, gaps
    assert count >= WATCH_S / (4 * p0.cfg.membership.heartbeat_interval), count
    assert p1.id in p0.membership.live_ids()


class SilentGhosts:
    """A heartbeat transport where ids starting with ``ghost`` never answer (each call waits
    out its timeout) and every other peer answers as itself; counts the ghost calls in
    flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = self.ghost_calls = 0

    def __call__(self, address, peer_id, request, timeout) -> pb.HeartbeatReply:
        if not (peer_id or "").startswith("ghost"):
            return pb.HeartbeatReply(
                responder=pb.PeerInfo(id=peer_id, address=address, incarnation=1)
            )
        with self.lock:
            self.ghost_calls += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(timeout)
            raise TimeoutError("no answer")
        finally:
            with self.lock:
                self.in_flight -= 1


def told(m: Membership, sender: str, ids: list[str]) -> None:
    """``sender`` heartbeats ``m``, telling it of ``ids``."""
    known = [pb.PeerInfo(id=i, address=f"127.0.0.1:{20000 + k}", incarnation=1)
             for k, i in enumerate(ids)]  # fmt: skip
    me = pb.PeerInfo(id=sender, address=f"127.0.0.1:{19000 + len(sender)}", incarnation=1)
    m.handle_heartbeat(pb.HeartbeatRequest(swarm="swarm", sender=me, known=known))


def test_one_members_made_up_ids_hold_two_probe_threads_and_leave_the_rest() -> None:
    """The probe budget by teller: ids one member told of are probed at most two at a time,
    the heartbeat round does not wait for them, and ids an honest peer told of meanwhile are
    verified within an interval or two, not after the made-up ones."""
    transport = SilentGhosts()
    cfg = MembershipSection(heartbeat_interval=0.1, suspect_after=5.0, dead_after=10.0)
    me = pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1)
    m = Membership(me, "swarm", cfg, [], heartbeat=transport)
    try:
        told(m, "liar", [f"ghost-{k}" for k in range(GHOSTS)])
        told(m, "friend", [f"honest-{k}" for k in range(8)])
        t0 = time.monotonic()
        m.beat_once(wait_probes=False)
        round_s = time.monotonic() - t0
        deadline = t0 + 2 * m.heartbeat_timeout
        while set(m.unverified_ids()) & {f"honest-{k}" for k in range(8)}:
            assert time.monotonic() < deadline, m.unverified_ids()
            time.sleep(0.01)
            if time.monotonic() - t0 > cfg.heartbeat_interval:
                m.beat_once(wait_probes=False)  # as the heartbeat thread does each interval
        verified_s = time.monotonic() - t0
    finally:
        m.stop()
    print(
        f"round {round_s:.3f} s, honest ids verified after {verified_s:.3f} s, ghost probes "
        f"{transport.ghost_calls}, at most {transport.most_in_flight} at once"
    )
    assert round_s < cfg.heartbeat_interval, round_s
    assert verified_s < m.heartbeat_timeout, verified_s
    assert 1 <= transport.most_in_flight <= PROBES_PER_SOURCE_IN_FLIGHT


def test_a_member_that_never_answers_does_not_slow_the_heartbeats_to_the_others() -> None:
    """A member heartbeats p0 as itself (so it is present, a neighbour) from an address
    that takes connections and never answers. p0's heartbeat to it waits out a whole
    heartbeat timeout; the rounds waited for it, so every other neighbour was heartbeated
    once per timeout (1 s) instead of once per interval (0.1 s). Now, once a heartbeat to
    it went unanswered, the rounds wait for it only until the interval is over, and its
    beat stays out on its own."""
    p0, p1 = start_peers(2)
    timeout, interval = p0.membership.heartbeat_timeout, p0.cfg.membership.heartbeat_interval
    stop = threading.Event()
    with silent_listener() as (nowhere, taken):
        member = pb.PeerInfo(id="silent", address=nowhere, incarnation=time.time_ns())

        def keep_present() -> None:
            with PeerClient(p0.address, TransportOptions(retries=0)) as client:
                while not stop.is_set():
                    request = pb.HeartbeatRequest(swarm=p0.cfg.peer.swarm, sender=member)
                    client.heartbeat(request)
                    stop.wait(interval)

        thread = threading.Thread(target=keep_present, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 5
            while "silent" not in p0.membership.present_ids() or not taken:
                assert time.monotonic() < deadline, "p0 never heartbeated the member"
                time.sleep(0.02)
            # The first heartbeat to it is waited for (a slow answer paces the rounds);
            # once it went unanswered, the rounds wait for it only until the interval ends.
            time.sleep(timeout + interval)
            gaps, count = watch_heartbeats(p0)
            present = "silent" in p0.membership.present_ids()
        finally:
            stop.set()
            thread.join(5)
    print(f"answered heartbeats in {WATCH_S:.0f} s: {count}, longest gap {max(gaps):.2f} s")
    assert present  # it kept itself in p0's table all along, never answering
    assert max(gaps) < timeout, gaps
    assert count >= WATCH_S / (4 * interval), count
    assert p1.id in p0.membership.live_ids()
