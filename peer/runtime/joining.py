"""How a fresh peer joins a running swarm without stampeding its donors.

1. **Find the swarm** (:func:`find_swarm`): heartbeat every bootstrap address at once, and
   again after a pause growing exponentially, until one answers. Any address that answers
   gives the whole view (heartbeats carry the peer list). None within ``peer.start_timeout``:
   :class:`JoinError` ``no bootstrap peer answered: A, B (after Ns)``.
2. **Order the donors** (:func:`donor_order`): live peers at least ``peer.join_after_steps``
   in; first those close to their median step, shuffled, so that joiners arriving
   together tend to ask different donors instead of all asking the most advanced one; then
   the rest, most advanced first.
3. **Download** (:class:`StateDownload`): from the first donor that serves. A busy donor
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
import threading
import time
from typing import TYPE_CHECKING

import grpc
from gossipgrad.peer.runtime.state_stream import STATE_FORMAT, StateReader
from gossipgrad.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipgrad.peer.membership.heartbeats import Membership
    from gossipgrad.peer.metrics import PeerMetrics
    from gossipgrad.peer.network.pool import ClientPool

log = logging.getLogger(__name__)

#: Donors within this fraction of the donors' median step (or within ``DONOR_NEAR_STEPS``
#: steps of it, whichever is wider) count as equally good and are tried in random order:
#: peers of one swarm train at about the same pace, and the step a heartbeat reports is a
#: beat old anyway. The median, not the most advanced step: a member claiming a step far
#: ahead of everyone's cannot make itself every joiner's first donor.
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


def find_swarm(
    membership: Membership,
    timeout: float,
    started: float | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Heartbeat the bootstrap addresses until some peer answers, with backoff.

    Args:
        membership: this peer's membership (its ``bootstrap`` list is what is tried; it
            heartbeats them while it knows no peer).
        timeout: seconds from ``started`` after which to give up.
        started: monotonic time the bound counts from (default: now), e.g. the start of a
            wait for ``peer.expected_peers`` that came first.
        stop: set when the peer is asked to stop (SIGTERM): return at once, found or not.

    Raises:
        JoinError: ``no bootstrap peer answered: A, B (after Ns)``.
    """
    started = time.monotonic() if started is None else started
    deadline = started + timeout
    if membership.heard_ids():  # found already (e.g. while waiting for peers)
        return
    backoff = Backoff()
    rounds = 0
    while not membership.heard_ids():
        if stop is not None and stop.is_set():
            return
        rounds += 1
        membership.beat_once()
        if not membership.heard_ids() and not backoff.sleep(deadline):
            raise JoinError(
                f"no bootstrap peer answered: {', '.join(membership.bootstrap)} "
                f"(after {time.monotonic() - started:.0f}s)"
            )
    log.info(
        "found the swarm after %d heartbeat rounds: %d peers known",
        rounds,
        len(membership.heard_ids()),
    )


