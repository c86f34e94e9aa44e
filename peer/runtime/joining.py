"""How a fresh peer joins a running swarm without stampeding its donors.

1. **Find the swarm** (:func:`find_swarm`): heartbeat every bootstrap address at once, and
   again after a pause growing exponentially, until one answers. Any address that answers
   gives the whole view (heartbeats carry the peer list). None within ``peer.start_timeout``:
   :class:`JoinError` ``no bootstrap peer answered: A, B (after Ns)``.
2. **Order the donors** (:func:`donor_order`): live peers at least ``peer.join_after_steps``
   in; first those close to the most advanced step, shuffled, so that joiners arriving
   together tend to ask different donors instead of all asking the most advanced one; then
   the rest, most advanced first.
3. **Download** (``Peer.download_state``): from the first donor that serves. A busy donor
   (RESOURCE_EXHAUSTED: all its ``transport.max_state_downloads`` slots taken) or a failing
   one is skipped; after a pass without success the peer backs off, re-reads the view and
   tries again, and gives up with :class:`JoinError` naming every donor and why, once
   ``peer.start_timeout`` has passed. Each donor caps the bytes per second it serves
   (``transport.state_rate_bytes``), all joiners together.

A state comes whole from one donor, never in chunks from several: peers of a gossip swarm
hold different parameters (they agree only up to the consensus distance) and each has its
own optimizer state and round counters, so a state stitched from several donors would be
nobody's. Load is spread across joiners, not within one download.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from gossipgrad.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipgrad.peer.membership.heartbeats import Membership

log = logging.getLogger(__name__)

#: Donors within this fraction of the most advanced step (or within ``DONOR_NEAR_STEPS``
#: steps of it, whichever is wider) count as equally good and are tried in random order:
#: peers of one swarm train at about the same pace, and the step a heartbeat reports is a
#: beat old anyway.
DONOR_STEP_SLACK = 0.1
DONOR_NEAR_STEPS = 10


class JoinError(RuntimeError):
    """A fresh peer could not join: no bootstrap peer answered, or no donor sent its state.

    The message is one line naming what was tried (the daemon logs it and exits non-zero).
    """


class Backoff:
    """Pauses between attempts: ``initial`` seconds, times ``multiplier`` after each pause,
    capped at ``maximum``, plus up to ``jitter`` relative random jitter (so peers started
    together do not retry in lockstep).
    """

    def __init__(
        self,
        initial: float = 0.2,
        maximum: float = 2.0,
        multiplier: float = 2.0,
        jitter: float = 0.2,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < initial <= maximum or multiplier < 1 or jitter < 0:
            raise ValueError("need 0 < initial <= maximum, multiplier >= 1 and jitter >= 0")
        self._next = initial
        self._maximum = maximum
        self._multiplier = multiplier
        self._jitter = jitter
        self._rng = rng or random.Random()

    def sleep(self, deadline: float) -> bool:
        """Pause before the next attempt, never past ``deadline`` (monotonic seconds);
        False, without pausing, when the deadline has passed (no attempt is left)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        pause = self._next * (1 + self._jitter * self._rng.random())
        self._next = min(self._next * self._multiplier, self._maximum)
        time.sleep(min(pause, remaining))
        return True


def find_swarm(membership: Membership, timeout: float, started: float | None = None) -> None:
    """Heartbeat the bootstrap addresses until some peer answers, with backoff.

    Args:
        membership: this peer's membership (its ``bootstrap`` list is what is tried; it
            heartbeats them while it knows no peer).
        timeout: seconds from ``started`` after which to give up.
        started: monotonic time the bound counts from (default: now), e.g. the start of a
            wait for ``peer.expected_peers`` that came first.

    Raises:
        JoinError: ``no bootstrap peer answered: A, B (after Ns)``.
    """
    started = time.monotonic() if started is None else started
    deadline = started + timeout
    if len(membership.present_ids()) >= 2:  # found already (e.g. while waiting for peers)
        return
    backoff = Backoff()
    rounds = 0
    while len(membership.present_ids()) < 2:
        rounds += 1
        membership.beat_once()
        if len(membership.present_ids()) < 2 and not backoff.sleep(deadline):
            raise JoinError(
                f"no bootstrap peer answered: {', '.join(membership.bootstrap)} "
                f"(after {time.monotonic() - started:.0f}s)"
            )
    log.info(
        "found the swarm after %d heartbeat rounds: %d peers known",
        rounds,
        len(membership.present_ids()) - 1,
    )


def donor_order(donors: list[pb.PeerInfo], min_step: int, rng: random.Random) -> list[pb.PeerInfo]:
    """The donors to ask, in order: those at ``min_step`` or more; first the ones near the
    most advanced step (see ``DONOR_STEP_SLACK``) shuffled by ``rng``, then the others, most
    advanced first. Empty when no donor is at ``min_step``."""
    eligible = [d for d in donors if d.step >= min_step]
    if not eligible:
        return []
    best = max(d.step for d in eligible)
    floor = best - max(DONOR_STEP_SLACK * best, DONOR_NEAR_STEPS)
    near = [d for d in eligible if d.step >= floor]
    rest = sorted((d for d in eligible if d.step < floor), key=lambda d: d.step, reverse=True)
    rng.shuffle(near)
    return near + rest
