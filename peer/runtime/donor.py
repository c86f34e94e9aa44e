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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: (step, round, snapshot), as a peer's state source returns it: the snapshot is a
#: :class:`~gossipgrad.peer.runtime.state_stream.StateWriter` (sent as it is serialized) or
#: a serialized blob.
Snapshot = tuple[int, int, Any]


class SnapshotCache:
    """A peer's state for joiners, taken from ``source`` at most once per reported
    (step, round).

    Args:
        source: snapshots the state under the training lock; returns the step and round it
            was taken at and the snapshot.

    Statistics (for tests and logs): ``serialized`` calls of ``source`` (snapshots taken),
    ``reused`` requests served from the kept snapshot.
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
        self.serialized = 0
        self.reused = 0

    def _fresh(self) -> Snapshot | None:
        with self._slot:
            kept = self._kept
            return kept if kept is not None and _at_least(kept, self._progress) else None

    def get(self) -> Snapshot:
        """The kept snapshot if it is at least as recent as the reported progress, else a
        new one (kept in its place)."""
        with self._serializing:
            kept = self._fresh()
            if kept is not None:
                self.reused += 1
                return kept
            kept = self._source()
            self.serialized += 1
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
