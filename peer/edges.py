"""Per-edge public copies for CHOCO-SGD, and the rules that keep both ends identical.

CHOCO-SGD (Koloskova, Stich, Jaggi, ICML 2019) lets every peer keep *public copies* x̂ of its
neighbours' models, updated only by compressed increments q. We keep one pair of public
copies per directed edge rather than one x̂_i shared by all neighbours:

* ``OutEdge`` (i -> j): x̂_{i->j}, what j believes of x_i. i sends q = Q(x_i - x̂_{i->j}).
* ``InEdge``  (j -> i): i's mirror of x̂_{j->i}.

Per-edge copies cost 2·deg·d memory instead of 2·d, and buy three things: time-varying
topologies (an edge idle for some rounds just falls behind and catches up, nothing is lost),
churn (an edge is created or dropped without touching the others), and back-pressure (a slow
link skips rounds and what it skipped stays in x_i - x̂_{i->j}, i.e. error feedback).

The invariant: the receiver's mirror equals the sender's x̂_{i->j} bit for bit. Each update
carries a per-edge sequence number and the checksum of x̂ after it; any gap, duplicate or
mismatch is detected here and healed by a dense RESYNC of that edge.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from gossipgrad.peer.flat import tensor_checksum


class Verdict(enum.Enum):
    """What the receiver did with an incoming update."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    NEED_RESYNC = "need_resync"


@dataclass
class OutEdge:
    """Sender side of edge i -> j: the public copy the neighbour mirrors."""

    public: torch.Tensor
    # Error feedback off only (gossip.error_feedback = false): x as of the last send on this
    # edge, the base the next difference is taken from. None (no memory) in the default path.
    last_sent: torch.Tensor | None = None
    seq: int = -1  # seq of the last update folded into `public`; -1: never synced
    need_resync: bool = True
    busy: bool = False  # a push is in flight
    idle: threading.Event = field(default_factory=threading.Event)  # set when not busy
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.idle.set()

    def mark_sent(self, x: torch.Tensor) -> None:
        """Remember x as the base of the next difference (error feedback off; lock held)."""
        if self.last_sent is None:
            self.last_sent = x.clone()
        else:
            self.last_sent.copy_(x)

    def claim(self) -> bool:
        """Mark a push in flight; False if one already is (caller holds `lock`)."""
        if self.busy:
            return False
        self.busy = True
        self.idle.clear()
        return True

    def release(self) -> None:
        """The push finished, whatever its outcome (caller holds `lock`)."""
        self.busy = False
        self.idle.set()


@dataclass
class InEdge:
    """Receiver side of edge j -> i: the mirror of the neighbour's public copy."""

    mirror: torch.Tensor
    expected_seq: int = 0
    synced: bool = False  # the seq stream is consistent: deltas are admitted
    valid: bool = False  # the mirror equals the sender's copy as of last_round: mix with it
    last_round: int = -1  # round of the last update applied
    heard_round: int = -1  # round of the last update received, applied or not (liveness)
    incarnation: int = 0
    # Admitted updates from a round ahead of the receiver's, applied when it gets there.
    pending: deque[tuple[Any, bytes]] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, resync: bool, seq: int) -> Verdict | None:
        """Sequence check on arrival: None to go ahead, or the verdict to answer with.

        A RESYNC is admitted unless its seq is below one already taken; a delta must be the
        next seq of a synced edge. Pending (held) updates count as taken.
        """
        if resync:
            # Never below what was already taken, synced or not: a replayed old RESYNC
            # would roll the mirror back to a stale copy. (A restarted sender's seqs start
            # again at 0; membership resets the floor when it sees the new incarnation.)
            if seq < self.expected_seq:
                return Verdict.DUPLICATE
            self.pending.clear()  # a resync supersedes whatever was held before it
            return None
        return self.check_delta(seq)

    def hold(self, header: Any, payload: bytes) -> None:
        """Keep an admitted update for a later round; its seq counts as received."""
        self.pending.append((header, payload))
        self.expected_seq = header.seq + 1
        self.synced = True  # later deltas are admitted; `valid` waits for the apply

    def invalidate(self) -> None:
        """The mirror can no longer be trusted: refuse deltas and stop mixing until a resync."""
        self.synced = False
        self.valid = False
        self.pending.clear()

    def apply_resync(self, seq: int, round_: int, dense: torch.Tensor, checksum: int) -> Verdict:
        """Replace the mirror by the sender's whole public copy."""
        if dense.shape != self.mirror.shape:
            raise ValueError(f"resync shape {tuple(dense.shape)} != {tuple(self.mirror.shape)}")
        self.mirror.copy_(dense)
        if tensor_checksum(self.mirror) != checksum:
            self.invalidate()
            return Verdict.NEED_RESYNC
        self.expected_seq = max(self.expected_seq, seq + 1)  # held ones may be counted
        self.synced = self.valid = True
        self.last_round = max(self.last_round, round_)
        return Verdict.ACCEPTED

    def check_delta(self, seq: int) -> Verdict | None:
        """Decide, before decoding, whether a delta with this seq can be applied."""
        if not self.synced:
            return Verdict.NEED_RESYNC
        if seq < self.expected_seq:
            return Verdict.DUPLICATE
        if seq > self.expected_seq:
            self.invalidate()  # a gap: something was lost on the way
            return Verdict.NEED_RESYNC
        return None

    def finish_delta(self, seq: int, round_: int, checksum: int) -> Verdict:
        """After the delta was added to the mirror: verify it and advance."""
        if tensor_checksum(self.mirror) != checksum:
            self.invalidate()
            return Verdict.NEED_RESYNC
        self.expected_seq = max(self.expected_seq, seq + 1)  # held ones may be counted
        self.last_round = max(self.last_round, round_)
        return Verdict.ACCEPTED
