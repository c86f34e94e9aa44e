"""Run the issue-6 benchmark grid with gossipgrad-experiment and tabulate it.

The entries (one experiment spec plus ``--set`` overrides each, and the reference entry whose
baselines an ablation is compared with) are in ``bench_entries.py``.

    python scripts/bench_suite.py --quick            # the `make bench` subset
    python scripts/bench_suite.py --only digits-gamma0.05,digits-h2
    python scripts/bench_suite.py --table            # re-tabulate existing runs, run nothing

Outputs go under --out (default runs/bench/<entry>); a markdown table per group is printed
and written to OUT/tables.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

from bench_entries import DIGITS, ENTRIES, Entry
from gossipgrad.experiment.analysis import done_peers, higher_is_better
from gossipgrad.experiment.markdown import dict_table, table
from gossipgrad.experiment.records import Report
from gossipgrad.experiment.report import load_report

logger = logging.getLogger("bench_suite")

SPECS = Path(__file__).resolve().parent / "experiments"


def run_entry(entry: Entry, out: Path, python: str) -> int:
    """Run one entry with gossipgrad-experiment; return its exit status."""
    cmd = [
        python,
        "-m",
        "gossipgrad.experiment",
        str(SPECS / entry.spec),
        "--out",
        str(out),
        "--no-live",
    ]
    for s in entry.sets:
        cmd += ["--set", s]
    logger.info("%s: %s", entry.name, " ".join(cmd))
    t0 = time.monotonic()
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    logger.info("%s: exit %s after %.0f s", entry.name, rc, time.monotonic() - t0)
    return rc


def _load(path: Path) -> Report | None:
    try:
        return load_report(path)
    except (OSError, ValueError):
        return None


def mean_model_metric(report: Report, run_dir: Path) -> float | None:
    """Held-out metric of the peers' average model x̄ (from their final params.pt).

    Separates what gossip loses to disagreement between peers (per-peer metric below x̄'s)
    from what it loses in optimization (x̄ itself below DDP). Cached in mean_model.json.
    """
    cache = run_dir / "mean_model.json"
    if cache.exists():
        return json.loads(cache.read_text()).get("metric")
    files = sorted((run_dir / "swarm").glob("peer*/params.pt"))
    if not files:
        return None
    import torch
    from gossipgrad.peer.config import TrainSection
    from gossipgrad.peer.tasks import build_task
    from gossipgrad.peer.tasks.training import task_context

    # The spec's [train] table as the peers ran it (the runner sets the seed from the
    # experiment's), mapped to the task's context the way the daemon and baselines map it.
    train = TrainSection.model_validate({**report.spec["peer_raw"]["train"], "seed": report.seed})
    task = build_task(report.task, task_context(train, 0, report.peers))
    mean = torch.stack([torch.load(f, map_location="cpu") for f in files]).mean(0)
    params = [p for p in task.model.parameters() if p.requires_grad]
    torch.nn.utils.vector_to_parameters(mean, params)
    # x̄'s buffers (BatchNorm statistics): the peers' average, as for the parameters.
    buffer_files = [f.with_name("buffers.pt") for f in files if f.with_name("buffers.pt").exists()]
    if buffer_files:
        saved = [torch.load(f, map_location="cpu") for f in buffer_files]
        for name, b in task.model.named_buffers():
            if b.is_floating_point() and all(name in s for s in saved):
                b.copy_(torch.stack([s[name] for s in saved]).mean(0))
    value = float(task.evaluate(task.model)[task.metric])
    cache.write_text(json.dumps({"metric": value, "peers": len(files)}))
    return value


def _finals(report: Report, metric: str) -> list[float]:
    return [p.final[metric] for p in done_peers(report) if p.final and metric in p.final]


def _vs_ddp(report: Report, base: Report, metric: str, mean: float) -> dict[str, str]:
    """The row's DDP and PowerSGD columns, from the reference run's baselines."""
    out: dict[str, str] = {}
    sent = report.swarm.mean_sent_bytes or 0
    ddp, psgd = base.baselines.get("ddp"), base.baselines.get("powersgd")
    if ddp is not None and ddp.final and ddp.metric:
        d = ddp.final[ddp.metric]
        out["DDP"] = f"{d:.4f}"
        if not higher_is_better(report, metric):
            out["gap to DDP (pt)"] = f"{100 * (mean - d) / d:+.2f}%"  # a loss: relative
        else:
            out["gap to DDP (pt)"] = f"{100 * (mean - d):+.2f}"
        out["DDP train s"] = f"{ddp.wall_seconds or 0:.1f}"
        ddp_sent = ddp.mean_sent_bytes or 0
        if sent:
            out["DDP/swarm bytes"] = f"{ddp_sent / sent:,.0f}x"
        upd = [p.sent_update_bytes for p in report.swarm.peers]
        if upd and sum(upd):
            out["DDP/swarm update bytes"] = f"{ddp_sent * len(upd) / sum(upd):,.0f}x"
    if psgd is not None and psgd.final and psgd.metric:
        out["PowerSGD"] = f"{psgd.final[psgd.metric]:.4f}"
        if sent:
            out["PowerSGD/swarm bytes"] = f"{(psgd.mean_sent_bytes or 0) / sent:,.1f}x"
    return out


def row(entry: Entry, report: Report, ref: Report | None, run_dir: Path) -> dict[str, str]:
    """One table row: the swarm against the DDP and PowerSGD of its reference run."""
    swarm = report.swarm
    metric = swarm.metric or "accuracy"
    finals = _finals(report, metric)
    mean = sum(finals) / len(finals) if finals else float("nan")
    lo, hi = min(finals, default=mean), max(finals, default=mean)
    sent = swarm.mean_sent_bytes or 0
    steps = max((p.steps or 0 for p in swarm.peers), default=0) or 1
    rel_cd = swarm.relative_consensus_distance
    out = {
        "run": entry.name,
        "codec": str(report.codec),
        "gamma": str(report.gamma),
        "H": str(report.local_steps),
        "peers": str(report.peers),
        f"swarm {metric} (min-max)": f"{mean:.4f} ({lo:.4f}-{hi:.4f})",
        "x̄ " + metric: "-",
        "DDP": "-",
        "gap to DDP (pt)": "-",
        "PowerSGD": "-",
        "swarm KB/peer/step": f"{sent / steps / 1e3:.2f}",
        "DDP/swarm bytes": "-",
        "DDP/swarm update bytes": "-",
        "PowerSGD/swarm bytes": "-",
        "rel. consensus dist.": f"{rel_cd if rel_cd is not None else math.nan:.2e}",
        "swarm train s": f"{swarm.wall_seconds or 0:.1f}",
        "DDP train s": "-",
    }
    xbar = mean_model_metric(report, run_dir)
    if xbar is not None:
        out["x̄ " + metric] = f"{xbar:.4f}"
    out.update(_vs_ddp(report, ref or report, metric, mean))
    return out


def tables(entries: list[Entry], root: Path) -> str:
    """Markdown: one table of every entry that has a report, in grid order."""
    rows = []
    for e in entries:
        rep = _load(root / e.name)
        if rep is None or not rep.swarm.peers:
            continue
        ref = _load(root / e.reference) if e.reference else None
        rows.append(row(e, rep, ref, root / e.name))
    if not rows:
        return "(no reports)\n"
    return dict_table(rows) + "\n"  # rows of other metrics add their columns


def _seed_figures(root: Path, name: str, ref: str) -> tuple[float, ...] | None:
    """(accuracy, gap to DDP, x̄ gap to DDP, KB/peer/step, rel. CD) of one seeded run."""
    rep, base = _load(root / name), _load(root / ref)
    ddp = base.baselines.get("ddp") if base else None
    if rep is None or ddp is None or not ddp.final:
        return None
    peers = done_peers(rep)
    if not peers:
        return None
    acc = sum(_finals(rep, "accuracy")) / len(peers)
    xbar = mean_model_metric(rep, root / name)
    d = ddp.final["accuracy"]
    cd = rep.swarm.relative_consensus_distance
    return (
        acc,
        100 * (acc - d),
        100 * ((xbar if xbar is not None else math.nan) - d),
        (rep.swarm.mean_sent_bytes or 0) / rep.steps / 1e3,
        cd if cd is not None else math.nan,
    )


def seed_summary(root: Path) -> str:
    """Markdown: each digits ablation over seeds 0, 1, 2 (mean and range of the gap to DDP)."""
    columns = ["run", "seeds", "swarm acc. mean", "gap to DDP (pt) mean [min, max]",
               "x̄ − DDP (pt) mean", "KB/peer/step", "rel. CD mean"]  # fmt: skip
    rows = []
    for e in ENTRIES:
        if e.spec != DIGITS or "ablation" not in e.tags:
            continue
        runs = [(e.name, e.reference or e.name)] + [
            (f"{e.name}-s{k}", f"{e.reference or e.name}-s{k}") for k in (1, 2)
        ]
        figures = [f for f in (_seed_figures(root, n, r) for n, r in runs) if f]
        if not figures:
            continue
        n = len(figures)
        accs, gaps, xgaps, kbs, cds = (list(col) for col in zip(*figures, strict=True))
        rows.append([
            e.name, str(n), f"{sum(accs) / n:.4f}",
            f"{sum(gaps) / n:+.2f} [{min(gaps):+.2f}, {max(gaps):+.2f}]",
            f"{sum(xgaps) / n:+.2f}", f"{sum(kbs) / n:.2f}", f"{sum(cds) / n:.1e}",
        ])  # fmt: skip
    right = [False, True, True, False, True, True, True]
    return table(columns, rows, right) + "\n"


def _plot_task(ax, runs: list[tuple[str, Report, Path]]) -> None:
    """One task's points: every swarm run (mean and x̄) and each baseline once."""
    seen: set[str] = set()
    for name, rep, run_dir in runs:
        finals = _finals(rep, rep.swarm.metric or "accuracy")
        if not finals:
            continue
        x = (rep.swarm.mean_sent_bytes or 0) / 1e6
        ax.scatter(x, sum(finals) / len(finals), color="tab:blue")
        ax.annotate(name, (x, sum(finals) / len(finals)), fontsize=7)
        xbar = mean_model_metric(rep, run_dir)
        if xbar is not None:
            ax.scatter(x, xbar, color="tab:blue", marker="x")
        for bname, b in rep.baselines.items():
            key = f"{bname} ({rep.peers} peers, {name})"
            if b.final and b.metric and b.mean_sent_bytes is not None and key not in seen:
                seen.add(key)
                bx, by = b.mean_sent_bytes / 1e6, b.final[b.metric]
                ax.scatter(bx, by, color="tab:red" if bname == "ddp" else "tab:orange")
                ax.annotate(key, (bx, by), fontsize=7)


def plot(entries: list[Entry], root: Path, out: Path) -> list[Path]:
    """Per task: final metric against MB sent per process, every swarm run plus baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[tuple[str, Report, Path]]] = {}
    for e in entries:
        rep = _load(root / e.name)
        if rep is not None and rep.mode == "local" and rep.swarm.peers:
            groups.setdefault(rep.task, []).append((e.name, rep, root / e.name))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for task, runs in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _plot_task(ax, runs)
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per process (log)")
        ax.set_ylabel("final held-out metric (o: mean over peers, x: average model)")
        ax.set_title(f"{task}: final metric vs bytes")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{task}_metric_vs_bytes.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", type=Path, default=Path("runs/bench"), help="root of the run directories"
    )
    ap.add_argument("--quick", action="store_true", help="only the quick subset (make bench)")
    ap.add_argument("--only", default="", help="comma-separated entry names")
    ap.add_argument(
        "--tag",
        default="",
        help="only entries with this tag (ablation, codec, noniid, scaling, wan, cnn8, charlm8, "
        "fmnist-seeds)",
    )
    ap.add_argument("--table", action="store_true", help="tabulate existing runs, run nothing")
    ap.add_argument(
        "--skip-done", action="store_true", help="skip entries that already have a report"
    )
    ap.add_argument(
        "--seed-summary", action="store_true", help="also print the digits ablations over seeds"
    )
    ap.add_argument("--plots", type=Path, help="also write metric-vs-bytes PNGs here")
    return ap


def choose(only: str, quick: bool, tag: str) -> list[Entry]:
    """The entries ``--only``, ``--quick`` and ``--tag`` select, in grid order for --quick.

    Raises:
        ValueError: ``--only`` names an entry that does not exist.
    """
    by_name = {e.name: e for e in ENTRIES}
    if only:
        unknown = [n for n in only.split(",") if n not in by_name]
        if unknown:
            raise ValueError(f"unknown entries {unknown}; known: {sorted(by_name)}")
        chosen = [by_name[n] for n in only.split(",")]
    elif quick:
        chosen = [e for e in ENTRIES if e.quick]
    else:
        chosen = list(ENTRIES)
    return [e for e in chosen if tag in e.tags] if tag else chosen


def run_all(chosen: list[Entry], out: Path, skip_done: bool) -> list[str]:
    """Run the entries one after the other; returns the names of those that failed."""
    failed = []
    out.mkdir(parents=True, exist_ok=True)
    for e in chosen:
        if skip_done and _load(out / e.name):
            continue
        if e.reference and _load(out / e.reference) is None:
            logger.warning(
                "%s: reference run %s has no report yet; its row has no baselines",
                e.name,
                e.reference,
            )
        if run_entry(e, out / e.name, sys.executable) != 0:
            failed.append(e.name)
    return failed


def main(argv: list[str] | None = None) -> int:
    """Run the selected entries (reference entries first), then print and save the table."""
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        chosen = choose(args.only, args.quick, args.tag)
    except ValueError as err:
        ap.error(str(err))
    failed = [] if args.table else run_all(chosen, args.out, args.skip_done)
    text = tables(chosen, args.out)
    if args.seed_summary:
        text += "\n" + seed_summary(args.out)
    sys.stdout.write(text)
    if args.out.is_dir():
        (args.out / "tables.md").write_text(text)
    if args.plots:
        for path in plot(chosen, args.out, args.plots):
            logger.info("wrote %s", path)
    if failed:
        logger.error("failed: %s (logs: %s/<name>.log)", ", ".join(failed), args.out)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
