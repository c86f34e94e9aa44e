"""Grafana's 24-column grid: rows and panels placed left to right, numbered in order."""

from __future__ import annotations

from .panels import Panel

GRID_COLUMNS = 24


class Layout:
    """Places panels left to right on Grafana's 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.panels: list[Panel] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        """Start a new (expanded) row titled ``title`` below everything placed so far."""
        self._newline()
        self.panels.append(
            {
                "id": self._next_id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: Panel, w: int = 8, h: int = 8) -> None:
        """Place ``panel`` (``w`` columns, ``h`` grid units high) right of the last one, or at
        the start of the next line when it does not fit."""
        if self.x + w > GRID_COLUMNS:
            self._newline()
        panel = {
            "id": self._next_id(),
            **panel,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def add_all(self, panels: list[Panel], w: int = 8, h: int = 8) -> None:
        """Place each of ``panels`` in turn, all of the same size."""
        for panel in panels:
            self.add(panel, w, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0
