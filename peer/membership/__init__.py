"""Who is in the swarm and who talks to whom.

- ``peers``: the peer table (states, incarnations, failure detection by silence).
- ``heartbeats``: ``Membership``, the table kept fresh by heartbeats with peer exchange.
- ``topology``: the gossip graphs over peers 0..n-1 and ``topology_from_name``.
- ``weights``: Metropolis-Hastings mixing weights over a graph.

Nothing here imports the config at run time (sections are type hints only), so the config
may validate a topology name with ``topology_from_name`` without an import cycle.
"""

from gossipgrad.peer.membership.heartbeats import Membership
from gossipgrad.peer.membership.peers import ALIVE, DEAD, SUSPECT, PeerRecord, PeerTable
from gossipgrad.peer.membership.topology import (
    DEFAULT_DEGREE,
    TOPOLOGIES,
    Topology,
    topology_from_name,
)
from gossipgrad.peer.membership.weights import (
    metropolis_hastings_weights,
    mixing_matrix,
    spectral_gap,
)

__all__ = [
    "ALIVE",
    "DEAD",
    "DEFAULT_DEGREE",
    "SUSPECT",
    "TOPOLOGIES",
    "Membership",
    "PeerRecord",
    "PeerTable",
    "Topology",
    "metropolis_hastings_weights",
    "mixing_matrix",
    "spectral_gap",
    "topology_from_name",
]
