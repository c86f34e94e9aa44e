"""Turn a finished experiment's ``report.json`` into PNG plots and a markdown summary.

Plots (matplotlib, Agg backend, no display needed):
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

``time_to_target(report)`` is when each system first reached DDP's final metric (and a looser
target, within 1 point of it); ``write_outputs`` stores it as ``report["time_to_target"]`` and
summarises it in summary.md.

``write_outputs(out, report)`` is what the runner calls; ``gossipgrad-experiment --report DIR``
redraws them from an existing report.json.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLOTS = ("loss_vs_step.png", "loss_vs_bytes.png", "loss_vs_time.png", "bytes_per_link.png",
         "metric_vs_time.png", "consensus_vs_step.png")  # fmt: skip
COLORS = {"ddp": "tab:red", "powersgd": "tab:purple", "hivemind": "tab:olive",
          "diloco": "tab:green", "diloco-int8": "tab:cyan"}  # fmt: skip
LOOSE_POINTS = 0.01  # "within 1 point" of an accuracy-type metric reported as a fraction
LOOSE_FACTOR = 1.02  # the same for a loss-type metric: within 2% of it


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
    _finish(fig, ax, report, path, xlabel, "train loss (moving average)")


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


def _finish(fig, ax, report: dict[str, Any], path: Path, xlabel: str, ylabel: str) -> None:
    """Labels, the run's title, grid and legend; save as PNG and free the figure."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{report['name']}: {report['task']}, {report['peers']} peers ({report['mode']})")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a report without curves draws an empty plot
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _metric_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    metric = report_metric(report)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    label: str | None = "swarm peers"
    for p in _done_peers(report):
        pts = eval_points(p, metric)
        if pts:
            ax.plot([t for _, t, _ in pts], [v for _, _, v in pts], color="tab:blue", lw=0.8,
                    alpha=0.5, marker=".", label=label)  # fmt: skip
            label = None
    mean = swarm_points(report, metric)
    if mean:
        ax.plot([t for _, t, _ in mean], [v for _, _, v in mean], color="tab:blue", lw=2.4,
                marker="o", label="swarm mean")  # fmt: skip
    for name, b in report.get("baselines", {}).items():
        pts = eval_points(b, metric)
        if pts:
            ax.plot([t for _, t, _ in pts], [v for _, _, v in pts],
                    color=COLORS.get(name, "tab:gray"), lw=1.6, marker="o", label=name)  # fmt: skip
    ddp_final = (report.get("baselines", {}).get("ddp", {}).get("final") or {}).get(metric)
    if ddp_final is not None:
        ax.axhline(ddp_final, color=COLORS["ddp"], ls="--", lw=1, label="DDP final")
    _finish(fig, ax, report, path, "training seconds (evaluation excluded)", f"eval {metric}")


def _consensus_series(report: dict[str, Any]) -> list[tuple[str, list[int], list[float]]]:
    """(peer id, steps, estimate) per peer whose samples carry a positive estimate."""
    out = []
    for p in report["swarm"]["peers"]:
        pts = [(h["step"], h["consensus_distance"]) for h in p.get("history", [])
               if (h.get("consensus_distance") or 0) > 0]  # fmt: skip
        if pts:
            out.append((p["id"], [s for s, _ in pts], [c for _, c in pts]))
    return out


