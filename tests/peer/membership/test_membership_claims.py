"""What one member may say about another: hearsay adds peers to probe, never kills or moves one.

A peer's departure, incarnation and address count only when that peer says so itself: on a
heartbeat it sends (under mutual TLS the transport checks the sender against its
certificate) or in its answer to a heartbeat sent to the address this peer holds for it.
Another member's peer list (``known``) and an answer naming someone else may only add a peer
to probe; a departure told second hand is checked with a heartbeat of this peer's own.
Real gRPC servers on 127.0.0.1 with real swarm certificates.
"""

from __future__ import annotations

import time

import grpc
import pytest
from gossipgrad.peer.config import MembershipSection
from gossipgrad.peer.membership.heartbeats import MAX_KNOWN, Membership
from gossipgrad.peer.network import GossipServer, PeerClient, TransportError, TransportOptions
from gossipgrad.peer.security import TransportSecurity, write_swarm_certs
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import rejected, run_rounds, start_peer, wait_until_met

pytestmark = pytest.mark.timeout(90)

FAST = TransportOptions(retries=0, heartbeat_timeout=5.0)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return write_swarm_certs(tmp_path_factory.mktemp("certs"), ["p0", "p1", "p2", "evil"])


def tls_peer(pid: str, certs, bootstrap: list[str], seed: int, **extra):
    overrides = {
        "security.ca": str(certs.ca),
        "security.cert": str(certs.certs[pid]),
        "security.key": str(certs.keys[pid]),
        "membership.suspect_after": 0.5,
        "membership.dead_after": 1.0,
        **extra,
    }
    return start_peer(pid, bootstrap, seed, overrides, widths=(8, 4, 2))


def tls_swarm(certs, n: int = 3):
    peers = []
    for i in range(n):
        bootstrap = [peers[0].address] if peers else []
        peers.append(tls_peer(f"p{i}", certs, bootstrap, 300 + i))
    wait_until_met(peers)
    return peers


def evil_client(certs, address: str) -> PeerClient:
    sec = TransportSecurity.from_files(certs.ca, certs.certs["evil"], certs.keys["evil"])
    return PeerClient(address, FAST, security=sec)


def evil_info() -> pb.PeerInfo:
    return pb.PeerInfo(id="evil", address="127.0.0.1:9", incarnation=1)


def hold_for(seconds: float, check) -> None:
    """Assert ``check()`` holds every 20 ms for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        check()
        time.sleep(0.02)


def test_a_forged_departure_in_a_peer_list_evicts_no_one(certs) -> None:
    """Finding 1: "p1 left, at a higher incarnation than its own" told by another member
    made p1 dead at once, and p1's own heartbeats were ignored until the record was
    forgotten. Now p1 stays alive at the incarnation it gave itself."""
    p0, p1, _p2 = tls_swarm(certs)
    own = p1.membership.me.incarnation
    forged = [
        pb.PeerInfo(id="p1", address=p1.address, incarnation=own + 10**12, leaving=True),
        pb.PeerInfo(id="p1", address=p1.address, incarnation=own, leaving=True),
        pb.PeerInfo(id="p2", address="127.0.0.1:9", incarnation=own + 10**12),  # moved
    ]
    with evil_client(certs, p0.address) as evil:
        evil.heartbeat(pb.HeartbeatRequest(swarm="gossipgrad", sender=evil_info(), known=forged))

    def intact() -> None:
        rec = p0.membership.record("p1")
        assert rec.state == "alive" and not rec.info.leaving, rec
        assert rec.info.incarnation == own
        moved = p0.membership.record("p2")
        assert moved.info.address == _p2.address and moved.state == "alive"
        assert moved.info.incarnation == _p2.membership.me.incarnation

    hold_for(3.0, intact)  # three dead_after periods
    assert "p1" in p0.membership.live_ids()


def test_an_answer_in_another_peers_name_is_hearsay() -> None:
    """A heartbeat answered by someone other than the peer dialled (or by a bootstrap
    address) is taken as that peer's word about others: it cannot kill, move or restart a
    peer this table holds."""
    cfg = MembershipSection(heartbeat_interval=0.1, suspect_after=0.5, dead_after=1.0)
    b = pb.PeerInfo(id="b", address="127.0.0.1:2", incarnation=5)
    liar = pb.PeerInfo(id="b", address="127.0.0.1:3", incarnation=50, leaving=True)

    def answer(
        address: str, _peer: str | None, request: pb.HeartbeatRequest, timeout: float
    ) -> pb.HeartbeatReply:
        if address == b.address:
            return pb.HeartbeatReply(responder=b)
        return pb.HeartbeatReply(responder=liar)

    m = Membership(
        pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1),
        "swarm",
        cfg,
        ["127.0.0.1:4"],
        heartbeat=answer,
    )
    m.observe(b, direct=True)
    m.observe(pb.PeerInfo(id="c", address="127.0.0.1:3", incarnation=1), direct=True)
    m._beat("127.0.0.1:3", "c")  # c's address answers as b
    m._beat("127.0.0.1:4", None)  # so does a bootstrap address
    m.sweep()
    rec = m.record("b")
    assert rec.state == "alive" and rec.info.address == b.address and rec.info.incarnation == 5


def test_a_restart_with_a_lower_incarnation_is_taken_from_the_peer_itself(
    certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clock skew: a site whose clock is behind restarts with a lower incarnation than its
    last life. Its own heartbeats bring it back at once, not after the old record is
    forgotten (6 dead_after periods)."""
    import gossipgrad.peer.runtime.node as node

    p0, p1, p2 = tls_swarm(certs)
    old = p1.membership.me.incarnation
    p1.close()
    deadline = time.monotonic() + 5
    while p0.membership.is_alive("p1"):
        assert time.monotonic() < deadline, "p1's goodbye did not reach p0"
        time.sleep(0.02)
    behind = old - 3600 * 10**9  # an hour behind
    monkeypatch.setattr(node.time, "time_ns", lambda: behind)
    again = tls_peer("p1", certs, [p0.address], 301)
    monkeypatch.undo()
    assert again.membership.me.incarnation == behind
    deadline = time.monotonic() + 3.0  # well inside FORGET_DEAD_AFTER * dead_after = 6 s
    for p in (p0, p2):
        while not p.membership.is_alive("p1"):
            assert time.monotonic() < deadline, f"{p.id} did not take p1's restart"
            time.sleep(0.02)
        rec = p.membership.record("p1")
        assert rec.info.incarnation == behind and rec.info.address == again.address


