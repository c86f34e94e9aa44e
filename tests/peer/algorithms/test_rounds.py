"""The round's rule of when an edge is done, on the real edge table and edges (no gRPC).

A 16-peer churn run stalled the whole swarm 9.3 s: a joiner's opening reached a neighbour
before the neighbour's membership knew the joiner; the neighbour's round began owing it an
answer, a view change in the round dropped the edge (its peer was not in the view yet), the
joiner's next update made it anew, and the round, holding the dropped edge, never saw it done:
it waited out its whole round_timeout, and the ring waited with it.
"""

from __future__ import annotations

import pytest
import torch
from gossipgrad.compression import from_spec
from gossipgrad.peer.algorithms.edges import Copies, EdgeTable, Incoming, Kind, Verdict
from gossipgrad.peer.algorithms.rounds import OpenRound
from gossipgrad.peer.flat import tensor_checksum

pytestmark = pytest.mark.timeout(30)

X = torch.arange(6, dtype=torch.float32)
COPIES = Copies(codec=from_spec("topk:0.5+int8"), dense=from_spec("none"), initial=X * 0)


def opening(epoch: int) -> Incoming:
    """A leader's dense opening (RESYNC, seq 1) of session ``epoch``."""
    return Incoming(
        epoch=epoch,
        seq=1,
        kind=Kind.RESYNC,
        checksum=tensor_checksum(X),
        weight=0.5,
        payload=COPIES.dense.encode(X),
    )


def take(table: EdgeTable, peer: str, update: Incoming) -> None:
    """What the server thread does with an arriving update."""
    edge = table.edge(peer)
    with edge.lock:
        assert edge.admit(update) is None
        assert edge.apply(update, COPIES) is Verdict.ACCEPTED


def answer(table: EdgeTable, peer: str, rnd: OpenRound) -> None:
    """What the round's push does: open this round's exchange on the edge (as it is now)."""
    edge = table.edge(peer)
    with edge.lock:
        kind, payload = edge.encode_next(X, COPIES, early=False, seed=rnd.round + 1)
        edge.record_sent((kind, payload), 0.5, rnd.round)
        rnd.turn[peer] = edge.epoch


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_round_follows_an_edge_a_view_change_made_anew(staleness: int) -> None:
    table = EdgeTable(X, me="p4")  # p4 follows; "p25" < "p4" leads the edge
    take(table, "p25", opening(epoch=7))  # came before p4's membership knew p25
    rnd = OpenRound(["p25"], table, {}, staleness, round=505)
    assert rnd.unfinished() == ["p25"]  # owed an answer
    table.prune({"p4"})  # a view change in the round: p25 is not in the view yet
    assert "p25" not in table
    take(table, "p25", opening(epoch=9))  # the leader's new session (on the hello)
    answer(table, "p25", rnd)
    if staleness == 0:  # lock-step: done once the exchange is mixed
        rnd.record_mixed(["p25"], 0.0)
    assert rnd.unfinished() == []


def test_a_dropped_edge_not_made_anew_is_not_done() -> None:
    """Until the peer speaks again there is nothing to mix with it (the round's wait skips
    peers that are not alive; one that is alive is sent a hello, which makes the edge)."""
    table = EdgeTable(X, me="p4")
    take(table, "p25", opening(epoch=7))
    rnd = OpenRound(["p25"], table, {}, 1, round=3)
    table.prune({"p4"})
    assert rnd.unfinished() == ["p25"]
