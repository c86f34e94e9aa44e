"""The interface every gossip algorithm implements, and what a round reports.

A training loop talks to an algorithm only through ``before_step`` / ``after_step`` (wrapped by
``GossipOptimizer.step``); the gRPC server hands it incoming updates through ``handle_update``;
membership tells it about peers that restarted or left; checkpoints and late joiners use
``state_dict`` / ``load_state_dict``. Four implementations: ``choco`` (CHOCO-SGD model
gossip), ``ef-gradient`` (compressed gradient averaging), ``diloco`` (local phases,
compressed pseudo-gradients, an outer optimizer) and ``exact-diloco`` (the same phases, every
peer's pseudo-gradient disseminated to every peer: identical replicas).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from gossipgrad.proto import gossip_pb2 as pb


@dataclass
class RoundStats:
    """What one gossip round did (for logs, metrics and tests)."""

    round: int
    neighbors: list[str]
    mixed: list[str]
    pushed: list[str]
    waited_s: float = 0.0
    consensus_distance: float = float("nan")
    residual_norm: float = 0.0
    max_staleness: int | None = None  # the bound the round waited under (CHOCO rounds)
    anchor_checksum: str | None = None  # exact-diloco: the anchor the next phase starts from
    overlap: bool | None = None  # diloco: whether this phase end overlapped its exchange


class GossipAlgorithm(abc.ABC):
    """One way for a peer to exchange with its neighbours and merge what they send."""

    #: The algorithm's name in ``gossip.algorithm``.
    name: ClassVar[str]
    #: The update kinds it takes (pb.UpdateKind values).
    kinds: ClassVar[tuple[int, ...]]

    @property
    @abc.abstractmethod
    def round(self) -> int:
        """Rounds run so far (a label for logs and progress, not a clock peers share)."""

    def before_step(self) -> None:
        """Called after ``backward()`` and before the optimizer step (gradients are ready);
        nothing by default."""
        return

    @abc.abstractmethod
    def after_step(self, local_step: int) -> RoundStats | None:
        """Called after optimizer step ``local_step`` (1-based); returns a round's stats if
        one ran."""

    def observe_learning_rate(self, lr: float) -> None:
        """The learning rate of the step just taken (the optimizer's first parameter group),
        before ``round_due`` and ``after_step``; nothing by default (exact-diloco's phase
        lengths follow it with ``gossip.qsr_alpha``)."""
        return

    def phase_end_pending(self, local_step: int) -> bool:
        """Whether step ``local_step`` ends a phase whose end is not applied yet (diloco,
        exact-diloco: a phase end waits for the neighbours' messages), read under the state
        lock; False without phases. A joiner's state taken then starts a step back."""
        return False

    def round_due(self, local_step: int) -> bool:
        """Whether ``after_step(local_step)`` runs a round (True by default: it decides)."""
        return True

    def hand_over(self, local_step: int) -> None:
        """With ``gossip.background_rounds``: called on the training thread before
        ``after_step(local_step)`` of a due round goes to a thread of its own and training goes
        on (diloco: the round's thread keeps the parameters at the phase's end, and
        ``before_step`` holds the next optimizer step until it has). Nothing by default."""
        return

    @abc.abstractmethod
    def consensus_round(self) -> RoundStats:
        """One gossip-only round now (no training step: ``gossip.final_rounds``)."""

    def finish(self, interrupted: bool = False) -> None:
        """The run is over: apply whatever is still in flight, then tell the neighbours and
        take part in no further exchange (the last call before ``close``; rounds after it do
        nothing). ``interrupted``: the run was cut short (a signal, an error): settle only what
        is already under way, within a short grace, and compute nothing new (default:
        nothing to do)."""
        return

    def anchor_checksums(self) -> dict[int, str]:
        """Phase -> checksum of the anchor the phase started from, for the records, where
        the replicas are meant to be identical (exact-diloco); empty by default."""
        return {}

    @abc.abstractmethod
    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Take one incoming update (a gRPC server thread)."""

    @abc.abstractmethod
    def state_dict(self, for_joiner: bool = False, copy: bool = True) -> dict[str, Any]:
        """The algorithm's state: for a checkpoint, or (``for_joiner``) for a peer that joins
        the swarm, which takes what is shared (anchor, outer momentum) and none of what is
        this peer's own (error-feedback residuals: a joiner that copied them would send their
        contents a second time). ``copy`` False: its tensors are the algorithm's own, live,
        not copies, for a caller that holds the state lock with no round under way while it
        reads them (``GossipOptimizer.checkpoint_state``)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; every edge starts a new session."""

    @abc.abstractmethod
    def forget(self, peer: str) -> None:
        """``peer`` restarted or left: end its edge sessions and drop what it queued."""

    @abc.abstractmethod
    def prune(self, present: set[str]) -> None:
        """Free the state kept for peers no longer present."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background work (pushes in flight are finished or cancelled)."""
