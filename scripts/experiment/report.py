"""Turn a finished experiment's ``report.json`` into PNG plots and a markdown summary.

Plots (matplotlib, Agg backend, no display needed):
  loss_vs_step.png     training loss (moving average) per peer and per baseline
  loss_vs_bytes.png    the same against bytes each process sent (log x)
  loss_vs_time.png     the same against wall-clock seconds since training started
  bytes_per_link.png   bytes per link: swarm per neighbour edge (local) or per site access
                       link as the kernel counted it (netns); baselines per rank

``write_outputs(out, report)`` is what the runner calls; ``gossipgrad-experiment --report DIR``
redraws them from an existing report.json.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLOTS = ("loss_vs_step.png", "loss_vs_bytes.png", "loss_vs_time.png", "bytes_per_link.png")
COLORS = {"ddp": "tab:red", "powersgd": "tab:purple"}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (train loss on one batch is noisy)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _window(n: int) -> int:
    return max(1, n // 20)


def _curves(report: dict[str, Any], x_key: str) -> list[tuple[str, str, list, list]]:
    """(label, color, x, smoothed loss) per peer and per baseline rank 0."""
    curves = []
    for p in report["swarm"]["peers"]:
        hist = [h for h in p.get("history", []) if h.get("loss") is not None]
        if hist:
            ys = smooth([h["loss"] for h in hist], _window(len(hist)))
            curves.append((p["id"], "tab:blue", [h[x_key] for h in hist], ys))
    for name, b in report.get("baselines", {}).items():
        rank0 = (b.get("ranks") or [None])[0]
        if rank0 and rank0.get("history"):
            hist = rank0["history"]
            ys = smooth([h["loss"] for h in hist], _window(len(hist)))
            curves.append((name, COLORS.get(name, "tab:gray"), [h[x_key] for h in hist], ys))
    return curves


def _loss_plot(report: dict[str, Any], x_key: str, xlabel: str, path: Path, logx: bool) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labelled = set()
    for label, color, xs, ys in _curves(report, x_key):
        is_peer = label not in report.get("baselines", {})
        name = "swarm peers" if is_peer else label
        if logx:
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0]
            xs, ys = [x for x, _ in pts], [y for _, y in pts]
        ax.plot(xs, ys, color=color, lw=0.8 if is_peer else 1.6, alpha=0.6 if is_peer else 1.0,
                label=None if name in labelled else name)  # fmt: skip
        labelled.add(name)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("train loss (moving average)")
    ax.set_title(f"{report['name']}: {report['task']}, {report['peers']} peers ({report['mode']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _link_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    systems = [("swarm", report["swarm"].get("link_bytes", {}))]
    systems += [(n, b.get("link_bytes", {})) for n, b in report.get("baselines", {}).items()]
    systems = [(n, links) for n, links in systems if links]
    if not systems:
        systems = [("swarm", {})]
    # One log axis shared by all systems, from a decade under the smallest bar: differences
    # between systems read as orders of magnitude, not exaggerated by per-panel limits.
    fig, axes = plt.subplots(
        len(systems), 1, figsize=(8, 2.6 * len(systems)), squeeze=False, sharey=True
    )
    values = [v for _, links in systems for v in links.values() if v > 0]
    for ax, (name, links) in zip(axes[:, 0], systems, strict=True):
        labels = list(links)
        ax.bar(range(len(labels)), [max(links[k], 1) for k in labels],
               color=COLORS.get(name, "tab:blue"))  # fmt: skip
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        if values:
            ax.set_ylim(bottom=min(values) / 10, top=max(values) * 2)
        ax.set_ylabel("bytes")
        ax.set_title(f"{name}: bytes per link", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_all(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the four PNG plots into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    paths = [out / name for name in PLOTS]
    _loss_plot(report, "step", "local step", paths[0], logx=False)
    _loss_plot(report, "sent_bytes", "bytes sent per process", paths[1], logx=True)
    _loss_plot(report, "seconds", "wall-clock seconds since training started", paths[2], False)
    _link_plot(report, paths[3])
    return paths


def _fmt_mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.3f}"


def kernel_up_bytes(links: dict[str, int]) -> float | None:
    """Mean bytes a site uploaded as the kernel counted them (netns mode), else None."""
    ups = [v for k, v in links.items() if k.endswith(" up")]
    return sum(ups) / len(ups) if ups else None


def summary_rows(report: dict[str, Any]) -> list[dict[str, str]]:
    """One row per system: the swarm (mean over peers) and each baseline."""
    rows = []
    netns = report.get("mode") == "netns"
    swarm = report["swarm"]
    ddp_sent = report.get("baselines", {}).get("ddp", {}).get("mean_sent_bytes")
    metric = swarm.get("metric", "accuracy")
    peers = [p for p in swarm["peers"] if p.get("final")]
    if peers:
        vals = [p["final"][metric] for p in peers]
        sent = swarm["mean_sent_bytes"]
        rows.append(
            {
                "system": f"gossipgrad ({report.get('codec')}, {report.get('topology')})",
                metric: f"{sum(vals) / len(vals):.4f} ({min(vals):.4f}-{max(vals):.4f})",
                "eval loss": f"{sum(p['final'].get('loss', 0) for p in peers) / len(peers):.4f}",
                "steps": str(max(p["steps"] for p in peers)),
                "sent MB/proc": _fmt_mb(sent),
                "dense-equiv MB/proc": _fmt_mb(swarm.get("mean_dense_bytes")),
                "vs DDP bytes": f"{ddp_sent / sent:,.0f}x fewer" if ddp_sent and sent else "-",
                "train s": f"{swarm.get('wall_seconds', 0):.1f}",
            }
        )
        if netns:
            rows[-1]["kernel MB up/site"] = _fmt_mb(kernel_up_bytes(swarm.get("link_bytes", {})))
    for name, b in report.get("baselines", {}).items():
        if not b.get("final"):
            rows.append({"system": name, metric: "failed"})
            continue
        sent = b["mean_sent_bytes"]
        rows.append(
            {
                "system": name if name != "powersgd" else f"powersgd (rank {b['powersgd_rank']})",
                metric: f"{b['final'][b['metric']]:.4f}",
                "eval loss": f"{b['final'].get('loss', 0):.4f}",
                "steps": str(b["steps"]),
                "sent MB/proc": _fmt_mb(sent),
                "dense-equiv MB/proc": _fmt_mb(b.get("dense_bytes_per_rank")),
                "vs DDP bytes": f"{ddp_sent / sent:,.1f}x fewer" if ddp_sent and sent else "-",
                "train s": f"{b['wall_seconds']:.1f}",
            }
        )
        if netns:
            rows[-1]["kernel MB up/site"] = _fmt_mb(kernel_up_bytes(b.get("link_bytes", {})))
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The summary table plus the swarm's consensus distance and the plots."""
    rows = summary_rows(report)
    cols = list(rows[0]) if rows else ["system"]
    lines = [
        f"# {report['name']}",
        "",
        f"{report['task']}, {report['peers']} peers, {report['mode']} mode, seed "
        f"{report['seed']}, {report['steps']} steps of batch {report['batch_size']} per process.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(r.get(c, "-") for c in cols) + " |")
    swarm = report["swarm"]
    if swarm.get("consensus_distance") is not None:
        lines += [
            "",
            f"Swarm consensus distance (1/n) Σ‖x_i − x̄‖² = {swarm['consensus_distance']:.3e} "
            f"({swarm['relative_consensus_distance']:.2e} of ‖x̄‖²).",
        ]
    lines += [
        "",
        "Bytes: swarm = what each peer's gossip put on the wire (its counters); baselines = "
        "ring all-reduce traffic per rank, 2(n−1)/n × each all-reduce payload. Kernel MB "
        "(netns): what each site's link carried, headers, acks and framing included. "
        "Train s: wall-clock of the training loop (start-up excluded).",
        "",
        *[f"![{p}]({p})" for p in PLOTS],
        "",
    ]
    return "\n".join(lines)


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    """report.json, summary.md and the PNG plots into ``out``."""
    out = Path(out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "summary.md").write_text(markdown(report))
    try:
        plot_all(report, out)
    except ImportError as err:
        log.warning("no plots: %s (pip install 'gossipgrad[plots]')", err)
    log.info("report written to %s", out)
