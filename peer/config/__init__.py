"""The peer's configuration: one validated structure, loaded from TOML plus CLI overrides.

Each TOML section maps onto one pydantic model, and each field's description is the
documentation of that key (``gossipgrad-peer --help`` and docs/config.md are generated from
it). Unknown keys and bad values fail before anything starts, with a one-line message naming
the key. Components receive only their own section, never the whole config.

- ``base``: ``ConfigError``, the strict ``Section`` base, the ``Address`` type.
- ``sections``: ``[peer]``, ``[train]``, ``[membership]``, ``[checkpoint]``, ``[metrics]``,
  ``[transport]``, ``[security]``;  ``gossip``: ``[gossip]``.
- ``peer_config``: ``PeerConfig``, the sections together.
- ``loading``: ``build_config`` / ``load_config`` (TOML plus dotted-key overrides).
- ``reference``: ``iter_fields`` and the generated markdown reference.
"""

from gossipgrad.peer.config.base import Address, ConfigError, Section
from gossipgrad.peer.config.gossip import GossipSection
from gossipgrad.peer.config.loading import build_config, load_config
from gossipgrad.peer.config.peer_config import PeerConfig
from gossipgrad.peer.config.reference import iter_fields, markdown_reference
from gossipgrad.peer.config.sections import (
    CheckpointSection,
    MembershipSection,
    MetricsSection,
    PeerSection,
    SecuritySection,
    TrainSection,
    TransportSection,
)

__all__ = [
    "Address",
    "CheckpointSection",
    "ConfigError",
    "GossipSection",
    "MembershipSection",
    "MetricsSection",
    "PeerConfig",
    "PeerSection",
    "Section",
    "SecuritySection",
    "TrainSection",
    "TransportSection",
    "build_config",
    "iter_fields",
    "load_config",
    "markdown_reference",
]
