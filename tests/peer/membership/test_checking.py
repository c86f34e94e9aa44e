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


def test_a_checking_peer_is_not_counted_or_heartbeated_until_it_says_it_is_done() -> None:
    changes: list[int] = []
    m = _membership(changes=changes)
    _beat_from(m, _info("natted", 2, checking=True))
    assert m.record("natted") is not None  # held: its address is what a dial-back dials
    assert m.present_ids() == ["me"] and m.live_ids() == ["me"]
    assert not m.wait_for(2, timeout=0.3)
    assert "natted" not in [pid for _, pid in m.targets()]  # no heartbeat it cannot take
    seen = len(changes)
    _beat_from(m, _info("natted", 2, checking=False, relay="relay", relay_epoch=3))
    assert m.present_ids() == ["me", "natted"] and m.wait_for(2, timeout=0.3)
    assert len(changes) > seen  # the topology is recomputed with it
    assert m.record("natted").info.relay == "relay"


def test_word_of_a_checking_peer_is_not_probed_and_only_its_end_is_taken_second_hand() -> None:
    m = _membership()
    teller = _info("teller", 3, checking=False)
    far = _info("far", 4, checking=True)
    _beat_from(m, teller, known=[far])
    assert m.unverified_ids() == []  # a probe could not reach it yet
    settled = _info("far", 4, checking=False, relay="teller", relay_epoch=9)
    _beat_from(m, teller, known=[settled])
    assert m.unverified_ids() == ["far"]
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