def test_hearsay_cannot_raise_an_incarnation_so_the_peers_own_word_still_counts(certs) -> None:
    """A forged higher incarnation, had it been taken, would make the peer's own heartbeats
    look stale. Taken only as a reason to probe, it changes nothing the peer said."""
    p0, p1, _p2 = tls_swarm(certs)
    own = p1.membership.me.incarnation
    forged = pb.PeerInfo(id="p1", address=p1.address, incarnation=own + 1)
    with evil_client(certs, p0.address) as evil:
        reply = evil.heartbeat(
            pb.HeartbeatRequest(swarm="gossipgrad", sender=evil_info(), known=[forged])
        )
    assert [i.incarnation for i in reply.known if i.id == "p1"] == [own]
    hold_for(1.0, lambda: _same(p0.membership.record("p1").info.incarnation, own))


def _same(got: int, want: int) -> None:
    assert got == want, (got, want)


def test_a_peer_list_past_the_cap_is_refused_and_counted(certs) -> None:
    """Finding 3: a list of any length was merged entry by entry. Past ``MAX_KNOWN``
    entries the heartbeat is refused (``too_large``), counted, and nothing in it is taken."""
    p0, _p1, _p2 = tls_swarm(certs)
    flood = [
        pb.PeerInfo(id=f"ghost-{i}", address=f"127.0.0.1:{10000 + i % 50000}", incarnation=1)
        for i in range(MAX_KNOWN + 1)
    ]
    before = rejected(p0, "too_large")
    with evil_client(certs, p0.address) as evil, pytest.raises(TransportError) as err:
        evil.heartbeat(pb.HeartbeatRequest(swarm="gossipgrad", sender=evil_info(), known=flood))
    assert err.value.reason == "too_large"
    assert rejected(p0, "too_large") == before + 1
    assert p0.membership.record("ghost-0") is None


def test_a_long_peer_list_reports_one_change_not_one_per_entry() -> None:
    """Merging a list costs one change report (the owner's O(n) rewire), not one per new
    entry: 500 new peers made 500 rewires of the whole table."""
    changes: list[int] = []
    cfg = MembershipSection(heartbeat_interval=0.1, suspect_after=0.5, dead_after=1.0)
    m = Membership(
        pb.PeerInfo(id="me", address="127.0.0.1:1", incarnation=1),
        "swarm",
        cfg,
        [],
        heartbeat=lambda a, p, r, t: pb.HeartbeatReply(),
        on_change=lambda: changes.append(1),
    )
    known = [pb.PeerInfo(id=f"q{i}", address=f"127.0.0.1:{2000 + i}", incarnation=1)
             for i in range(500)]  # fmt: skip
    sender = pb.PeerInfo(id="s", address="127.0.0.1:1999", incarnation=1)
    m.handle_heartbeat(pb.HeartbeatRequest(swarm="swarm", sender=sender, known=known))
    # The sender spoke for itself; the 500 are its word only: held, to probe.
    assert m.present_ids() == ["me", "s"] and len(m.unverified_ids()) == 500
    assert len(changes) == 1, len(changes)


