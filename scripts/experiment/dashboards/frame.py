"""What every gossipgrad dashboard shares around its panels: template variables, links, time
range and refresh."""

from __future__ import annotations

from typing import Any

from .layout import Layout
from .panels import DS

TAGS = ["gossipgrad"]
PEER_VALUES = "label_values(gossipgrad_build_info, peer)"


def variables(multi: bool) -> list[dict[str, Any]]:
    """The ``datasource`` and ``peer`` variables; ``multi``: ``peer`` is a multi-select with
    an "All" option (matching every peer), else it names one peer."""
    peer_var: dict[str, Any] = {
        "name": "peer",
        "label": "Peer",
        "type": "query",
        "datasource": DS,
        "query": {"query": PEER_VALUES, "refId": "PeerVar"},
        "definition": PEER_VALUES,
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": multi,
        "current": {},
        "options": [],
    }
    if multi:
        peer_var["allValue"] = ".*"
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "options": [],
            "refresh": 1,
        },
        peer_var,
    ]


def dashboard(uid: str, title: str, description: str, layout: Layout, multi: bool) -> dict:
    """A whole dashboard: ``layout``'s panels with the shared variables, links and settings."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "timezone": "utc",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "links": [
            {
                "title": "gossipgrad dashboards",
                "type": "dashboards",
                "tags": TAGS,
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": {"list": variables(multi)},
        "annotations": {"list": []},
        "panels": layout.panels,
    }
