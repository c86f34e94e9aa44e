"""summary.md: the report's headline table, consensus distance, time to target and plots.

``table`` is the one markdown-table helper of the experiment side (summary.md, the records'
reference in docs/experiments.md, the benchmark tables). A dependency such as ``tabulate``
would buy alignment we do not need: GitHub renders a plain pipe table the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from gossipgrad.experiment import analysis, plots
from gossipgrad.experiment.records import BaselineResult, Report, TimeToTarget


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] = ()) -> str:
    """A markdown pipe table; ``|`` inside a cell is escaped; column i is right-aligned when
    ``right[i]`` is true (numbers)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    rule = ["---:" if i < len(right) and right[i] else "---" for i in range(len(columns))]
    return "\n".join([line(columns), "|" + "|".join(rule) + "|", *(line(r) for r in rows)])


def dict_table(rows: Sequence[dict[str, str]], missing: str = "-") -> str:
    """A table of rows given as ``{column: cell}``; columns in first-seen order."""
    columns = list(dict.fromkeys(c for r in rows for c in r))
    return table(columns, [[r.get(c, missing) for c in columns] for r in rows])


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.3f}"


def _util(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fewer(base: float | None, ours: float | None, digits: int) -> str:
    return f"{base / ours:,.{digits}f}x fewer" if base and ours else "-"


def swarm_row(report: Report, ddp_sent: float | None) -> dict[str, str] | None:
    """The swarm's row: mean (min-max) of the peers' final metric, bytes, training time."""
    swarm = report.swarm
    metric = swarm.metric or "accuracy"
    peers = analysis.done_peers(report)
    if not peers:
        return None
    vals = [p.final[metric] for p in peers if p.final]
    losses = [(p.final or {}).get("loss", 0) for p in peers]
    row = {
        "system": f"gossipgrad ({report.codec}, {report.topology})",
        metric: f"{sum(vals) / len(vals):.4f} ({min(vals):.4f}-{max(vals):.4f})",
        "eval loss": f"{sum(losses) / len(losses):.4f}",
        "steps": str(max(p.steps or 0 for p in peers)),
        "sent MB/proc": _mb(swarm.mean_sent_bytes),
        "dense-equiv MB/proc": _mb(swarm.mean_dense_bytes),
        "vs DDP bytes": _fewer(ddp_sent, swarm.mean_sent_bytes, 0),
        "train s": f"{swarm.wall_seconds or 0:.1f}",
        "compute util.": _util(swarm.compute_utilization),
    }
    if report.mode == "netns":
        row["kernel MB up/site"] = _mb(analysis.kernel_up_bytes(swarm.link_bytes))
    return row


def baseline_row(
    report: Report, name: str, b: BaselineResult, ddp_sent: float | None
) -> dict[str, str]:
    """One baseline's row (its rank 0's evaluation, bytes per rank)."""
    metric = report.swarm.metric or "accuracy"
    if b.refused is not None:
        return {"system": name, metric: "not run (other links)"}
    if not b.final or b.metric is None:
        return {"system": name, metric: "failed"}
    label = name if name != "powersgd" else f"powersgd (rank {b.powersgd_rank})"
    if name.startswith("diloco"):
        label = f"{name} (H={b.local_steps})"
    row = {
        "system": label,
        metric: f"{b.final[b.metric]:.4f}",
        "eval loss": f"{b.final.get('loss', 0):.4f}",
        "steps": str(b.steps),
        "sent MB/proc": _mb(b.mean_sent_bytes),
        "dense-equiv MB/proc": _mb(b.dense_bytes_per_rank),
        "vs DDP bytes": _fewer(ddp_sent, b.mean_sent_bytes, 1),
        "train s": f"{b.wall_seconds or 0:.1f}",
        "compute util.": _util(b.compute_utilization),
    }
    if report.mode == "netns":
        row["kernel MB up/site"] = _mb(analysis.kernel_up_bytes(b.link_bytes))
    return row


def summary_rows(report: Report) -> list[dict[str, str]]:
    """One row per system: the swarm (mean over peers) and each baseline."""
    ddp = report.baselines.get("ddp")
    ddp_sent = ddp.mean_sent_bytes if ddp else None
    rows = [r for r in [swarm_row(report, ddp_sent)] if r]
    rows += [baseline_row(report, n, b, ddp_sent) for n, b in report.baselines.items()]
    return rows


def ttt_lines(ttt: TimeToTarget) -> list[str]:
    """The summary.md section for ``time_to_target``."""

    def when(seconds: float | None, step: int | None) -> str:
        return "never" if seconds is None else f"{seconds:.1f} s (step {step})"

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    rows = [
        [name, when(s.seconds, s.step), when(s.loose_seconds, s.loose_step),
         times(ttt.speedup.get(name)), times(ttt.loose_speedup.get(name))]
        for name, s in ttt.systems.items()
    ]  # fmt: skip
    columns = ["system", "to target", "to loose target", "swarm speed-up",
               "swarm speed-up (loose)"]  # fmt: skip
    return [
        "",
        f"## Time to DDP's final {ttt.metric}",
        "",
        f"Target: DDP's final {ttt.metric} {ttt.target:.4f}; loose target "
        f"{ttt.loose_target:.4f} (within " + ("1 point)." if ttt.higher_is_better else "2%)."),
        "Training seconds with evaluation time excluded; the swarm counts when the mean over "
        "its peers first reaches the target (time of the slowest peer at that evaluation). "
        "Speed-up: baseline's time / swarm's time. never = not reached in this run.",
        "",
        table(columns, rows),
    ]


def unequal_lines(report: Report) -> list[str]:
    """One line per baseline that did not run over the swarm's links, saying why; no time
    or speed-up of the summary compares the swarm with it."""
    lines = []
    for name, b in report.baselines.items():
        if b.refused is not None:
            lines.append(f"- {name}: {b.refused}")
        elif b.network is not None:
            lines.append(f"- {name}: ran over other links than the swarm's ({b.network})")
    if not lines:
        return []
    head = "Not compared with the swarm (their links were not its links):"
    return ["", head, "", *lines]


UTILIZATION_NOTE = (
    "Compute util.: 1 − seconds a process's training thread waited on communication / its "
    "training seconds, mean over processes (swarm: blocked in gossip rounds and exchanges; "
    "DDP and PowerSGD: the gradient hook; DiLoCo: the outer sync; hivemind: its optimizer "
    "step)."
)

BYTES_NOTE = (
    "Bytes: swarm = what each peer's gossip put on the wire (its counters); baselines = "
    "ring all-reduce traffic per rank, 2(n−1)/n × each all-reduce payload (int8 DiLoCo: "
    "(n−1)/n × its all-to-all input plus (n−1) × its all-gather input). Kernel MB "
    "(netns): what each site's link carried, headers, acks and framing included. "
    "Train s: wall-clock of the training loop (start-up excluded)."
)


def markdown(report: Report) -> str:
    """The summary table plus the swarm's consensus distance, time to target and the plots."""
    rows = summary_rows(report)
    lines = [
        f"# {report.name}",
        "",
        f"{report.task}, {report.peers} peers, {report.mode} mode, seed "
        f"{report.seed}, {report.steps} steps of batch {report.batch_size} per process.",
        "",
        dict_table(rows) if rows else table(["system"], []),
    ]
    swarm = report.swarm
    if swarm.consensus_distance is not None:
        lines += [
            "",
            f"Swarm consensus distance (1/n) Σ‖x_i − x̄‖² = {swarm.consensus_distance:.3e} "
            f"({swarm.relative_consensus_distance or 0:.2e} of ‖x̄‖²).",
        ]
    lines += unequal_lines(report)
    lines += ["", BYTES_NOTE, "", UTILIZATION_NOTE]
    ttt = report.time_to_target or analysis.time_to_target(report)
    if ttt:
        lines += ttt_lines(ttt)
    lines += ["", *[f"![{p}]({p})" for p in plots.available_plots(report)], ""]
    return "\n".join(lines)
