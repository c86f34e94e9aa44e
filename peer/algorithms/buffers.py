"""Gossip averaging of a model's buffers (BatchNorm running statistics), beside any algorithm.

The algorithms gossip parameters. A model's floating-point buffers are not parameters (no
gradient, no optimizer step), yet a peer evaluates, and the swarm's average model x̄ is
evaluated, with running statistics that must fit the parameters the peers agree on: left
local, each peer keeps statistics of its own shard and its own model. So after every gossip
round a peer sends its buffers, whole (``gossip.buffer_codec``, dense by default: they are
small), to the round's neighbours, and moves its own by plain gossip averaging (Boyd et al.,
"Randomized gossip algorithms", 2006):

    b_i += Σ_j w_ij (b_j − b_i)     over the neighbours whose buffers have arrived,

with the round's Metropolis-Hastings weights renormalised over those. It never blocks training:
a round mixes what the neighbours sent for the previous one (running statistics move slowly),
and the correction is added to the buffers as they are now, so the local updates since then
are kept. Buffers are values, not increments: a lost message costs one round, nothing else,
so they carry no edge sessions and need no error feedback.
"""

from __future__ import annotations

import threading

from gossipgrad.peer.algorithms.averaging import CompressedAverage, Ticket
from gossipgrad.peer.algorithms.neighbours import Neighbourhood
from gossipgrad.peer.flat import FloatBuffers
from gossipgrad.proto import gossip_pb2 as pb


class BufferAverage:
    """The buffers' gossip of one peer (module docstring).

    Args:
        buffers: the model's floating-point buffers.
        codec: compression spec of the buffers' messages (``none``: dense fp32).
        neighbourhood: the neighbour layer the algorithm also uses.
        state_lock: held while the buffers are written (the training thread's forward passes
            update them too).
        every: exchange every this many rounds.
    """

    def __init__(
        self,
        buffers: FloatBuffers,
        codec: str,
        neighbourhood: Neighbourhood,
        state_lock: threading.RLock,
        every: int = 1,
    ) -> None:
        self.buffers = buffers
        self.every = every
        # No metrics object: its bytes are counted by the neighbourhood's pushes, and the
        # error-feedback gauge is the algorithm's.
        self.average = CompressedAverage(
            buffers.gather(), codec, False, neighbourhood, 0.0, None, kind=pb.BUFFERS
        )
        self._lock = state_lock
        self._ticket: Ticket | None = None
        self.rounds = 0
        self.last_averaged: list[str] = []

    def after_round(self, round_: int) -> list[str]:
        """Every ``every`` rounds: mix the buffers the neighbours sent at the last exchange,
        then send ours to this round's; returns who was last averaged with."""
        self.rounds += 1
        if (self.rounds - 1) % self.every:
            return self.last_averaged
        if self._ticket is not None:
            avg, stats = self.average.collect(self._ticket, wait=False)
            if stats.averaged:
                with self._lock:
                    self.buffers.add_(avg - self.average.mine)
            self.last_averaged = stats.averaged
        with self._lock:
            current = self.buffers.gather()
        self._ticket = self.average.start(current, round_)
        return self.last_averaged

    def handle_update(self, header: pb.UpdateHeader, payload: bytes) -> pb.PushReply:
        """Queue one neighbour's buffers (a server thread)."""
        return self.average.handle_update(header, payload)

    def forget(self, peer: str) -> None:
        self.average.forget(peer)

    def prune(self, present: set[str]) -> None:
        self.average.prune(present)
