"""``gossipgrad-peer``: one peer (single-select ``peer``) drilled down per neighbour and
message kind, one row builder per section."""

from __future__ import annotations

from .frame import dashboard
from .layout import Layout
from .panels import Panel, rejected_by_reason, stat, table, timeseries
from .promql import (
    RECEIVED,
    SENT,
    compression_ratio,
    lifetime_compression_ratio,
    quantile,
    quantiles,
    rate,
)

SELECTOR = 'peer="$peer"'


def _peer_row(lay: Layout, s: str) -> None:
    lay.row("Peer")
    lay.add_all(
        [
            stat("Up", f"sum(up{{{s}}})", "none", decimals=0),
            stat("Neighbours", f"gossipgrad_neighbors{{{s}}}", "none", decimals=0),
            stat("Steps", f"gossipgrad_train_steps_total{{{s}}}", "none", decimals=0),
            stat("Gossip rounds", f"gossipgrad_gossip_rounds_total{{{s}}}", "none", decimals=0),
            stat(
                "Compression ratio (since start)",
                lifetime_compression_ratio(s),
                "suffix:×",
                decimals=1,
            ),
            stat("Training loss", f"gossipgrad_train_loss{{{s}}}", "none", decimals=4),
        ],
        4,
        4,
    )


def _traffic_panels(s: str) -> list[Panel]:
    return [
        timeseries(
            "Sent by neighbour and kind",
            [(rate(SENT, s, "neighbor, kind"), "→ {{neighbor}} {{kind}}")],
            "Bps",
        ),
        timeseries(
            "Received by neighbour and kind",
            [(rate(RECEIVED, s, "neighbor, kind"), "← {{neighbor}} {{kind}}")],
            "Bps",
        ),
        timeseries(
            "Compression ratio per neighbour",
            [(compression_ratio(s, "neighbor"), "→ {{neighbor}}")],
            "suffix:×",
            log=True,
        ),
        timeseries(
            "Update bandwidth: dense fp32 equivalent vs wire",
            [
                (rate("gossipgrad_dense_bytes_total", s), "dense fp32"),
                (rate(SENT, s + ', kind="update"'), "wire"),
            ],
            "Bps",
            log=True,
        ),
    ]


def _training_panels(s: str) -> list[Panel]:
    return [
        timeseries("Training loss", [(f"gossipgrad_train_loss{{{s}}}", "loss")], "none"),
        timeseries("Eval metrics", [(f"gossipgrad_eval_metric{{{s}}}", "{{name}}")], "none"),
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
    ]


def _gossip_row(lay: Layout, s: str) -> None:
    lay.row("Gossip")
    push = [
        (
            quantile(q, "gossipgrad_push_duration_seconds", s, "neighbor"),
            f"→ {{{{neighbor}}}} p{q * 100:g}",
        )
        for q in (0.5, 0.9)
    ]
    lay.add_all(
        [
            timeseries(
                "Round latency quantiles", quantiles("gossipgrad_round_duration_seconds", s), "s"
            ),
            timeseries("Push latency per neighbour (p50, p90)", push, "s"),
            timeseries(
                "Compress time quantiles", quantiles("gossipgrad_compress_duration_seconds", s), "s"
            ),
        ]
    )
    lay.add_all(
        [
            timeseries(
                "Consensus distance",
                [(f"gossipgrad_consensus_distance{{{s}}}", "consensus distance")],
                "none",
                log=True,
            ),
            timeseries(
                "Error-feedback residual norm",
                [(f"gossipgrad_error_feedback_norm{{{s}}}", "residual norm")],
                "none",
            ),
        ],
        12,
        8,
    )


def _health_row(lay: Layout, s: str) -> None:
    lay.row("Health")
    lay.add_all(
        [
            timeseries("Peers by state", [(f"gossipgrad_peers{{{s}}}", "{{state}}")], "none"),
            rejected_by_reason(s),
            timeseries(
                "Resyncs per neighbour",
                [(rate("gossipgrad_resyncs_total", s, "neighbor"), "{{neighbor}}")],
                "cps",
            ),
        ]
    )
    lay.add(
        stat(
            "First exchange after start",
            f"gossipgrad_first_mix_seconds{{{s}}}",
            "s",
            "Seconds from this process's gossip server start to its first round that mixed a "
            "neighbour's copy: how fast a restarted or joining peer rejoined.",
        ),
        6,
        5,
    )
    lay.add(table("Build info", f"gossipgrad_build_info{{{s}}}"), 18, 5)


def peer_drilldown() -> dict:
    """The per-peer drill-down dashboard."""
    s = SELECTOR
    lay = Layout()
    _peer_row(lay, s)
    lay.row("Traffic per neighbour")
    lay.add_all(_traffic_panels(s), 12, 8)
    lay.row("Training")
    lay.add_all(_training_panels(s))
    _gossip_row(lay, s)
    _health_row(lay, s)
    return dashboard(
        "gossipgrad-peer",
        "gossipgrad / peer drill-down",
        "One gossipgrad peer: traffic per neighbour, compression, training, gossip latency.",
        lay,
        multi=False,
    )
