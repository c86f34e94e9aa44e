"""Generate gossipgrad's Grafana dashboards (grafana/dashboards/*.json) from one place.

Two dashboards, built from the same small panel helpers so units, legends and selectors stay
consistent:

* ``gossipgrad-overview`` -- the swarm: bandwidth per peer and per link, compression ratio,
  loss and accuracy per peer, consensus distance, step and round rates, round latency
  quantiles, membership, rejects and resyncs. Multi-select ``peer`` variable (default: all).
* ``gossipgrad-peer`` -- one peer (single-select ``peer`` variable): traffic per neighbour and
  message kind, per-neighbour compression ratio and push latency, training, health.

Every query reads the ``peer`` target label set by ``scripts/prometheus_config.py``.

Usage::

    python scripts/make_dashboards.py            # rewrite grafana/dashboards/*.json
    python scripts/make_dashboards.py --check    # exit 1 if the committed JSON is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent.parent / "grafana" / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
TAGS = ["gossipgrad"]

Panel = dict[str, Any]


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
        self._newline()
        self.panels.append(
            {
                "id": self._next_id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: Panel, w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel = {
            "id": self._next_id(),
            **panel,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0


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


def rate(metric: str, sel: str, by: str = "") -> str:
    """``sum by (by) (rate(metric{sel}[$__rate_interval]))``."""
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}(rate({metric}{{{sel}}}[{RI}]))"


def quantile(q: float, hist: str, sel: str, by: str = "") -> str:
    """``histogram_quantile`` over a histogram's buckets, aggregated by ``by`` (plus ``le``)."""
    keep = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({keep}) (rate({hist}_bucket{{{sel}}}[{RI}])))"


def compression_ratio(sel: str, by: str) -> str:
    """Dense-fp32 bytes over wire bytes of updates: how many times smaller updates travel."""
    dense = rate("gossipgrad_dense_bytes_total", sel, by)
    wire = rate("gossipgrad_sent_bytes_total", f'{sel}, kind="update"', by)
    return f"{dense} / {wire}"


def _variables(multi: bool) -> list[dict[str, Any]]:
    peer_var: dict[str, Any] = {
        "name": "peer",
        "label": "Peer",
        "type": "query",
        "datasource": DS,
        "query": {"query": "label_values(gossipgrad_build_info, peer)", "refId": "PeerVar"},
        "definition": "label_values(gossipgrad_build_info, peer)",
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


def _dashboard(uid: str, title: str, description: str, layout: Layout, multi: bool) -> dict:
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
        "templating": {"list": _variables(multi)},
        "annotations": {"list": []},
        "panels": layout.panels,
    }


