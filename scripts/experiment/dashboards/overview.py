"""``gossipgrad-overview``: every peer of a swarm (multi-select ``peer``, default all), one row
builder per section."""

from __future__ import annotations

from .frame import dashboard
from .layout import Layout
from .panels import Panel, rejected_by_reason, stat, table, timeseries
from .promql import (
    RECEIVED,
    RELAY_FORWARDED,
    RELAY_TUNNELS,
    SENT,
    compression_ratio,
    lifetime_compression_ratio,
    quantile,
    quantiles,
    rate,
)

SELECTOR = 'peer=~"$peer"'


def _swarm_row(lay: Layout, s: str) -> None:
    lay.row("Swarm")
    alive = f'min(gossipgrad_peers{{state="alive", {s}}})'
    rejected = f"sum(gossipgrad_rejected_updates_total{{{s}}})"
    lay.add_all(
        [
            stat("Peers up", f"sum(up{{{s}}})", "none", "Targets Prometheus scrapes.", 0),
            stat(
                "Peers seen alive (worst view)",
                alive,
                "none",
                "Fewest other peers any peer sees alive.",
                0,
            ),
            stat(
                "Compression ratio (since start)",
                lifetime_compression_ratio(s),
                "suffix:×",
                "Dense fp32 bytes / wire bytes of updates, over the peers' lifetime.",
                1,
            ),
            stat("Bytes sent (since start)", f"sum({SENT}{{{s}}})", "decbytes"),
            stat("Rejected (since start)", rejected, "none"),
            stat("Resyncs (since start)", f"sum(gossipgrad_resyncs_total{{{s}}})", "none"),
        ],
        4,
        4,
    )


def _traffic_panels(s: str) -> list[Panel]:
    per_round = rate(SENT, s, "peer") + " / " + rate("gossipgrad_gossip_rounds_total", s, "peer")
    return [
        timeseries("Sent bandwidth per peer", [(rate(SENT, s, "peer"), "{{peer}}")], "Bps"),
        timeseries("Received bandwidth per peer", [(rate(RECEIVED, s, "peer"), "{{peer}}")], "Bps"),
        timeseries(
            "Bandwidth per link (sender → receiver)",
            [(rate(SENT, f'{s}, neighbor!=""', "peer, neighbor"), "{{peer}} → {{neighbor}}")],
            "Bps",
            "Gossip traffic per edge; heartbeats to any peer (no neighbor label) left out.",
        ),
        timeseries(
            "Compression ratio per peer (dense fp32 / sent)",
            [(compression_ratio(s, "peer"), "{{peer}}")],
            "suffix:×",
            "How many times fewer bytes updates cost than dense fp32.",
            log=True,
        ),
        timeseries("Sent bandwidth by kind", [(rate(SENT, s, "kind"), "{{kind}}")], "Bps"),
        timeseries("Bytes sent per gossip round", [(per_round, "{{peer}}")], "decbytes"),
        timeseries(
            "Relayed bandwidth (relay → attached peer)",
            [(rate(RELAY_FORWARDED, s, "peer, attached"), "{{peer}} → {{attached}}")],
            "Bps",
            "Bytes each relay forwards to and from each unreachable peer attached to it, both "
            "ways (its tunnels: calls to that peer, and that peer's calls to peers behind it).",
        ),
        timeseries(
            "Relay tunnels opened since start (relay, how)",
            [(f"sum by (peer, how) ({RELAY_TUNNELS}{{{s}}})", "{{peer}} {{how}}")],
            "none",
            "Tunnels each relay opened to the peers attached to it (one per connection to "
            "such a peer): spliced at its raw tunnel listener, or carried in gRPC calls (the "
            "listener off, or an end that could not reach it: several times the relay's CPU "
            "per byte).",
        ),
    ]


