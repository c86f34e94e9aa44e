"""Gossip algorithms behind one interface (``GossipAlgorithm``), over one neighbour layer.

``build_algorithm`` turns the [gossip] section into the algorithm a peer runs:

* ``choco``: CHOCO-SGD model gossip (choco.py), the default;
* ``ef-gradient``: compressed gradient averaging plus CHOCO consensus (ef_gradient.py);
* ``diloco``: local phases, compressed pseudo-gradients, an outer optimizer (diloco.py);
* ``exact-diloco``: diloco's phases with the exact mean of every peer's compressed
  pseudo-gradient, disseminated over the gossip graph (exact_diloco.py).
"""

from __future__ import annotations

import threading

from gossipgrad.peer.algorithms.averaging import CompressedAverage
from gossipgrad.peer.algorithms.base import GossipAlgorithm, RoundStats
from gossipgrad.peer.algorithms.choco import ChocoGossip
from gossipgrad.peer.algorithms.diloco import DiLoCo
from gossipgrad.peer.algorithms.ef_gradient import EFGradient
from gossipgrad.peer.algorithms.exact_diloco import ExactDiLoCo
from gossipgrad.peer.algorithms.neighbours import Identity, MembershipView, Neighbourhood
from gossipgrad.peer.algorithms.outer import OuterSettings
from gossipgrad.peer.algorithms.settings import ChocoSettings
from gossipgrad.peer.config import GossipSection
from gossipgrad.peer.flat import FlatParameters
from gossipgrad.peer.membership.topology import Topology, topology_from_name

__all__ = [
    "ChocoGossip",
    "DiLoCo",
    "EFGradient",
    "ExactDiLoCo",
    "GossipAlgorithm",
    "Identity",
    "MembershipView",
    "Neighbourhood",
    "RoundStats",
    "anchors_graph",
    "build_algorithm",
]


def build_algorithm(
    cfg: GossipSection,
    flat: FlatParameters,
    neighbourhood: Neighbourhood,
    state_lock: threading.RLock,
    metrics=None,
) -> GossipAlgorithm:
    """The algorithm ``cfg.algorithm`` names, over ``flat``'s parameters."""
    if flat.initial is None:
        raise ValueError("gossip needs the model as built: FlatParameters(keep_initial=True)")
    settings = ChocoSettings.from_config(cfg)
    if cfg.algorithm == "choco":
        return ChocoGossip(flat.data, flat.initial, settings, neighbourhood, state_lock, metrics)
    outer = OuterSettings(
        local_steps=cfg.local_steps,
        lr=cfg.outer_lr,
        momentum=cfg.outer_momentum,
        nesterov=cfg.outer_nesterov,
        overlap=cfg.overlap,
        background=cfg.background_rounds,
        qsr_alpha=cfg.qsr_alpha,
    )
    if cfg.algorithm == "exact-diloco":
        return ExactDiLoCo(
            flat,
            cfg.codec,
            cfg.error_feedback,
            neighbourhood,
            outer,
            cfg.round_timeout,
            state_lock,
            metrics,
        )
    average = CompressedAverage(
        flat.data, cfg.codec, cfg.error_feedback, neighbourhood, cfg.round_timeout, metrics
    )
    if cfg.algorithm == "ef-gradient":
        consensus = ChocoGossip(
            flat.data, flat.initial, settings, neighbourhood, state_lock, metrics
        )
        return EFGradient(
            flat, average, consensus, cfg.consensus_every, cfg.ef_momentum, state_lock
        )
    anchor = flat.data.detach().clone()
    anchor_settings = ChocoSettings.from_config(cfg, codec=cfg.anchor_codec, gamma=cfg.anchor_gamma)
    graph = anchors_graph(cfg)
    anchors = ChocoGossip(
        anchor,
        flat.initial,
        anchor_settings,
        neighbourhood if graph is None else neighbourhood.over(graph),
        state_lock,
        metrics,
    )
    return DiLoCo(flat, anchor, average, anchors, outer, state_lock)


def anchors_graph(cfg: GossipSection) -> Topology | None:
    """The graph diloco's anchors gossip on where it is not ``cfg.topology``'s (their edges
    keep copies, the average's none: ``anchor_topology`` is a key of its own); None for
    another algorithm or the same graph."""
    if cfg.algorithm != "diloco" or cfg.anchor_topology == cfg.topology:
        return None
    return topology_from_name(cfg.anchor_topology)
