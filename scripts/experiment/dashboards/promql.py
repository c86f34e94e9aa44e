"""PromQL expressions the dashboards share: rates, histogram quantiles, compression ratio.

``sel`` is a label selector without braces (``peer=~"$peer"``); ``by`` the labels to keep.
"""

from __future__ import annotations

RI = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
SENT = "gossipgrad_sent_bytes_total"
RECEIVED = "gossipgrad_received_bytes_total"
RELAY_FORWARDED = "gossipgrad_relay_forwarded_bytes_total"
RELAY_TUNNELS = "gossipgrad_relay_tunnels_total"


def rate(metric: str, sel: str, by: str = "") -> str:
    """``sum by (by) (rate(metric{sel}[$__rate_interval]))``."""
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}(rate({metric}{{{sel}}}[{RI}]))"


def quantile(q: float, hist: str, sel: str, by: str = "") -> str:
    """``histogram_quantile`` over a histogram's buckets, aggregated by ``by`` (plus ``le``)."""
    keep = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({keep}) (rate({hist}_bucket{{{sel}}}[{RI}])))"


def quantiles(hist: str, sel: str) -> list[tuple[str, str]]:
    """(query, legend) of each of ``QUANTILES`` of a histogram, legends ``p50``, ``p90``..."""
    return [(quantile(q, hist, sel), f"p{q * 100:g}") for q in QUANTILES]


def compression_ratio(sel: str, by: str) -> str:
    """Dense-fp32 bytes over wire bytes of updates: how many times smaller updates travel."""
    dense = rate("gossipgrad_dense_bytes_total", sel, by)
    wire = rate(SENT, f'{sel}, kind="update"', by)
    return f"{dense} / {wire}"


def lifetime_compression_ratio(sel: str) -> str:
    """Dense-fp32 bytes over wire bytes of updates since each peer started (counter totals)."""
    return f'sum(gossipgrad_dense_bytes_total{{{sel}}}) / sum({SENT}{{kind="update", {sel}}})'
