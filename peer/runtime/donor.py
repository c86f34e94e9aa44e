"""The donor side of a state download: the state snapshotted at most once per progress.

Snapshotting a peer's state (parameters, optimizer moments, the algorithm's counters) takes the
training lock and a copy of the state in memory. Done per request, a member that asks for the
state and cancels the download at once, in a loop, stalls training and churns memory at the
rate it can send requests. So the snapshot is kept with the progress it was taken at, the
(step, round) the training loop last reported, and served again to every request until the
loop reports a later step or round: one snapshot per progress, however many downloads,
completed or cancelled, ask for it. Once progress moves past it, it is dropped (not kept for
the rest of the run), so between downloads it costs no memory; a download under way keeps the
snapshot it is sending until it ends.

A member asking again every step would still cost one snapshot per step. So a requester
whose request needs a new snapshot gets one at most once per ``SNAPSHOT_PER_REQUESTER_S``:
within it the request is refused (:class:`SnapshotRefused`; the server answers "donor busy",
and a joiner tries another donor or this one later), while the kept snapshot is served to
it, and to anyone, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: (step, round, snapshot), as a peer's state source returns it: the snapshot is a
#: :class:`~gossipgrad.peer.runtime.state_stream.StateWriter` (sent as it is serialized) or
#: a serialized blob.
Snapshot = tuple[int, int, Any]

#: A requester whose request needs a new snapshot gets one at most once per this many
#: seconds (module docstring).
SNAPSHOT_PER_REQUESTER_S = 2.0


class SnapshotRefused(Exception):
    """A new snapshot for this requester, less than ``SNAPSHOT_PER_REQUESTER_S`` after its
    last one."""


class SnapshotCache:
    """A peer's state for joiners, taken from ``source`` at most once per reported
    (step, round).

    Args:
        source: snapshots the state under the training lock; returns the step and round it
            was taken at and the snapshot.

    Statistics (for tests and logs): ``serialized`` calls of ``source`` (snapshots taken),
    ``reused`` requests served from the kept snapshot, ``refused`` requests that would have
    taken a new snapshot too soon after their requester's last.
    """

    def __init__(self, source: Callable[[], Snapshot]) -> None:
        self._source = source
        # Held while snapshotting, so concurrent requests wait for one snapshot ...
        self._serializing = threading.Lock()
        # ... and only around the kept snapshot, so the training loop's progress() never
        # waits on a snapshot (which itself waits for the training lock).
        self._slot = threading.Lock()
        self._kept: Snapshot | None = None
        self._progress = (0, 0)
        # requester -> when a snapshot was last taken for it (within the interval only)
        self._taken_for: dict[str, float] = {}
        self.serialized = 0
        self.reused = 0
        self.refused = 0

    def _fresh(self) -> Snapshot | None:
        with self._slot:
            kept = self._kept
            return kept if kept is not None and _at_least(kept, self._progress) else None

    def get(self, requester: str = "") -> Snapshot:
        """The kept snapshot if it is at least as recent as the reported progress, else a
        new one (kept in its place). Raises SnapshotRefused if ``requester`` had a new one
        less than ``SNAPSHOT_PER_REQUESTER_S`` ago."""
        with self._serializing:
            kept = self._fresh()
            if kept is not None:
                self.reused += 1
                return kept
            now = time.monotonic()
            self._taken_for = {
                r: t for r, t in self._taken_for.items() if now - t < SNAPSHOT_PER_REQUESTER_S
            }
            if requester in self._taken_for:
                self.refused += 1
                raise SnapshotRefused(
                    f"a new state snapshot for {requester} {now - self._taken_for[requester]:.1f}"
                    f" s after its last: one per {SNAPSHOT_PER_REQUESTER_S:g} s"
                )
            kept = self._source()
            self.serialized += 1
            if requester:
                self._taken_for[requester] = now
            with self._slot:
                self._kept = kept
            return kept

    def progress(self, step: int, round_: int) -> None:
        """The training loop is at ``step`` / ``round_``: a snapshot taken before is stale
        (the next request takes a new one) and dropped now."""
        with self._slot:
            self._progress = (step, round_)
            if self._kept is not None and not _at_least(self._kept, self._progress):
                self._kept = None


def _at_least(snapshot: Snapshot, progress: tuple[int, int]) -> bool:
    step, round_, _ = snapshot
    return step >= progress[0] and round_ >= progress[1]
