"""``Neighbourhood.over``: one neighbour layer seen through a second graph (diloco's anchors
on a ring inside the graph its pseudo-gradients are averaged on). Neighbours and weights come
from the second graph; pushes, arrivals and round trips stay the layer's, shared."""

from __future__ import annotations

import pytest
from gossipgrad.peer.algorithms.neighbours import Identity, Neighbourhood
from gossipgrad.peer.membership.topology import topology_from_name
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(30)

IDS = ["a", "b", "c", "d", "e", "f"]


class SixPeers:
    def present_ids(self) -> list[str]:
        return IDS

    def is_alive(self, peer: str) -> bool:
        return True


class Answering:
    """Answers every push at once (what the shared round-trip record sees)."""

    def push(self, peer, header, payload, patience=1.0):
        return pb.PushReply(), len(payload)


def layer(topology: str) -> Neighbourhood:
    return Neighbourhood(
        Identity("a", "s", "fp", 4), SixPeers(), topology_from_name(topology), Answering()
    )


def test_the_second_graph_gives_neighbours_and_weights() -> None:
    exponential, ring = layer("exponential"), layer("ring")
    view = exponential.over(topology_from_name("ring"))
    assert exponential.neighbors_at(0) == ["b", "c", "e", "f"]
    assert view.neighbors_at(0) == ring.neighbors_at(0) == ["b", "f"]
    assert view.all_neighbors() == ring.all_neighbors() == {"b", "f"}
    assert view.weights_at(0, IDS) == ring.weights_at(0, IDS)
    assert view.weights_at(0, IDS) != exponential.weights_at(0, IDS)


def test_pushes_are_the_layers() -> None:
    base = layer("exponential")
    view = base.over(topology_from_name("ring"))
    assert base.round_trip() is None
    view.push("b", view.header("b", pb.DELTA, b"xyz"), b"xyz")
    assert base.round_trip() is not None  # one record of round trips for both graphs
    base.close()
