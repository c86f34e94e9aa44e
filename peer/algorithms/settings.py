"""The slices of the [gossip] section an algorithm reads (components get only their own keys)."""

from __future__ import annotations

from dataclasses import dataclass

from gossipgrad.peer.config import GossipSection


@dataclass(frozen=True)
class ChocoSettings:
    """The gossip keys CHOCO reads (a slice of the [gossip] section)."""

    codec: str
    gamma: float
    local_steps: int
    max_staleness: int | str  # a bound, or "auto" (peer/algorithms/staleness.py)
    round_timeout: float
    error_feedback: bool
    robust_clip: float
    copy_dtype: str

    @classmethod
    def from_config(cls, g: GossipSection, **override) -> ChocoSettings:
        fields = {k: getattr(g, k) for k in cls.__dataclass_fields__}
        return cls(**{**fields, **override})