def _consensus_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("tab10")
    for i, (pid, steps, values) in enumerate(_consensus_series(report)):
        ax.plot(steps, values, color=cmap(i % 10), lw=1.0, label=pid)
    ax.set_yscale("log")
    ax.set_xlabel("local step")
    ax.set_ylabel("consensus distance estimate")
    ax.set_title(f"{report['name']}: each peer's consensus-distance estimate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def available_plots(report: dict[str, Any]) -> list[str]:
    """The names in ``PLOTS`` this report has data for (older reports lack the last two)."""
    metric = report_metric(report)
    timed = any(eval_points(p, metric) for p in _done_peers(report)) or any(
        eval_points(b, metric) for b in report.get("baselines", {}).values()
    )
    skip = set()
    if not timed:
        skip.add("metric_vs_time.png")
    if not _consensus_series(report):
        skip.add("consensus_vs_step.png")
    return [name for name in PLOTS if name not in skip]


def plot_all(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the PNG plots this report has data for into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    draw = {
        "loss_vs_step.png": lambda p: _loss_plot(report, "step", "local step", p, logx=False),
        "loss_vs_bytes.png": lambda p: _loss_plot(
            report, "sent_bytes", "bytes sent per process", p, logx=True
        ),
        "loss_vs_time.png": lambda p: _loss_plot(
            report, "seconds", "wall-clock seconds since training started", p, logx=False
        ),
        "bytes_per_link.png": lambda p: _link_plot(report, p),
        "metric_vs_time.png": lambda p: _metric_plot(report, p),
        "consensus_vs_step.png": lambda p: _consensus_plot(report, p),
    }
    paths = []
    for name in available_plots(report):
        draw[name](out / name)
        paths.append(out / name)
    return paths


# -- time to target --------------------------------------------------------------------------


def report_metric(report: dict[str, Any]) -> str:
    """The headline metric's name (the swarm's, else DDP's, else accuracy)."""
    swarm_metric = report.get("swarm", {}).get("metric")
    return swarm_metric or report.get("baselines", {}).get("ddp", {}).get("metric") or "accuracy"


def higher_is_better(report: dict[str, Any], metric: str) -> bool:
    """The metric's direction as a process recorded it (``Task.higher_is_better``); for older
    reports, the same rule by name: loss, perplexity, error and bpc are lower-is-better."""
    recorded = [b.get("higher_is_better") for b in report.get("baselines", {}).values()]
    recorded += [p.get("higher_is_better") for p in report.get("swarm", {}).get("peers", [])]
    for value in recorded:
        if value is not None:
            return bool(value)
    return not any(word in metric.lower() for word in ("loss", "perplexity", "error", "bpc"))


def _done_peers(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in report.get("swarm", {}).get("peers", []) if p.get("final")]


def _timed_evals(proc: dict[str, Any], metric: str) -> list[tuple[int, float, float]]:
    return [(int(e["step"]), float(e["seconds"]), float(e[metric]))
            for e in proc.get("evals") or [] if "seconds" in e and metric in e]  # fmt: skip


def _final_point(proc: dict[str, Any], metric: str) -> tuple[int, float, float] | None:
    final, seconds = proc.get("final") or {}, proc.get("final_seconds")
    if metric not in final or seconds is None:
        return None
    return int(proc.get("steps") or 0), float(seconds), float(final[metric])


def eval_points(proc: dict[str, Any], metric: str) -> list[tuple[int, float, float]]:
    """(step, seconds, value) of one process's timed evaluations, its final one last; empty
    when it recorded no times (reports from before evaluations were timed)."""
    pts, last = _timed_evals(proc, metric), _final_point(proc, metric)
    if last is None:
        return pts
    return [pt for pt in pts if pt[0] < last[0]] + [last]


def swarm_points(report: dict[str, Any], metric: str) -> list[tuple[int, float, float]]:
    """(step, seconds, mean value) of the swarm: at each step every finished peer evaluated,
    the mean over peers, timed when the slowest of them got there; finals as the last point."""
    peers = _done_peers(report)
    if not peers:
        return []
    finals = [_final_point(p, metric) for p in peers]
    end = max((f[0] for f in finals if f), default=None)
    by_step = [
        {step: (t, v) for step, t, v in _timed_evals(p, metric) if end is None or step < end}
        for p in peers
    ]
    out = []
    for step in sorted(set.intersection(*(set(d) for d in by_step))):
        at = [d[step] for d in by_step]
        out.append((step, max(t for t, _ in at), sum(v for _, v in at) / len(at)))
    if all(finals):
        done = [f for f in finals if f]
        out.append((max(f[0] for f in done), max(f[1] for f in done),
                    sum(f[2] for f in done) / len(done)))  # fmt: skip
    return out


def first_reaching(
    points: list[tuple[int, float, float]], target: float, higher: bool
) -> tuple[int, float] | None:
    """(step, seconds) of the first point at or past ``target``; None if none is."""
    for step, seconds, value in points:
        if (value >= target) if higher else (value <= target):
            return step, seconds
    return None


def time_to_target(report: dict[str, Any]) -> dict[str, Any] | None:
    """When each system first reached DDP's final metric, and a looser target (1 point under
    it for accuracy-type metrics, 2% over it for loss-type ones); None without a DDP result.

    The swarm is judged on the mean over its peers at each evaluation step; times are training
    seconds with evaluation excluded, the same clock for the swarm and the baselines.
    """
    metric = report_metric(report)
    ddp = report.get("baselines", {}).get("ddp") or {}
    if metric not in (ddp.get("final") or {}):
        return None
    higher = higher_is_better(report, metric)
    target = float(ddp["final"][metric])
    point = LOOSE_POINTS if abs(target) <= 1 else 1.0  # of a fraction, or of a percentage
    loose = target - point if higher else target * LOOSE_FACTOR
    series = {"swarm": swarm_points(report, metric)}
    for name, b in report.get("baselines", {}).items():
        series[name] = eval_points(b, metric)
    systems: dict[str, dict[str, Any]] = {}
    for name, pts in series.items():
        hit, loose_hit = first_reaching(pts, target, higher), first_reaching(pts, loose, higher)
        systems[name] = {
            "seconds": hit[1] if hit else None,
            "step": hit[0] if hit else None,
            "loose_seconds": loose_hit[1] if loose_hit else None,
            "loose_step": loose_hit[0] if loose_hit else None,
        }
    ours = systems["swarm"]

    def ratio(name: str, key: str) -> float | None:
        a, b = systems[name][key], ours[key]
        return a / b if a is not None and b else None

    baselines = [n for n in systems if n != "swarm"]
    return {
        "metric": metric,
        "higher_is_better": higher,
        "target": target,
        "loose_target": loose,
        "systems": systems,
        # How many times sooner the swarm got there than each baseline.
        "speedup": {n: ratio(n, "seconds") for n in baselines},
        "loose_speedup": {n: ratio(n, "loose_seconds") for n in baselines},
    }


def _ttt_lines(ttt: dict[str, Any]) -> list[str]:
    """The summary.md section for ``time_to_target``."""

    def fmt(seconds: float | None, step: int | None) -> str:
        return "never" if seconds is None else f"{seconds:.1f} s (step {step})"

    def fmt_x(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    metric, target, loose = ttt["metric"], ttt["target"], ttt["loose_target"]
    lines = [
        "",
        f"## Time to DDP's final {metric}",
        "",
        f"Target: DDP's final {metric} {target:.4f}; loose target {loose:.4f} (within "
        + ("1 point)." if ttt["higher_is_better"] else "2%)."),
        "Training seconds with evaluation time excluded; the swarm counts when the mean over "
        "its peers first reaches the target (time of the slowest peer at that evaluation). "
        "Speed-up: baseline's time / swarm's time. never = not reached in this run.",
        "",
        "| system | to target | to loose target | swarm speed-up | swarm speed-up (loose) |",
        "|---|---|---|---|---|",
    ]
    for name, s in ttt["systems"].items():
        lines.append(
            f"| {name} | {fmt(s['seconds'], s['step'])} | "
            f"{fmt(s['loose_seconds'], s['loose_step'])} | "
            f"{fmt_x(ttt['speedup'].get(name))} | {fmt_x(ttt['loose_speedup'].get(name))} |"
        )
    return lines


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
        label = name if name != "powersgd" else f"powersgd (rank {b['powersgd_rank']})"
        if name.startswith("diloco"):
            label = f"{name} (H={b['local_steps']})"
        rows.append(
            {
                "system": label,
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
        "ring all-reduce traffic per rank, 2(n−1)/n × each all-reduce payload (int8 DiLoCo: "
        "(n−1)/n × its all-to-all input plus (n−1) × its all-gather input). Kernel MB "
        "(netns): what each site's link carried, headers, acks and framing included. "
        "Train s: wall-clock of the training loop (start-up excluded).",
    ]
    ttt = report.get("time_to_target")
    if ttt is None and "time_to_target" not in report:
        ttt = time_to_target(report)
    if ttt:
        lines += _ttt_lines(ttt)
    lines += ["", *[f"![{p}]({p})" for p in available_plots(report)], ""]
    return "\n".join(lines)


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    """report.json, summary.md and the PNG plots into ``out``."""
    out = Path(out)
    report["time_to_target"] = time_to_target(report)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "summary.md").write_text(markdown(report))
    try:
        plot_all(report, out)
    except ImportError as err:
        log.warning("no plots: %s (pip install 'gossipgrad[plots]')", err)
    log.info("report written to %s", out)
