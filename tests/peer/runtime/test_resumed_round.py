"""A peer resumed from its checkpoint on a time-varying graph must mix again.

On ``one-peer-exponential`` the partner of round r is i XOR 2^(r mod tau): every peer must
run the same round label at the same time. A resumed peer keeps its checkpoint's label
(``GossipOptimizer.load_state_dict`` hands it to the algorithm), which is behind the swarm's.
Real peers on 127.0.0.1, one of them closed and started anew with the label one round behind.
"""

from __future__ import annotations

import pytest
from gossipgrad.peer.algorithms.base import RoundStats
from gossipgrad.peer.runtime.node import Peer
from support.peers import start_peer, start_peers, wait_until_met
from support.threads import on_threads

pytestmark = pytest.mark.timeout(120)

# max_staleness 1 (what "auto" picks on a LAN): each round waits for the exchanges the round
# before opened. Rounds without training are so short that "auto", on a loaded host, measures
# round trips longer than them and lets rounds wait for exchanges up to 4 rounds old, and the
# two periods run out before p3's first exchange is waited for.
OVERRIDES = {
    "gossip.topology": "one-peer-exponential",
    "gossip.round_timeout": 3.0,
    "gossip.max_staleness": 1,
}


def _rounds(peers: list[Peer], rounds: int) -> dict[str, list[RoundStats]]:
    """Every peer runs ``rounds`` gossip rounds on its own thread, as training threads do."""
    stats: dict[str, list[RoundStats]] = {p.id: [] for p in peers}

    def work(p: Peer) -> None:
        for _ in range(rounds):
            stats[p.id].append(p.algorithm.step_round())

    on_threads(work, [(p,) for p in peers], 90)
    return stats


def test_a_peer_resumed_one_round_behind_mixes_again_within_three_periods() -> None:
    """Issue 41 (finding 2) said such a peer is answered with weight 0 and never mixes again.
    It does mix: an edge pairs exchange n of one end with exchange n of the other, whatever
    round either was sent in, and each end proposes its positive weight in the rounds its own
    label names the other; a round mixes every edge whose exchange is complete (``mixed``
    lists only those mixed with a positive weight). This test keeps it so.

    Three periods: the restarted peer's first round on an edge opens a new session, its next
    one (a period later) sends the first exchange, which the round after it waits for at the
    latest (max_staleness 1)."""
    peers = start_peers(4, OVERRIDES)
    _rounds(peers, 4)
    swarm_round = peers[0].algorithm.round
    assert all(p.algorithm.round == swarm_round for p in peers)
    peers[3].close()
    # The same peer restarted from a checkpoint one round older than the swarm's label.
    resumed = start_peer("p3", [peers[0].address], 103, OVERRIDES)
    resumed.algorithm.load_state_dict({"round": swarm_round - 1})
    peers[3] = resumed
    wait_until_met(peers)
    tau = resumed.topology.period(len(peers))
    stats = _rounds(peers, 3 * tau)
    mixed = [s.mixed for s in stats["p3"]]
    assert any(mixed), f"p3 mixed with positive weight in none of its {3 * tau} rounds: {mixed}"
