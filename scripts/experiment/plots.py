"""The report's PNG plots (matplotlib, Agg backend, no display needed).

loss_vs_step.png     training loss (moving average) per peer and per baseline
loss_vs_bytes.png    the same against bytes each process sent (log x)
loss_vs_time.png     the same against wall-clock seconds since training started
bytes_per_link.png   bytes per link: swarm per neighbour edge (local) or per site access
                     link as the kernel counted it (netns); baselines per rank
metric_vs_time.png   evaluation metric against training seconds (evaluation time excluded):
                     each peer, the peers' mean, each baseline, and DDP's final as a line
                     (only when the report has timed evaluations)
consensus_vs_step.png  each peer's consensus-distance estimate over its steps (log y; only
                     when the swarm's samples carry it)

Across runs, ``bytes_plot`` draws one point per system and run, final metric against bytes
sent per process (log x): the loss-vs-bytes tables of BENCHMARKS.md as a figure, from several
report.json files (``python -m gossipgrad.experiment.plots --help``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossipgrad.experiment import analysis
from gossipgrad.experiment.records import Report
from gossipgrad.peer.config.recommended import DEFAULT_ALGORITHM

PLOTS = ("loss_vs_step.png", "loss_vs_bytes.png", "loss_vs_time.png", "bytes_per_link.png",
         "metric_vs_time.png", "consensus_vs_step.png")  # fmt: skip
COLORS = {
    "ddp": "tab:red",
    "powersgd": "tab:purple",
    "hivemind": "tab:olive",
    "diloco": "tab:green",
    "diloco-int8": "tab:cyan",
}
PEER_COLOR = "tab:blue"


def _color(name: str) -> str:
    return COLORS.get(name, "tab:gray")


def _figure() -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _finish(fig: Any, ax: Any, report: Report, path: Path, xlabel: str, ylabel: str) -> None:
    """Labels, the run's title, grid and legend; save as PNG and free the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{report.name}: {report.task}, {report.peers} peers ({report.mode})")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a report without curves draws an empty plot
        ax.legend()
    _save(fig, path)


def loss_plot(report: Report, x_key: str, xlabel: str, path: Path, logx: bool) -> None:
    """Smoothed training loss of every peer and baseline against ``x_key``."""
    fig, ax = _figure()
    labelled = set()
    for label, xs, ys in analysis.loss_curves(report, x_key):
        is_peer = label not in report.baselines
        name = "swarm peers" if is_peer else label
        if logx:
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0]
            xs, ys = [x for x, _ in pts], [y for _, y in pts]
        color = PEER_COLOR if is_peer else _color(label)
        ax.plot(xs, ys, color=color, lw=0.8 if is_peer else 1.6, alpha=0.6 if is_peer else 1.0,
                label=None if name in labelled else name)  # fmt: skip
        labelled.add(name)
    if logx:
        ax.set_xscale("log")
    _finish(fig, ax, report, path, xlabel, "train loss (moving average)")


