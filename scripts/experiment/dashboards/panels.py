"""Grafana panel builders: time series, single stats and tables over PromQL queries.

Every panel reads the ``${datasource}`` template variable, so one dashboard works against any
Prometheus data source Grafana has.
"""

from __future__ import annotations

from typing import Any

from .promql import rate

DS = {"type": "prometheus", "uid": "${datasource}"}

Panel = dict[str, Any]


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict[str, Any]:
    """One PromQL query of a panel."""
    t: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend}
    if instant:
        t.update(instant=True, range=False, format="table")
    else:
        t.update(range=True)
    return t


def _targets(queries: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [target(expr, legend, ref=chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def timeseries(
    title: str, queries: list[tuple[str, str]], unit: str, description: str = "", log: bool = False
) -> Panel:
    """A time-series panel; ``queries`` are (PromQL, legend format) pairs."""
    custom: dict[str, Any] = {"lineWidth": 1, "fillOpacity": 5, "showPoints": "never"}
    if log:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries),
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, expr: str, unit: str, description: str = "", decimals: int = 2) -> Panel:
    """A single-number panel showing the latest value."""
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr)],
        "fieldConfig": {"defaults": {"unit": unit, "decimals": decimals}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def table(title: str, expr: str, description: str = "") -> Panel:
    """A table of the labels of an instant query (build info)."""
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, instant=True)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
        "transformations": [
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}},
            }
        ],
    }


def rejected_by_reason(sel: str) -> Panel:
    """Rejected updates per second by reason (both dashboards show it the same way)."""
    by_reason = rate("gossipgrad_rejected_updates_total", sel, "reason")
    return timeseries("Rejected updates by reason", [(by_reason, "{{reason}}")], "cps")
