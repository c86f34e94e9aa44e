"""Membership heartbeats over real gRPC on 127.0.0.1: peer lists travel only where views differ."""

from __future__ import annotations

import threading
import time

import pytest
from gossipgrad.peer.config import MembershipSection
from gossipgrad.peer.membership.peers import PeerTable
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import start_peer, start_peers, wait_until_met

pytestmark = pytest.mark.timeout(60)


def record_requests(peer) -> list[pb.HeartbeatRequest]:
    """Spy on the heartbeats a peer sends (the real transport still carries them)."""
    seen: list[pb.HeartbeatRequest] = []
    lock = threading.Lock()
    send = peer.membership._heartbeat

    def spy(
        address: str, to: str | None, request: pb.HeartbeatRequest, timeout: float
    ) -> pb.HeartbeatReply:
        with lock:
            seen.append(pb.HeartbeatRequest.FromString(request.SerializeToString()))
        return send(address, to, request, timeout)

    peer.membership._heartbeat = spy
    return seen


def test_steady_heartbeats_carry_no_peer_list_and_a_joiner_still_spreads() -> None:
    peers = start_peers(4)
    digests = {p.membership.view_digest() for p in peers}
    deadline = time.monotonic() + 10
    while len(digests) != 1:  # views converge (same members, incarnations, flags)
        assert time.monotonic() < deadline, "views did not converge"
        time.sleep(0.05)
        digests = {p.membership.view_digest() for p in peers}
    (view,) = digests
    seen = record_requests(peers[1])
    time.sleep(1.0)  # ~10 heartbeat intervals
    assert len(seen) >= 10
    assert all(r.view_digest == view for r in seen)
    # At most one list per other peer (whose digest p1 had not heard since the views met),
    # then none at all.
    assert sum(len(r.known) > 0 for r in seen) <= 3
    assert all(len(r.known) == 0 for r in seen[len(seen) // 2 :])

    # Server side: a matching digest gets no list back, an unknown one (0) the whole view.
    client = peers[1].clients.get(peers[2].address)
    me = peers[1].membership.me
    digest = peers[2].membership.view_digest()
    same = client.heartbeat(pb.HeartbeatRequest(swarm="gossipgrad", sender=me,
                                                view_digest=digest))  # fmt: skip
    assert len(same.known) == 0 and same.view_digest == digest
    fresh = client.heartbeat(pb.HeartbeatRequest(swarm="gossipgrad", sender=me))
    assert sorted(i.id for i in fresh.known) == ["p0", "p1", "p2", "p3"]

    # A fifth peer knows only p0: views differ again, lists flow, all five meet.
    peers.append(start_peer("p4", [peers[0].address], 104))
    wait_until_met(peers)
    deadline = time.monotonic() + 10
    while len({p.membership.view_digest() for p in peers}) != 1:
        assert time.monotonic() < deadline, "views did not converge after the join"
        time.sleep(0.05)


def table_knowing_b(
    suspect_after: float, dead_after: float
) -> tuple[PeerTable, pb.PeerInfo, list[dict[str, int]]]:
    """A peer table ("me") that has heard from peer "b" directly; the counts at each change
    it reports to its owner."""
    seen: list[dict[str, int]] = []
    table = PeerTable(
        pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1),
        MembershipSection(
            heartbeat_interval=0.1, suspect_after=suspect_after, dead_after=dead_after
        ),
        on_change=lambda: seen.append(table.counts()),
    )
    other = pb.PeerInfo(id="b", address="127.0.0.1:2", incarnation=1)
    table.observe(other, direct=True)
    return table, other, seen


def test_every_state_change_reaches_the_owner_so_the_peers_gauge_never_goes_stale() -> None:
    """alive -> suspect -> alive are changes of the counts too: the owner (which sets the
    gossipgrad_peers{state} gauge) is told of each, not only of joins and deaths."""
    table, other, seen = table_knowing_b(suspect_after=0.2, dead_after=5.0)
    table.unanswered("b", time.monotonic() - 1.0)  # silent for 1 s > suspect_after
    table.sweep()
    assert seen[-1]["suspect"] == 1 and seen[-1]["alive"] == 1, seen
    table.observe(other, direct=True)  # it answers again
    assert seen[-1]["suspect"] == 0 and seen[-1]["alive"] == 2, seen


def crash(peer) -> None:
    """Stop a peer as SIGKILL would, seen from outside: no goodbye, its port refuses."""
    peer.membership.stop()
    peer.server.stop(grace=0)


def test_a_crashed_peer_is_suspect_at_the_first_refused_heartbeat() -> None:
    """Nothing listening at a peer's address is a definite answer: the peers that heartbeat
    it hold it suspect (left out of mixing, bridged over) within an interval or two, not after
    ``suspect_after``; it is dead only after ``dead_after``."""
    slow = {"membership.suspect_after": 8.0, "membership.dead_after": 20.0}
    peers = start_peers(3, slow)
    crash(peers[2])
    t0 = time.monotonic()
    while any(p.membership.is_alive("p2") for p in peers[:2]):
        assert time.monotonic() - t0 < 2.0, "p2 still alive 2 s after its port closed"
        time.sleep(0.02)
    for p in peers[:2]:
        assert p.membership.record("p2").state == "suspect"
        assert "p2" in p.membership.present_ids()  # not dead: only dead_after says so
        assert p.neighbourhood.ids() == ["p0", "p1"]  # the live ones mix without it


def test_a_refused_push_makes_its_receiver_suspect_before_any_heartbeat() -> None:
    """The push path tells membership too: a peer whose heartbeats are far apart learns of a
    crashed neighbour from its first refused push."""
    from gossipgrad.peer.network import TransportError
    from gossipgrad.peer.runtime.node import AddressedSender

    rare = {
        "membership.heartbeat_interval": 5.0,
        "membership.suspect_after": 10.0,
        "membership.dead_after": 30.0,
    }
    peers = start_peers(2, rare)
    crash(peers[1])
    sender = AddressedSender(peers[0].membership, peers[0].clients, peers[0].options)
    header = peers[0].neighbourhood.header("p1", pb.DELTA, b"x")
    t0 = time.monotonic()
    with pytest.raises(TransportError) as info:
        sender.push("p1", header, b"x")
    assert info.value.refused and time.monotonic() - t0 < 2.0
    assert peers[0].membership.record("p1").state == "suspect"


def test_a_refusal_for_a_peer_that_answers_again_is_forgotten() -> None:
    table, other, changes = table_knowing_b(suspect_after=5.0, dead_after=10.0)
    table.refused("b", time.monotonic())
    assert table.record("b").state == "suspect" and changes[-1]["suspect"] == 1
    table.sweep()  # well within dead_after: still suspect
    assert table.record("b").state == "suspect"
    assert table.gone_addresses() == {other.address}
    table.observe(other, direct=True)  # it answers
    assert table.record("b").state == "alive" and table.record("b").unanswered_since is None
    assert table.gone_addresses() == set()
    table.refused("nobody", time.monotonic())  # unknown ids are ignored
    assert "nobody" not in table.present_ids()


def test_a_second_goodbye_neither_revives_the_peer_nor_reports_a_change(caplog) -> None:
    """A leaving peer may say goodbye more than once (its heartbeat loop and its farewell
    round both carry ``leaving``). The first makes it dead here; a later one is news of
    nothing: no "is back" in the log, no state read as alive, no change reported to the
    owner (each change makes it rewire and prune). The same for a goodbye that comes after
    the peer was already dead by silence."""
    import logging

    table, other, changes = table_knowing_b(suspect_after=5.0, dead_after=10.0)
    goodbye = pb.PeerInfo()
    goodbye.CopyFrom(other)
    goodbye.leaving = True
    with caplog.at_level(logging.INFO, logger="gossipgrad.peer.membership.peers"):
        table.observe(goodbye, direct=True)
        assert table.record("b").state == "dead" and changes[-1]["dead"] == 1
        reported = len(changes)
        table.observe(goodbye, direct=True)
        table.sweep()
    assert table.record("b").state == "dead"
    assert len(changes) == reported, changes[reported:]
    assert not [r for r in caplog.records if "is back" in r.getMessage()]

    silent, other, changes = table_knowing_b(suspect_after=0.2, dead_after=0.5)
    silent.unanswered("b", time.monotonic() - 1.0)
    silent.sweep()
    assert silent.record("b").state == "dead"
    reported = len(changes)
    with caplog.at_level(logging.INFO, logger="gossipgrad.peer.membership.peers"):
        silent.observe(goodbye, direct=True)  # a late goodbye from a stalled process
    assert silent.record("b").state == "dead" and len(changes) == reported
    assert silent.record("b").info.leaving  # no more probes for a return
    assert not [r for r in caplog.records if "is back" in r.getMessage()]


def record_probes(peer, address: str) -> list[float]:
    """Times of every heartbeat ``peer`` sends to ``address`` from now on (filled as they go)."""
    probes: list[float] = []
    send = peer.membership._heartbeat

    def spy(
        to: str, peer_id: str | None, request: pb.HeartbeatRequest, timeout: float
    ) -> pb.HeartbeatReply:
        if to == address:
            probes.append(time.monotonic())
        return send(to, peer_id, request, timeout)

    peer.membership._heartbeat = spy
    return probes


def channel_kept(peer, address: str, seconds: float) -> list[bool]:
    """Whether ``peer``'s pool holds a client to ``address``, sampled every 0.05 s."""
    held, t0 = [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        held.append(address in peer.clients.addresses())
        time.sleep(0.05)
    return held


FAST_DEATH = {
    "membership.heartbeat_interval": 0.1,
    "membership.suspect_after": 0.3,
    "membership.dead_after": 0.6,
}


def wait_dead(peer, pid: str, timeout: float = 10.0) -> float:
    """Wait until ``peer`` holds ``pid`` dead; when it did (monotonic)."""
    deadline = time.monotonic() + timeout
    while peer.membership.record(pid).state != "dead":
        assert time.monotonic() < deadline, f"{pid} not dead {timeout} s after its crash"
        time.sleep(0.02)
    return time.monotonic()


def test_a_crashed_peer_held_dead_is_probed_no_more_and_its_restart_still_returns() -> None:
    """Nothing listens at a crashed peer's address, and only a new process can answer there,
    which announces itself: so once it is dead it is not probed at all (probing it every 5th
    or 10th interval until it was forgotten cost every survivor of a churn run 1.6 refused
    probes a second, each on a channel of its own). The restarted peer is alive again all the
    same, from its own heartbeats."""
    p0, p1 = start_peers(2, FAST_DEATH)
    dead_address = p1.membership.me.address
    probes = record_probes(p0, dead_address)
    crash(p1)
    dead_at = wait_dead(p0, "p1")
    held = channel_kept(p0, dead_address, 3.0)  # 30 intervals: 3 to 6 probes before
    late = [t for t in probes if t > dead_at + 0.05]  # one in flight at the death may land
    assert not late, f"{len(late)} probes of a crashed peer held dead"
    assert not any(held), f"a client to the dead address was kept in {sum(held)} of {len(held)}"

    back = start_peer("p1", [p0.address], 101, FAST_DEATH)
    deadline = time.monotonic() + 10.0
    while not p0.membership.is_alive("p1"):
        assert time.monotonic() < deadline, "the restarted p1 is not alive at p0 after 10 s"
        time.sleep(0.02)
    assert p0.membership.record("p1").info.address == back.membership.me.address


def test_a_crash_told_by_a_certificate_is_probed_no_more_once_confirmed() -> None:
    """Most peers learn of a crash from a death certificate; one refused heartbeat confirms
    it, and from then on the crashed peer is not probed either (it was, every 5th interval,
    until forgotten)."""
    from gossipgrad.peer.membership.heartbeats import Membership

    cfg = MembershipSection(heartbeat_interval=0.1, suspect_after=0.5, dead_after=1.0, far_every=9)
    m = Membership(
        pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1),
        "swarm",
        cfg,
        [],
        heartbeat=lambda address, peer, request, timeout: pb.HeartbeatReply(),
    )
    b = pb.PeerInfo(id="b", address="127.0.0.1:2", incarnation=1)
    m.observe(b, direct=True)
    certificate = pb.PeerInfo()
    certificate.CopyFrom(b)
    certificate.leaving = True
    m.observe(certificate, direct=False)
    assert "b" in {pid for _, pid in m.targets()}  # condemned: heartbeated to confirm
    m.refused("b", time.monotonic())  # the confirming heartbeat found nothing listening
    m.sweep()
    assert m.record("b").state == "dead"
    probed = [tick for tick in range(20) if "b" in {pid for _, pid in m.targets()}]
    assert probed == [], f"probed at ticks {probed}"


def test_a_peer_dead_by_silence_is_still_probed_without_leaving_a_channel_behind() -> None:
    """A peer that stopped answering without refusing (a hung process, a partition) may come
    back as itself: held dead, it is still heartbeated every 5th interval, but on a client of
    its own, closed at once: a channel kept to an address that does not answer reconnects in
    the background, on every peer, for as long as it stays open."""
    # dead_after 1.5: held dead (not forgotten) for 9 s; a probe waits out its 1-s timeout.
    p0, p1 = start_peers(2, {**FAST_DEATH, "membership.dead_after": 1.5})
    address = p1.membership.me.address
    released = threading.Event()
    p1.membership.stop()  # it says nothing more, and its server answers no heartbeat:

    def hang(request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        released.wait(10.0)
        raise RuntimeError("hung")

    p1.membership.handle_heartbeat = hang
    try:
        probes = record_probes(p0, address)
        dead_at = wait_dead(p0, "p1")
        held = channel_kept(p0, address, 4.0)
        assert p0.membership.record("p1").state == "dead"
        assert not p0.membership.record("p1").gone
        assert len([t for t in probes if t > dead_at]) >= 2, "a silent dead peer is not probed"
        assert not any(held), f"a client to the dead address was kept in {sum(held)} of {len(held)}"
    finally:
        released.set()


def test_a_refused_peer_leaves_no_channel_behind_while_it_is_only_suspect() -> None:
    """A crashed neighbour is suspect at the first refused call and dead only ``dead_after``
    later; meanwhile it is still probed, but the channel whose call was refused is closed at
    once and each probe goes on one of its own: kept, it reconnected in the background a dozen
    times per crash, on every peer that had called the dead address. And it is probed every
    ``GONE_PROBE_EVERY``-th interval, not every one: nothing listens at its address, and every
    survivor of a churn run paid two refused probes a second for the crashed peers."""
    from gossipgrad.peer.membership.heartbeats import GONE_PROBE_EVERY

    slow = {
        "membership.heartbeat_interval": 0.1,
        "membership.suspect_after": 3.0,
        "membership.dead_after": 4.0,
    }
    p0, p1 = start_peers(2, slow)
    gone = p1.membership.me.address
    t0 = time.monotonic()
    while gone not in p0.clients.addresses():  # p0 heartbeats its neighbour on a kept channel
        assert time.monotonic() - t0 < 2.0, "p0 holds no channel to p1"
        time.sleep(0.02)
    probes = record_probes(p0, gone)
    crash(p1)
    t0 = time.monotonic()
    while p0.membership.is_alive("p1"):
        assert time.monotonic() - t0 < 2.0, "p1 still alive 2 s after its port closed"
        time.sleep(0.02)
    suspect_at = time.monotonic()
    held = channel_kept(p0, gone, 2.0)  # well before dead_after
    assert p0.membership.record("p1").state == "suspect"
    # 20 intervals: 2 probes (3 at a boundary) where every interval sent 20.
    probed = len([t for t in probes if t > suspect_at])
    assert 1 <= probed <= 20 // GONE_PROBE_EVERY + 1, probed
    assert not any(held), f"a client to the refusing address was kept in {sum(held)} of {len(held)}"


def test_a_former_neighbour_is_heartbeated_every_interval_for_dead_after() -> None:
    """A round that began before a rewire may still wait on the neighbour it lost (a joiner
    came between them): that peer is heartbeated every interval for ``dead_after`` more, so
    a crash of it is seen within an interval (refused, suspect, the round stops waiting)
    rather than at the next far round or death certificate, seconds later (a 10-s global
    stall in a churn run: the round waited out its ``round_timeout``)."""
    from gossipgrad.peer.membership.heartbeats import Membership

    cfg = MembershipSection(heartbeat_interval=0.1, suspect_after=0.5, dead_after=1.0, far_every=9)
    near = {"b"}
    m = Membership(
        pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1),
        "swarm",
        cfg,
        [],
        heartbeat=lambda address, peer, request, timeout: pb.HeartbeatReply(),
        near=lambda ids: near & set(ids),
    )
    for pid, port in (("b", 2), ("c", 3), ("d", 4)):
        m.observe(pb.PeerInfo(id=pid, address=f"127.0.0.1:{port}", incarnation=1), direct=True)

    def targets() -> set[str | None]:
        return {pid for _, pid in m.targets()}

    try:
        assert targets() == {"b"}  # tick 1 (far rounds only every 9th)
        near.clear()
        near.add("c")  # rewired: b is no longer a neighbour
        for _ in range(6):
            assert targets() == {"b", "c"}
        time.sleep(1.05)  # dead_after later
        assert targets() == {"c"}
    finally:
        m.stop()