def donor_order(donors: list[pb.PeerInfo], min_step: int, rng: random.Random) -> list[pb.PeerInfo]:
    """The donors to ask, in order: those at ``min_step`` or more; first the ones near their
    median step (the upper median; see ``DONOR_STEP_SLACK``) shuffled by ``rng``, then those
    behind, most advanced first, then those past the band, nearest first. Empty when no donor
    is at ``min_step``."""
    eligible = [d for d in donors if d.step >= min_step]
    if not eligible:
        return []
    reference = sorted(d.step for d in eligible)[len(eligible) // 2]
    slack = max(DONOR_STEP_SLACK * reference, DONOR_NEAR_STEPS)
    near = [d for d in eligible if abs(d.step - reference) <= slack]
    behind = [d for d in eligible if d.step < reference - slack]
    ahead = [d for d in eligible if d.step > reference + slack]
    rng.shuffle(near)
    return (
        near
        + sorted(behind, key=lambda d: d.step, reverse=True)
        + sorted(ahead, key=lambda d: d.step)
    )


class StateDownload:
    """Step 3 of the module docstring: a fresh peer's download of one donor's state.

    Args:
        membership: this peer's membership (who the live donors are, at which step).
        clients: the peer's client pool (one connection per address).
        swarm: the swarm's name (the donor refuses another swarm's request).
        me: this peer's id (the donor's per-caller limits count by it).
        fingerprint: this peer's model fingerprint (a state for another model is an error).
        metrics: the peer's metrics (state bytes received).
        state_timeout: default deadline of one download from one donor.
        rng: shuffles the donors near the most advanced step.
    """

    def __init__(
        self,
        membership: Membership,
        clients: ClientPool,
        swarm: str,
        me: str,
        fingerprint: str,
        metrics: PeerMetrics,
        state_timeout: float,
        rng: random.Random | None = None,
    ) -> None:
        self.membership = membership
        self.clients = clients
        self.swarm = swarm
        self.me = me
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.state_timeout = state_timeout
        self.rng = rng or random.Random()

    def donors(self) -> list[pb.PeerInfo]:
        """Live peers that have trained, most advanced first (suspects are never donors: one
        may be the peer that trained alone)."""
        m = self.membership
        infos = []
        for pid in m.present_ids():
            rec = m.record(pid)
            if rec is not None and m.is_alive(pid) and rec.info.step > 0:
                infos.append(rec.info)
        return sorted(infos, key=lambda info: info.step, reverse=True)

    def download(
        self, timeout: float | None = None, min_step: int = 1, patience: float = 0.0
    ) -> tuple[pb.StateHeader, bytes | dict] | None:
        """Fetch the state of one live donor at ``min_step`` or more: the state read as it
        arrived (a dict), or from a donor that sends a ``torch.save`` blob, the blob.

        1. If no live peer is at ``min_step`` now (peers heard of only second hand probed
           first), return None (the swarm itself is young: peers started together train
           from their common seeded initialisation).
        2. Ask the donors in :func:`donor_order`; a busy one (RESOURCE_EXHAUSTED) or a
           failing one is skipped, the first that serves wins.
        3. None served: back off, re-read the view and go to 2, until ``patience`` seconds
           have passed since the start; then raise.

        Args:
            timeout: deadline of one download from one donor (default ``state_timeout``),
                plus what its declared size needs at the slowest rate expected.
            min_step: the least step a donor must be at (its own step, as it reports it in
                the download).
            patience: seconds to keep retrying after the first pass (0: one pass).

        Raises:
            JoinError: donors were there but none sent its state within ``patience``.
            ValueError: a donor's state is for another model.
        """
        timeout = timeout if timeout is not None else self.state_timeout
        started = time.monotonic()
        deadline = started + patience
        backoff = Backoff(initial=0.5, maximum=5.0, rng=self.rng)
        failures: dict[str, str] = {}  # donor id -> why it did not serve, last time asked
        order = donor_order(self.donors(), min_step, self.rng)
        if not order and self.membership.unverified_ids():
            # Peers heard of only second hand are no donors until they answer for themselves
            # (peers.py): probe them now rather than take the swarm for young.
            self.membership.beat_once()
            order = donor_order(self.donors(), min_step, self.rng)
        if not order:
            return None
        while True:
            for info in order:
                got = self._download_from(info, timeout, min_step, failures)
                if got is not None:
                    return got
            if not backoff.sleep(deadline):
                tried = "; ".join(failures.values()) or "no live donor left"
                raise JoinError(
                    f"no donor sent its state: {tried} (after {time.monotonic() - started:.0f}s)"
                )
            order = donor_order(self.donors(), min_step, self.rng)

    def _download_from(
        self, info: pb.PeerInfo, timeout: float, min_step: int, failures: dict[str, str]
    ) -> tuple[pb.StateHeader, bytes | dict] | None:
        """One download from donor ``info``: (header, state or blob), or None with the reason in
        ``failures``."""
        log.info("downloading state from %s (step %d)", info.id, info.step)
        t0 = time.monotonic()
        request = pb.StateRequest(swarm=self.swarm, requester=self.me, state_format=STATE_FORMAT)
        try:
            header, got = self.clients.get(info.address, info.id).download_state(
                request, timeout=timeout, sink=_reader_for
            )
        except grpc.RpcError as err:
            busy = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            failures[info.id] = f"{info.id} at {info.address} ({'busy' if busy else err})"
            level = logging.INFO if busy else logging.WARNING
            log.log(level, "state download from %s failed: %s", info.id, err)
            return None
        if header.model_fingerprint != self.fingerprint:
            raise ValueError(
                f"state from {info.id} is for another model ({header.model_fingerprint})"
            )
        if header.step < min_step:
            failures[info.id] = f"{info.id} at {info.address} (at step {header.step})"
            return None
        seconds = time.monotonic() - t0
        self.metrics.record_received(info.id, "state", header.payload_size)
        log.info(
            "downloaded state of %s: step %d, %d bytes in %.2fs",
            info.id, header.step, header.payload_size, seconds,
        )  # fmt: skip
        return header, got.state() if isinstance(got, StateReader) else got


def _reader_for(header: pb.StateHeader) -> StateReader | None:
    """Where a download's chunks go: into tensors as they arrive if the donor streams its
    state (format 1), else (None) into one blob, for ``torch.load``."""
    return StateReader(header.payload_size) if header.state_format == STATE_FORMAT else None