def overview() -> dict:
    """The swarm overview dashboard."""
    s = 'peer=~"$peer"'
    sent, recv = "gossipgrad_sent_bytes_total", "gossipgrad_received_bytes_total"
    lay = Layout()
    lay.row("Swarm")
    lay.add(stat("Peers up", f"sum(up{{{s}}})", "none", "Targets Prometheus scrapes.", 0), 4, 4)
    lay.add(
        stat(
            "Peers seen alive (worst view)",
            f'min(gossipgrad_peers{{state="alive", {s}}})',
            "none",
            "Fewest other peers any peer sees alive.",
            0,
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Compression ratio (since start)",
            f'sum(gossipgrad_dense_bytes_total{{{s}}}) / sum({sent}{{kind="update", {s}}})',
            "suffix:×",
            "Dense fp32 bytes / wire bytes of updates, over the peers' lifetime.",
            1,
        ),
        4,
        4,
    )
    lay.add(stat("Bytes sent (since start)", f"sum({sent}{{{s}}})", "decbytes"), 4, 4)
    lay.add(
        stat("Rejected (since start)", f"sum(gossipgrad_rejected_updates_total{{{s}}})", "none"),
        4,
        4,
    )
    lay.add(stat("Resyncs (since start)", f"sum(gossipgrad_resyncs_total{{{s}}})", "none"), 4, 4)

    lay.row("Traffic")
    lay.add(
        timeseries("Sent bandwidth per peer", [(rate(sent, s, "peer"), "{{peer}}")], "Bps"), 8, 8
    )
    lay.add(
        timeseries("Received bandwidth per peer", [(rate(recv, s, "peer"), "{{peer}}")], "Bps"),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Bandwidth per link (sender → receiver)",
            [(rate(sent, f'{s}, neighbor!=""', "peer, neighbor"), "{{peer}} → {{neighbor}}")],
            "Bps",
            "Gossip traffic per edge; heartbeats to any peer (no neighbor label) left out.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Compression ratio per peer (dense fp32 / sent)",
            [(compression_ratio(s, "peer"), "{{peer}}")],
            "suffix:×",
            "How many times fewer bytes updates cost than dense fp32.",
            log=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries("Sent bandwidth by kind", [(rate(sent, s, "kind"), "{{kind}}")], "Bps"), 8, 8
    )
    lay.add(
        timeseries(
            "Bytes sent per gossip round",
            [
                (
                    rate(sent, s, "peer")
                    + " / "
                    + rate("gossipgrad_gossip_rounds_total", s, "peer"),
                    "{{peer}}",
                )
            ],
            "decbytes",
        ),
        8,
        8,
    )

    lay.row("Training")
    lay.add(
        timeseries(
            "Training loss per peer", [(f"gossipgrad_train_loss{{{s}}}", "{{peer}}")], "none"
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Eval accuracy per peer",
            [(f'gossipgrad_eval_metric{{name="accuracy", {s}}}', "{{peer}}")],
            "percentunit",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "All eval metrics", [(f"gossipgrad_eval_metric{{{s}}}", "{{peer}} {{name}}")], "none"
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Step rate",
            [(rate("gossipgrad_train_steps_total", s, "peer"), "{{peer}}")],
            "suffix: steps/s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Sample rate",
            [(rate("gossipgrad_samples_total", s, "peer"), "{{peer}}")],
            "suffix: samples/s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Gossip round rate",
            [(rate("gossipgrad_gossip_rounds_total", s, "peer"), "{{peer}}")],
            "suffix: rounds/s",
        ),
        8,
        8,
    )

    lay.row("Gossip")
    lay.add(
        timeseries(
            "Consensus distance per peer",
            [(f"gossipgrad_consensus_distance{{{s}}}", "{{peer}}")],
            "none",
            "||x_i - Σ_j w_ij x̂_j||, each peer's estimate (CHOCO-SGD).",
            log=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Error-feedback residual norm",
            [(f"gossipgrad_error_feedback_norm{{{s}}}", "{{peer}}")],
            "none",
            "What the compressor has not sent yet.",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Round latency quantiles (swarm)",
            [
                (quantile(q, "gossipgrad_round_duration_seconds", s), f"p{q * 100:g}")
                for q in QUANTILES
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Round latency p90 per peer",
            [(quantile(0.9, "gossipgrad_round_duration_seconds", s, "peer"), "{{peer}}")],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Push latency p90 per link",
            [
                (
                    quantile(0.9, "gossipgrad_push_duration_seconds", s, "peer, neighbor"),
                    "{{peer}} → {{neighbor}}",
                )
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Compress time p90 per peer",
            [(quantile(0.9, "gossipgrad_compress_duration_seconds", s, "peer"), "{{peer}}")],
            "s",
        ),
        8,
        8,
    )

    lay.row("Health")
    lay.add(
        timeseries(
            "Peers by state (each peer's view)",
            [(f"gossipgrad_peers{{{s}}}", "{{peer}} sees {{state}}")],
            "none",
        ),
        8,
        8,
    )
    lay.add(
        timeseries("Neighbours per peer", [(f"gossipgrad_neighbors{{{s}}}", "{{peer}}")], "none"),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Rejected updates by reason",
            [(rate("gossipgrad_rejected_updates_total", s, "reason"), "{{reason}}")],
            "cps",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Resyncs per link",
            [(rate("gossipgrad_resyncs_total", s, "peer, neighbor"), "{{peer}} → {{neighbor}}")],
            "cps",
        ),
        12,
        8,
    )
    lay.add(table("Build info", f"gossipgrad_build_info{{{s}}}"), 12, 8)
    return _dashboard(
        "gossipgrad-overview",
        "gossipgrad / swarm overview",
        "Every peer of a gossipgrad swarm: traffic, compression, training, gossip health.",
        lay,
        multi=True,
    )


def peer_drilldown() -> dict:
    """The per-peer drill-down dashboard."""
    s = 'peer="$peer"'
    sent, recv = "gossipgrad_sent_bytes_total", "gossipgrad_received_bytes_total"
    lay = Layout()
    lay.row("Peer")
    lay.add(stat("Up", f"sum(up{{{s}}})", "none", decimals=0), 4, 4)
    lay.add(stat("Neighbours", f"gossipgrad_neighbors{{{s}}}", "none", decimals=0), 4, 4)
    lay.add(stat("Steps", f"gossipgrad_train_steps_total{{{s}}}", "none", decimals=0), 4, 4)
    lay.add(
        stat("Gossip rounds", f"gossipgrad_gossip_rounds_total{{{s}}}", "none", decimals=0), 4, 4
    )
    lay.add(
        stat(
            "Compression ratio (since start)",
            f'sum(gossipgrad_dense_bytes_total{{{s}}}) / sum({sent}{{kind="update", {s}}})',
            "suffix:×",
            decimals=1,
        ),
        4,
        4,
    )
    lay.add(stat("Training loss", f"gossipgrad_train_loss{{{s}}}", "none", decimals=4), 4, 4)

    lay.row("Traffic per neighbour")
    lay.add(
        timeseries(
            "Sent by neighbour and kind",
            [(rate(sent, s, "neighbor, kind"), "→ {{neighbor}} {{kind}}")],
            "Bps",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Received by neighbour and kind",
            [(rate(recv, s, "neighbor, kind"), "← {{neighbor}} {{kind}}")],
            "Bps",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Compression ratio per neighbour",
            [(compression_ratio(s, "neighbor"), "→ {{neighbor}}")],
            "suffix:×",
            log=True,
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Update bandwidth: dense fp32 equivalent vs wire",
            [
                (rate("gossipgrad_dense_bytes_total", s), "dense fp32"),
                (rate(sent, s + ', kind="update"'), "wire"),
            ],
            "Bps",
            log=True,
        ),
        12,
        8,
    )

    lay.row("Training")
    lay.add(timeseries("Training loss", [(f"gossipgrad_train_loss{{{s}}}", "loss")], "none"), 8, 8)
    lay.add(
        timeseries("Eval metrics", [(f"gossipgrad_eval_metric{{{s}}}", "{{name}}")], "none"), 8, 8
    )
    lay.add(
        timeseries(
            "Steps, samples and rounds per second",
            [
                (rate("gossipgrad_train_steps_total", s), "steps/s"),
                (rate("gossipgrad_samples_total", s), "samples/s"),
                (rate("gossipgrad_gossip_rounds_total", s), "rounds/s"),
            ],
            "none",
            log=True,
        ),
        8,
        8,
    )

    lay.row("Gossip")
    lay.add(
        timeseries(
            "Round latency quantiles",
            [
                (quantile(q, "gossipgrad_round_duration_seconds", s), f"p{q * 100:g}")
                for q in QUANTILES
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Push latency per neighbour (p50, p90)",
            [
                (
                    quantile(q, "gossipgrad_push_duration_seconds", s, "neighbor"),
                    f"→ {{{{neighbor}}}} p{q * 100:g}",
                )
                for q in (0.5, 0.9)
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Compress time quantiles",
            [
                (quantile(q, "gossipgrad_compress_duration_seconds", s), f"p{q * 100:g}")
                for q in QUANTILES
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Consensus distance",
            [(f"gossipgrad_consensus_distance{{{s}}}", "consensus distance")],
            "none",
            log=True,
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Error-feedback residual norm",
            [(f"gossipgrad_error_feedback_norm{{{s}}}", "residual norm")],
            "none",
        ),
        12,
        8,
    )

    lay.row("Health")
    lay.add(timeseries("Peers by state", [(f"gossipgrad_peers{{{s}}}", "{{state}}")], "none"), 8, 8)
    lay.add(
        timeseries(
            "Rejected updates by reason",
            [(rate("gossipgrad_rejected_updates_total", s, "reason"), "{{reason}}")],
            "cps",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Resyncs per neighbour",
            [(rate("gossipgrad_resyncs_total", s, "neighbor"), "{{neighbor}}")],
            "cps",
        ),
        8,
        8,
    )
    lay.add(table("Build info", f"gossipgrad_build_info{{{s}}}"), 24, 5)
    return _dashboard(
        "gossipgrad-peer",
        "gossipgrad / peer drill-down",
        "One gossipgrad peer: traffic per neighbour, compression, training, gossip latency.",
        lay,
        multi=False,
    )


def build_dashboards() -> dict[str, dict]:
    """Every dashboard, keyed by its file name under grafana/dashboards/."""
    return {"gossipgrad-overview.json": overview(), "gossipgrad-peer.json": peer_drilldown()}


def render(dashboard: dict) -> str:
    """The exact text committed for a dashboard."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate grafana/dashboards/*.json.")
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    stale = []
    for name, dash in build_dashboards().items():
        path = args.out_dir / name
        text = render(dash)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        sys.stderr.write(
            "stale dashboards (run scripts/make_dashboards.py): " + ", ".join(stale) + "\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