def link_plot(report: Report, path: Path) -> None:
    """Bytes per link, one panel per system, on one shared log axis."""
    import matplotlib.pyplot as plt

    systems = [("swarm", report.swarm.link_bytes)]
    systems += [(n, b.link_bytes) for n, b in report.baselines.items()]
    systems = [(n, links) for n, links in systems if links] or [("swarm", {})]
    # One log axis shared by all systems, from a decade under the smallest bar: differences
    # between systems read as orders of magnitude, not exaggerated by per-panel limits.
    fig, axes = plt.subplots(
        len(systems), 1, figsize=(8, 2.6 * len(systems)), squeeze=False, sharey=True
    )
    values = [v for _, links in systems for v in links.values() if v > 0]
    for ax, (name, links) in zip(axes[:, 0], systems, strict=True):
        labels = list(links)
        ax.bar(range(len(labels)), [max(links[k], 1) for k in labels],
               color=COLORS.get(name, PEER_COLOR))  # fmt: skip
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        if values:
            ax.set_ylim(bottom=min(values) / 10, top=max(values) * 2)
        ax.set_ylabel("bytes")
        ax.set_title(f"{name}: bytes per link", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def _plot_points(ax: Any, pts: list[analysis.Point], **style: Any) -> None:
    ax.plot([t for _, t, _ in pts], [v for _, _, v in pts], **style)


def metric_plot(report: Report, path: Path) -> None:
    """Evaluation metric against training seconds: peers, their mean, baselines, DDP final."""
    metric = analysis.report_metric(report)
    fig, ax = _figure()
    label: str | None = "swarm peers"
    for p in analysis.done_peers(report):
        pts = analysis.eval_points(p, metric)
        if pts:
            _plot_points(ax, pts, color=PEER_COLOR, lw=0.8, alpha=0.5, marker=".", label=label)
            label = None
    mean = analysis.swarm_points(report, metric)
    if mean:
        _plot_points(ax, mean, color=PEER_COLOR, lw=2.4, marker="o", label="swarm mean")
    for name, b in report.baselines.items():
        pts = analysis.eval_points(b, metric)
        if pts:
            _plot_points(ax, pts, color=_color(name), lw=1.6, marker="o", label=name)
    ddp = report.baselines.get("ddp")
    if ddp is not None and ddp.final and metric in ddp.final:
        ax.axhline(ddp.final[metric], color=COLORS["ddp"], ls="--", lw=1, label="DDP final")
    _finish(fig, ax, report, path, "training seconds (evaluation excluded)", f"eval {metric}")


def consensus_plot(report: Report, path: Path) -> None:
    """Each peer's consensus-distance estimate over its steps (log y)."""
    import matplotlib.pyplot as plt

    fig, ax = _figure()
    cmap = plt.get_cmap("tab10")
    for i, (pid, steps, values) in enumerate(analysis.consensus_series(report)):
        ax.plot(steps, values, color=cmap(i % 10), lw=1.0, label=pid)
    ax.set_yscale("log")
    ax.set_xlabel("local step")
    ax.set_ylabel("consensus distance estimate")
    ax.set_title(f"{report.name}: each peer's consensus-distance estimate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def available_plots(report: Report) -> list[str]:
    """The names in ``PLOTS`` this report has data for (older reports lack the last two)."""
    metric = analysis.report_metric(report)
    procs = [*analysis.done_peers(report), *report.baselines.values()]
    skip = set()
    if not any(analysis.eval_points(p, metric) for p in procs):
        skip.add("metric_vs_time.png")
    if not analysis.consensus_series(report):
        skip.add("consensus_vs_step.png")
    return [name for name in PLOTS if name not in skip]


def plot_all(report: Report, out: Path) -> list[Path]:
    """Write the PNG plots this report has data for into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    draw: dict[str, Callable[[Path], None]] = {
        "loss_vs_step.png": lambda p: loss_plot(report, "step", "local step", p, logx=False),
        "loss_vs_bytes.png": lambda p: loss_plot(
            report, "sent_bytes", "bytes sent per process", p, logx=True
        ),
        "loss_vs_time.png": lambda p: loss_plot(
            report, "seconds", "wall-clock seconds since training started", p, logx=False
        ),
        "bytes_per_link.png": lambda p: link_plot(report, p),
        "metric_vs_time.png": lambda p: metric_plot(report, p),
        "consensus_vs_step.png": lambda p: consensus_plot(report, p),
    }
    paths = []
    for name in available_plots(report):
        draw[name](out / name)
        paths.append(out / name)
    return paths


@dataclass(frozen=True)
class BytesPoint:
    """One system at the end of one run: ``family`` names the line it is drawn on (the swarm's
    algorithm or the baseline's name), ``label`` the point (with H where it has one)."""

    family: str
    label: str
    sent_bytes: float
    value: float


def _with_h(name: str, h: int | None) -> str:
    return f"{name} H={h}" if h and h > 1 else name


def system_points(report: Report, metric: str | None = None) -> list[BytesPoint]:
    """The swarm's point (mean final metric of the peers that finished, mean bytes sent per
    peer) and one per baseline that finished (rank 0's final metric, mean bytes per rank).
    ``metric``: which of the final evaluation's values (default: the run's headline metric;
    "loss" on a classification task, whose headline is accuracy)."""
    swarm_metric = metric or analysis.report_metric(report)
    points = []
    peers = [p for p in analysis.done_peers(report) if p.final and swarm_metric in p.final]
    if peers and report.swarm.mean_sent_bytes:
        gossip = (report.spec.get("peer_raw") or {}).get("gossip") or {}
        algorithm = str(gossip.get("algorithm") or DEFAULT_ALGORITHM)
        value = sum(p.final[swarm_metric] for p in peers if p.final) / len(peers)
        label = _with_h(algorithm, report.local_steps)
        points.append(BytesPoint(algorithm, label, report.swarm.mean_sent_bytes, value))
    for name, b in report.baselines.items():
        wanted = metric or b.metric
        if b.final and wanted in b.final and b.mean_sent_bytes:
            label = _with_h(name, b.local_steps)
            points.append(BytesPoint(name, label, b.mean_sent_bytes, b.final[wanted]))
    return points


def bytes_plot(points: Sequence[BytesPoint], path: Path, title: str, ylabel: str) -> int:
    """Final metric against bytes sent per process (log x), one marker per point, the points
    of one family joined in order of bytes (an H curve), each labelled; returns the number of
    markers drawn."""
    import matplotlib

    matplotlib.use("Agg")
    fig, ax = _figure()
    families = list(dict.fromkeys(p.family for p in points))
    markers = "os^vDP*Xp<>"
    for i, family in enumerate(families):
        pts = sorted((p for p in points if p.family == family), key=lambda p: p.sent_bytes)
        ax.plot([p.sent_bytes for p in pts], [p.value for p in pts], marker=markers[i % 11],
                color=COLORS.get(family, f"C{i % 10}"), lw=1.2, label=family)  # fmt: skip
        for p in pts:
            ax.annotate(p.label, (p.sent_bytes, p.value), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per process (log)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if points:
        ax.legend(fontsize=7)
    drawn = sum(len(line.get_xdata()) for line in ax.lines)
    _save(fig, path)
    return drawn


def _point(text: str) -> BytesPoint:
    """``FAMILY[/LABEL]=BYTES:VALUE`` (a row measured earlier, with no report.json at hand)."""
    try:
        name, numbers = text.rsplit("=", 1)
        sent, value = numbers.split(":", 1)
        family, _, label = name.partition("/")
        return BytesPoint(family, label or family, float(sent), float(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: want FAMILY[/LABEL]=BYTES:VALUE") from e


def main(argv: Sequence[str] | None = None) -> int:
    """Draw ``bytes_plot`` from run directories (their report.json) and extra points."""
    from gossipgrad.experiment.report import load_report

    ap = argparse.ArgumentParser(
        prog="python -m gossipgrad.experiment.plots",
        description="Final metric against bytes sent per process, one point per system and "
        "run, from several experiment directories (report.json).",
    )
    ap.add_argument("runs", nargs="*", type=Path, help="experiment output directories")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--point", type=_point, action="append", default=[],
                    help="an extra point FAMILY[/LABEL]=BYTES:VALUE (repeatable)")  # fmt: skip
    ap.add_argument("--metric", default=None,
                    help="the final evaluation value to draw from the runs, e.g. loss on a "
                    "classification task (default: each run's headline metric)")  # fmt: skip
    ap.add_argument("--title", default="final metric against bytes per process")
    ap.add_argument("--ylabel", default="final validation metric")
    args = ap.parse_args(argv)
    points = [pt for run in args.runs for pt in system_points(load_report(run), args.metric)]
    points += args.point
    if not points:
        ap.error("no finished system in these runs and no --point")
    bytes_plot(points, args.out, args.title, args.ylabel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
