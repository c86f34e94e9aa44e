"""A peer still checking how it can be called (``PeerInfo.checking``) is nobody's neighbour yet.

At start a peer with a bootstrap list has a member dial it back and, if that fails, attaches
to a relay; until then no call can reach it. A reachable peer waiting for ``expected_peers``
that counted it from its first heartbeat would start training, find it silent and train
alone (the NAT'd sites of ``test_natted_sites_train_through_a_relay`` then joined at the end
with its final state). These tests drive one peer table through its heartbeat handler; the
NAT'd run in network namespaces is in tests/experiment/test_experiment_netns.py.
"""

from __future__ import annotations

import time

import pytest
from gossipgrad.peer.config import MembershipSection
from gossipgrad.peer.membership.heartbeats import Membership
from gossipgrad.peer.runtime.joining import find_swarm
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(30)

SWARM = "swarm"


def _membership(dead_after: float = 5.0, changes: list[int] | None = None) -> Membership:
    """A table whose heartbeats all go unanswered (a checking peer could not answer them)."""

    def unanswered(address, peer_id, request, timeout):
        raise ConnectionError(f"no way in to {address}")

    return Membership(
        pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1),
        SWARM,
        MembershipSection(
            heartbeat_interval=0.05, suspect_after=dead_after / 2, dead_after=dead_after
        ),
        [],
        heartbeat=unanswered,
        on_change=lambda: changes.append(1) if changes is not None else None,
    )


def _beat_from(m: Membership, info: pb.PeerInfo, known: list[pb.PeerInfo] = ()) -> None:
    m.handle_heartbeat(pb.HeartbeatRequest(swarm=SWARM, sender=info, known=list(known)))


def _info(pid: str, port: int, checking: bool, **fields) -> pb.PeerInfo:
    return pb.PeerInfo(
        id=pid, address=f"127.0.0.1:{port}", incarnation=7, checking=checking, **fields
    )


def test_a_checking_peer_is_not_counted_until_it_says_it_is_done() -> None:
    """Its heartbeats are taken (its address is what a dial-back dials), ours to it fail
    (nothing can reach it yet) without making it suspect, and it joins the topology with
    the heartbeat that says it is done."""
    changes: list[int] = []
    m = _membership(dead_after=0.4, changes=changes)
    for _ in range(10):  # 0.5 s of our heartbeats to it going unanswered
        _beat_from(m, _info("natted", 2, checking=True))
        m.beat_once(wait_probes=False)
        time.sleep(0.05)
    rec = m.record("natted")
    assert rec.state == "alive" and rec.unanswered_since is None
    assert m.present_ids() == ["me"] and m.live_ids() == ["me"]
    assert not m.wait_for(2, timeout=0.2)
    seen = len(changes)
    _beat_from(m, _info("natted", 2, checking=False, relay="relay", relay_epoch=3))
    assert m.present_ids() == ["me", "natted"] and m.wait_for(2, timeout=0.3)
    assert len(changes) > seen  # the topology is recomputed with it
    assert m.record("natted").info.relay == "relay"


def test_a_failed_probe_of_a_checking_peer_kills_it_nowhere_and_only_its_end_is_taken() -> None:
    """Heard of second hand while it checks, a peer is probed, and probes that cannot
    reach it yet are not held against it (they made peers that could not dial a NAT'd
    site spread its death while it checked); word that its check is over is taken."""
    m = _membership(dead_after=0.4)
    teller = _info("teller", 3, checking=False)
    far = _info("far", 4, checking=True)
    _beat_from(m, teller, known=[far])
    assert m.unverified_ids() == ["far"]
    for _ in range(10):
        _beat_from(m, teller)
        m.beat_once(wait_probes=True)  # the probe of far fails
        time.sleep(0.05)
    assert m.record("far").state == "alive" and m.certificates() == []
    settled = _info("far", 4, checking=False, relay="teller", relay_epoch=9)
    _beat_from(m, teller, known=[settled])
    rec = m.record("far")
    assert not rec.info.checking and rec.info.relay == "teller"
    # Word that a peer checks again is not taken: it would take it out of every topology.
    _beat_from(m, teller, known=[_info("teller", 3, checking=True), _info("far", 4, checking=True)])
    assert not m.record("far").info.checking and "teller" in m.present_ids()


def test_a_peer_silent_while_checking_dies_and_one_known_second_hand_dies_on_word() -> None:
    m = _membership(dead_after=0.3)
    _beat_from(m, _info("crashed", 2, checking=True))
    _beat_from(m, _info("teller", 3, checking=False), known=[_info("far", 4, checking=True)])
    m.sweep()
    assert m.record("crashed").state == "alive" and m.record("far").state == "alive"
    time.sleep(0.4)
    _beat_from(m, _info("teller", 3, checking=False))
    m.sweep()
    assert m.record("crashed").state == "dead"  # no heartbeat of ours to wait for
    assert m.record("far").state == "alive"  # no word of its death, no probe to fail
    far_dead = _info("far", 4, checking=True, leaving=True)
    _beat_from(m, _info("teller", 3, checking=False), known=[far_dead])
    m.sweep()
    assert m.record("far").state == "dead"
    assert m.record("teller").state == "alive"


def test_the_view_digest_changes_when_a_peer_is_done_checking() -> None:
    m = _membership()
    _beat_from(m, _info("natted", 2, checking=True))
    before = m.view_digest()
    _beat_from(m, _info("natted", 2, checking=False))
    assert m.view_digest() != before  # the lists go out again, so the rest hear it


def test_two_peers_checking_at_once_find_each_other_and_stay_alive() -> None:
    """Each the other's bootstrap, both checking (as two sites given one bootstrap list
    start): each finds the swarm (find_swarm counts a checking peer that answered), they
    heartbeat each other while both check, so neither dies of the other's silence, and once
    both are done each is present to the other."""
    cfg = MembershipSection(heartbeat_interval=0.05, suspect_after=0.15, dead_after=0.3)
    tables: dict[str, Membership] = {}

    def wire(me: str):
        def heartbeat(address, peer_id, request, timeout):
            return tables[address].handle_heartbeat(request)

        return heartbeat

    for me, other in (("a", "b"), ("b", "a")):
        info = pb.PeerInfo(id=me, address=me, incarnation=1, checking=True)
        tables[me] = Membership(info, SWARM, cfg, [other], heartbeat=wire(me))
    a, b = tables["a"], tables["b"]
    find_swarm(a, timeout=5)
    find_swarm(b, timeout=5)
    assert a.heard_ids() == ["b"] and b.heard_ids() == ["a"]
    assert a.present_ids() == ["a"] and b.present_ids() == ["b"]  # neither done yet
    for _ in range(12):  # 0.6 s: twice dead_after
        a.beat_once(wait_probes=False)
        b.beat_once(wait_probes=False)
        time.sleep(cfg.heartbeat_interval)
    assert a.record("b").state == "alive" and b.record("a").state == "alive"
    a.me.checking = b.me.checking = False
    a.beat_once(wait_probes=False)
    b.beat_once(wait_probes=False)
    assert a.present_ids() == ["a", "b"] and b.present_ids() == ["a", "b"]