def _training_panels(s: str) -> list[Panel]:
    def per_peer_rate(title: str, counter: str, unit: str) -> Panel:
        return timeseries(title, [(rate(counter, s, "peer"), "{{peer}}")], unit)

    accuracy = f'gossipgrad_eval_metric{{name="accuracy", {s}}}'
    return [
        timeseries(
            "Training loss per peer", [(f"gossipgrad_train_loss{{{s}}}", "{{peer}}")], "none"
        ),
        timeseries("Eval accuracy per peer", [(accuracy, "{{peer}}")], "percentunit"),
        timeseries(
            "All eval metrics", [(f"gossipgrad_eval_metric{{{s}}}", "{{peer}} {{name}}")], "none"
        ),
        per_peer_rate("Step rate", "gossipgrad_train_steps_total", "suffix: steps/s"),
        per_peer_rate("Sample rate", "gossipgrad_samples_total", "suffix: samples/s"),
        per_peer_rate("Gossip round rate", "gossipgrad_gossip_rounds_total", "suffix: rounds/s"),
    ]


def _gossip_panels(s: str) -> list[Panel]:
    def p90(title: str, hist: str, by: str, legend: str) -> Panel:
        return timeseries(title, [(quantile(0.9, hist, s, by), legend)], "s")

    return [
        timeseries(
            "Consensus distance per peer",
            [(f"gossipgrad_consensus_distance{{{s}}}", "{{peer}}")],
            "none",
            "||x_i - Σ_j w_ij x̂_j||, each peer's estimate (CHOCO-SGD).",
            log=True,
        ),
        timeseries(
            "Error-feedback residual norm",
            [(f"gossipgrad_error_feedback_norm{{{s}}}", "{{peer}}")],
            "none",
            "What the compressor has not sent yet.",
        ),
        timeseries(
            "Compute utilization per peer",
            [(f"1 - {rate('gossipgrad_gossip_blocking_seconds_total', s, 'peer')}", "{{peer}}")],
            "percentunit",
            "Share of wall time the training thread computes rather than waits for gossip "
            "(rounds, gradient exchanges): the cost of the network's latency and bandwidth.",
        ),
        timeseries(
            "Round latency quantiles (swarm)",
            quantiles("gossipgrad_round_duration_seconds", s),
            "s",
        ),
        p90("Round latency p90 per peer", "gossipgrad_round_duration_seconds", "peer", "{{peer}}"),
        p90(
            "Push latency p90 per link",
            "gossipgrad_push_duration_seconds",
            "peer, neighbor",
            "{{peer}} → {{neighbor}}",
        ),
        p90(
            "Compress time p90 per peer", "gossipgrad_compress_duration_seconds", "peer", "{{peer}}"
        ),
    ]


def _health_row(lay: Layout, s: str) -> None:
    lay.row("Health")
    lay.add_all(
        [
            timeseries(
                "Peers by state (each peer's view)",
                [(f"gossipgrad_peers{{{s}}}", "{{peer}} sees {{state}}")],
                "none",
            ),
            timeseries(
                "Neighbours per peer", [(f"gossipgrad_neighbors{{{s}}}", "{{peer}}")], "none"
            ),
            rejected_by_reason(s),
        ]
    )
    resyncs = rate("gossipgrad_resyncs_total", s, "peer, neighbor")
    lay.add(timeseries("Resyncs per link", [(resyncs, "{{peer}} → {{neighbor}}")], "cps"), 12, 8)
    lay.add(table("Build info", f"gossipgrad_build_info{{{s}}}"), 12, 8)


def overview() -> dict:
    """The swarm overview dashboard."""
    s = SELECTOR
    lay = Layout()
    _swarm_row(lay, s)
    lay.row("Traffic")
    lay.add_all(_traffic_panels(s))
    lay.row("Training")
    lay.add_all(_training_panels(s))
    lay.row("Gossip")
    lay.add_all(_gossip_panels(s))
    _health_row(lay, s)
    return dashboard(
        "gossipgrad-overview",
        "gossipgrad / swarm overview",
        "Every peer of a gossipgrad swarm: traffic, compression, training, gossip health.",
        lay,
        multi=True,
    )
