"""gossipgrad's Grafana dashboards (grafana/dashboards/*.json), built from one place.

Two dashboards, built from the same small panel helpers so units, legends and selectors stay
consistent:

* ``gossipgrad-overview`` (:mod:`.overview`) -- the swarm: bandwidth per peer and per link,
  compression ratio, loss and accuracy per peer, consensus distance, step and round rates,
  round latency quantiles, membership, rejects and resyncs. Multi-select ``peer`` variable
  (default: all).
* ``gossipgrad-peer`` (:mod:`.peer`) -- one peer (single-select ``peer`` variable): traffic
  per neighbour and message kind, per-neighbour compression ratio and push latency, training,
  health.

:mod:`.panels` builds panels, :mod:`.promql` the queries they share, :mod:`.layout` places
them on the grid and :mod:`.frame` wraps them in a dashboard. Every query reads the ``peer``
target label set by ``scripts/prometheus_config.py``. ``scripts/make_dashboards.py`` writes
or checks the JSON.
"""

from __future__ import annotations

import json

from .overview import overview
from .peer import peer_drilldown


def build_dashboards() -> dict[str, dict]:
    """Every dashboard, keyed by its file name under grafana/dashboards/."""
    return {"gossipgrad-overview.json": overview(), "gossipgrad-peer.json": peer_drilldown()}


def render(dashboard: dict) -> str:
    """The exact text committed for a dashboard."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"
