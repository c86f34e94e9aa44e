"""One live view of every process of the running phase (swarm peers or baseline ranks):
step, loss, bytes sent -- a rich table redrawn in place, or a plain line every few seconds
when the output is not a terminal (``--no-live``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gossipgrad.peer.records import PeerStatus
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

PLAIN_EVERY_S = 5.0

# A peer's status.json, or a baseline rank's progress file (the same keys, as a dict).
Progress = PeerStatus | Mapping[str, Any]


def _fields(s: Progress) -> Mapping[str, Any]:
    return s.model_dump() if isinstance(s, PeerStatus) else s


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f}"


def progress_table(phase: str, statuses: Sequence[Progress], steps: int) -> Table:
    """A table with one row per process of ``phase``."""
    table = Table(title=f"{phase}", expand=False)
    for col in ("id", "state", "step", "loss", "sent MB", "recv MB"):
        table.add_column(col, justify="right")
    for i, s in enumerate(map(_fields, statuses)):
        loss = s.get("loss")
        table.add_row(
            str(s.get("id", i)),
            str(s.get("state", "starting")),
            f"{s.get('step', 0)}/{steps}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            _mb(s.get("sent_bytes", 0)),
            _mb(s.get("received_bytes", s.get("sent_bytes", 0))),
        )
    return table


class LiveView:
    """``with LiveView(console, live=True) as view: view.update(phase, statuses, steps)``."""

    def __init__(self, console: Console, live: bool = True) -> None:
        self.console = console
        self.live = live and console.is_terminal
        self._live: Live | None = None
        self._last_plain = 0.0
        self.done: list[str] = []

    def __enter__(self) -> LiveView:
        if self.live:
            self._live = Live(Text("starting"), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def finish(self, line: str) -> None:
        """Record a finished phase (shown above the table)."""
        self.done.append(line)
        if self._live is None:
            self.console.print(line)

    def update(self, phase: str, statuses: Sequence[Progress], steps: int) -> None:
        if self._live is not None:
            header = Text("\n".join(self.done)) if self.done else Text("")
            self._live.update(Group(header, progress_table(phase, statuses, steps)))
            return
        now = time.monotonic()
        if now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            cells = [
                f"{s.get('id', i)}:{s.get('step', 0)}"
                + (f"/{s['loss']:.3f}" if isinstance(s.get("loss"), (int, float)) else "")
                for i, s in enumerate(map(_fields, statuses))
            ]
            self.console.print(f"{phase} step/loss " + " ".join(cells))
