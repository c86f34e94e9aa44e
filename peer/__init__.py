"""The peer daemon: config, transport, membership, topology, gossip, training, metrics.

Sub-packages: ``config`` (the validated configuration), ``network`` (gRPC), ``membership``
(heartbeats, topologies, mixing weights), ``algorithms`` (the gossip algorithms), ``tasks``
(what is trained, and how locally), ``runtime`` (``Peer``, ``GossipOptimizer``, the daemon).

The names users need are importable from here (``from gossipgrad.peer import
GossipOptimizer, load_config``); each loads its module on first use, so importing a light
part of the package (``gossipgrad.peer.config``, ``gossipgrad.peer.records``) never loads
torch or the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossipgrad.peer.config import PeerConfig, build_config, load_config
    from gossipgrad.peer.runtime.daemon import Daemon
    from gossipgrad.peer.runtime.node import Peer
    from gossipgrad.peer.runtime.optimizer import GossipOptimizer
    from gossipgrad.peer.runtime.site import SiteOptimizer

#: public name -> the module that defines it
_EXPORTS = {
    "PeerConfig": "gossipgrad.peer.config",
    "build_config": "gossipgrad.peer.config",
    "load_config": "gossipgrad.peer.config",
    "Daemon": "gossipgrad.peer.runtime.daemon",
    "Peer": "gossipgrad.peer.runtime.node",
    "GossipOptimizer": "gossipgrad.peer.runtime.optimizer",
    "SiteOptimizer": "gossipgrad.peer.runtime.site",
}

__all__ = [
    "Daemon",
    "GossipOptimizer",
    "Peer",
    "PeerConfig",
    "SiteOptimizer",
    "build_config",
    "load_config",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
