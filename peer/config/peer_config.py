"""``PeerConfig``: the sections composed into the whole configuration of one peer."""

from __future__ import annotations

from gossipgrad.peer.config.base import Section
from gossipgrad.peer.config.gossip import GossipSection
from gossipgrad.peer.config.sections import (
    CheckpointSection,
    MembershipSection,
    MetricsSection,
    PeerSection,
    SecuritySection,
    TrainSection,
    TransportSection,
)
from pydantic import Field


class PeerConfig(Section):
    """The whole configuration of one peer daemon."""

    peer: PeerSection = Field(default_factory=PeerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    gossip: GossipSection = Field(default_factory=GossipSection)
    membership: MembershipSection = Field(default_factory=MembershipSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    security: SecuritySection = Field(default_factory=SecuritySection)