class Impersonator:
    """A hostile member's gossip handler: answers every heartbeat as ``as_whom`` and takes
    every push, counting each call that reaches it."""

    def __init__(self) -> None:
        self.as_whom = pb.PeerInfo()
        self.calls = 0

    def handle_update(self, header, payload, context_peer: str = "") -> pb.PushReply:
        self.calls += 1
        return pb.PushReply()

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.calls += 1
        return pb.HeartbeatReply(responder=self.as_whom)

    def handle_state_request(self, request: pb.StateRequest):
        self.calls += 1
        raise TransportError(grpc.StatusCode.UNAVAILABLE, "", "no state")


def test_a_member_cannot_answer_for_a_dead_peer_or_an_invented_one_at_its_own_address(
    certs,
) -> None:
    """Finding 2: a client checked only that a server held *a* swarm certificate, so evil
    could take over dead p2's id at evil's own address (or invent one, p9): told of "p2 at
    evil's address" second hand, p0 probed it there, evil answered as p2, and p0 took that
    as p2's own word and mixed with it. Now p0 dials p2 asking for p2's certificate: the
    handshake fails, nothing reaches evil, p0 counts it (``unauthenticated``), and p2 and
    p9 die at p0 while p0 and p1 go on gossiping."""
    p0, p1, p2 = tls_swarm(certs)
    p2.close()
    deadline = time.monotonic() + 5
    while p0.membership.is_alive("p2"):
        assert time.monotonic() < deadline, "p2's goodbye did not reach p0"
        time.sleep(0.02)
    handler = Impersonator()
    evil_sec = TransportSecurity.from_files(certs.ca, certs.certs["evil"], certs.keys["evil"])
    server = GossipServer(handler, security=evil_sec)
    server.start()
    try:
        now = time.time_ns()
        claims = [
            pb.PeerInfo(id=pid, address=server.address, incarnation=now) for pid in ("p2", "p9")
        ]
        handler.as_whom = claims[0]
        before = rejected(p0, "unauthenticated")
        with evil_client(certs, p0.address) as evil:
            evil.heartbeat(  # evil itself lives elsewhere (evil_info): p0 never dials it here
                pb.HeartbeatRequest(swarm="gossipgrad", sender=evil_info(), known=claims)
            )

        def never_taken() -> None:
            assert handler.calls == 0, "a call meant for p2 or p9 reached evil"
            for pid in ("p2", "p9"):
                rec = p0.membership.record(pid)
                assert rec is None or not rec.heard_directly, rec
            assert p0.membership.is_alive("p1") and p1.membership.is_alive("p0")

        hold_for(3.0, never_taken)  # three dead_after periods
        assert rejected(p0, "unauthenticated") > before
        assert not {"p2", "p9"} & set(p0.membership.live_ids())
        stats = run_rounds([p0, p1], 3)  # the honest pair still gossips
        assert {"p0", "p1"} <= {pid for s in stats for pid in s.mixed}, stats
    finally:
        server.stop(grace=0)


def test_ids_a_member_makes_up_take_no_neighbour_slot_and_go_no_further(certs) -> None:
    """Issue 40: ids a member invents, told second hand at an address where no server holds
    their certificates, were taken alive into the topology (a ring slot each, for
    ``dead_after``, and again with each new incarnation told) and passed on in peer lists to
    every other peer. Now they are only probed: p0 never puts them in its topology, p1 and p2
    never hear of them, and the honest three still gossip with each other."""
    p0, p1, p2 = tls_swarm(certs)
    handler = Impersonator()
    evil_sec = TransportSecurity.from_files(certs.ca, certs.certs["evil"], certs.keys["evil"])
    server = GossipServer(handler, security=evil_sec)
    server.start()
    try:
        invented = [f"q{i}" for i in range(40)]

        def kept_out() -> None:
            # evil spoke for itself (present until its own address fails it); the ids it
            # made up did not.
            honest = {"p0", "p1", "p2"}
            assert set(p0.membership.present_ids()) - {"evil"} == honest
            assert set(p0.neighbourhood.ids()) - {"evil"} == honest
            for q in invented:
                rec = p0.membership.record(q)
                assert rec is None or not rec.heard_directly, rec
            for other in (p1, p2):
                assert all(other.membership.record(q) is None for q in invented)
            assert handler.calls == 0, "a probe of an invented id reached evil"

        with evil_client(certs, p0.address) as evil:
            for _ in range(3):  # a new life each time: nothing brings them in
                claims = [
                    pb.PeerInfo(id=q, address=server.address, incarnation=time.time_ns())
                    for q in invented
                ]
                evil.heartbeat(
                    pb.HeartbeatRequest(swarm="gossipgrad", sender=evil_info(), known=claims)
                )
                hold_for(1.0, kept_out)
        stats = run_rounds([p0, p1, p2], 3)
        assert {"p0", "p1", "p2"} <= {pid for s in stats for pid in s.mixed}, stats
    finally:
        server.stop(grace=0)
