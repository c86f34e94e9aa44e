"""Run the issue-6 benchmark grid with gossipgrad-experiment and tabulate it.

Each entry is one experiment spec from scripts/experiments/ plus ``--set`` overrides. Entries
that run no baselines of their own are compared with the baselines of their group's reference
entry: same task, seed, shards, peer count and sample budget, and the baselines are
deterministic, so re-running them per ablation would only cost CPU time.

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
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossipgrad.experiment.report import higher_is_better

logger = logging.getLogger("bench_suite")

SPECS = Path(__file__).resolve().parent / "experiments"


@dataclass(frozen=True)
class Entry:
    """One experiment: a spec, overrides, and the entry whose baselines it is compared with."""

    name: str
    spec: str
    sets: tuple[str, ...] = ()
    reference: str | None = None  # None: runs its own baselines
    quick: bool = False
    tags: tuple[str, ...] = field(default=())


def _no_baselines(*sets: str) -> tuple[str, ...]:
    return (*sets, "baselines.run=[]")


DIGITS = "bench_digits.toml"
FMNIST = "bench_fmnist_mlp.toml"
WAN = "bench_digits_wan.toml"
CNN8 = "bench_fmnist_cnn8.toml"

ENTRIES: list[Entry] = [
    # digits, IID, 4 peers: reference with DDP and PowerSGD, then ablations of one knob each
    Entry("digits", DIGITS, quick=True, tags=("ablation", "codec")),
    Entry(
        "digits-gamma0.03", DIGITS, _no_baselines("gossip.gamma=0.03"), "digits", tags=("ablation",)
    ),
    Entry(
        "digits-gamma0.05", DIGITS, _no_baselines("gossip.gamma=0.05"), "digits", tags=("ablation",)
    ),
    Entry(
        "digits-gamma0.2", DIGITS, _no_baselines("gossip.gamma=0.2"), "digits", tags=("ablation",)
    ),
    Entry(
        "digits-gamma0.5", DIGITS, _no_baselines("gossip.gamma=0.5"), "digits", tags=("ablation",)
    ),
    Entry("digits-h2", DIGITS, _no_baselines("gossip.local_steps=2"), "digits", tags=("ablation",)),
    Entry("digits-h4", DIGITS, _no_baselines("gossip.local_steps=4"), "digits", tags=("ablation",)),
    # error feedback off: CHOCO's x - xhat memory replaced by difference compression (DCD)
    Entry(
        "digits-ef-off",
        DIGITS,
        _no_baselines("gossip.error_feedback=false"),
        "digits",
        tags=("ablation",),
    ),
    Entry(
        "digits-exact-topk",
        DIGITS,
        _no_baselines('gossip.codec="topk:0.01:exact+int8"'),
        "digits",
        tags=("ablation",),
    ),
    Entry(
        "digits-topk0.001",
        DIGITS,
        _no_baselines('gossip.codec="topk:0.001+int8"'),
        "digits",
        tags=("codec",),
    ),
    Entry(
        "digits-int4",
        DIGITS,
        _no_baselines('gossip.codec="int4"', "gossip.gamma=0.5"),
        "digits",
        tags=("codec",),
    ),
    Entry(
        "digits-sign",
        DIGITS,
        _no_baselines('gossip.codec="sign"', "gossip.gamma=0.1"),
        "digits",
        tags=("codec",),
    ),
    # non-IID: the baselines must train the same Dirichlet shards, so they run again
    Entry(
        "digits-dirichlet0.5",
        DIGITS,
        ('train.partition="dirichlet"', "train.alpha=0.5"),
        quick=True,
        tags=("noniid",),
    ),
    # scaling: 8 peers (DDP's ring all-reduce bytes per rank grow with 2(n-1)/n)
    Entry("digits-8", DIGITS, ("experiment.peers=8",), quick=True, tags=("scaling",)),
    # Fashion-MNIST MLP, IID, 4 peers
    Entry("fmnist", FMNIST, tags=("codec",)),
    Entry(
        "fmnist-int4",
        FMNIST,
        _no_baselines('gossip.codec="int4"', "gossip.gamma=0.5"),
        "fmnist",
        tags=("codec",),
    ),
    Entry(
        "fmnist-topk0.001",
        FMNIST,
        _no_baselines('gossip.codec="topk:0.001+int8"'),
        "fmnist",
        tags=("codec",),
    ),
    Entry(
        "fmnist-gamma0.03",
        FMNIST,
        _no_baselines("gossip.gamma=0.03"),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-gamma0.2",
        FMNIST,
        _no_baselines("gossip.gamma=0.2"),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-exponential",
        FMNIST,
        _no_baselines('gossip.topology="exponential"'),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-ef-off",
        FMNIST,
        _no_baselines("gossip.error_feedback=false"),
        "fmnist",
        tags=("ablation",),
    ),
    Entry(
        "fmnist-dirichlet0.5",
        FMNIST,
        ('train.partition="dirichlet"', "train.alpha=0.5"),
        tags=("noniid",),
    ),
    Entry(
        "fmnist-dirichlet0.5-final100",
        FMNIST,
        _no_baselines('train.partition="dirichlet"', "train.alpha=0.5", "gossip.final_rounds=100"),
        "fmnist-dirichlet0.5",
        tags=("noniid",),
    ),
    Entry(
        "fmnist-final100",
        FMNIST,
        _no_baselines("gossip.final_rounds=100"),
        "fmnist",
        tags=("codec",),
    ),
    # 8 peers: the Fashion-MNIST CNN (codecs, topology, local steps, non-IID) and the char-LM
    Entry("cnn8", CNN8, tags=("cnn8",)),
    *(
        Entry(f"cnn8-{name}", CNN8, _no_baselines(*sets), "cnn8", tags=("cnn8",))
        for name, sets in (
            ("exponential", ('gossip.topology="exponential"',)),
            ("h2", ("gossip.local_steps=2",)),
            ("final100", ("gossip.final_rounds=100",)),
            ("topk0.001", ('gossip.codec="topk:0.001+int8"',)),
            ("int4", ('gossip.codec="int4"', "gossip.gamma=0.5")),
            ("sign", ('gossip.codec="sign"',)),
        )
    ),
    Entry(
        "cnn8-dirichlet0.5",
        CNN8,
        ('train.partition="dirichlet"', "train.alpha=0.5"),
        tags=("cnn8",),
    ),
    Entry("charlm8", "bench_shakespeare8.toml", tags=("charlm8",)),
    # diagnosis: the same swarm gossiping dense models (no compression, plain D-PSGD mixing)
    Entry(
        "charlm8-dense",
        "bench_shakespeare8.toml",
        _no_baselines('gossip.codec="none"', "gossip.gamma=1.0"),
        "charlm8",
        tags=("charlm8",),
    ),
    # scaling: 16 peers (16 processes per phase on the 2-core host)
    Entry("digits-16", DIGITS, ("experiment.peers=16",), tags=("scaling",)),
    # emulated WAN (netns; root and iproute2)
    Entry("digits-wan", WAN, tags=("wan",)),
    Entry("fmnist-wan", "bench_fmnist_wan.toml", tags=("wan",)),
    Entry("fmnist-wan8", "bench_fmnist_wan.toml", ("experiment.peers=8",), tags=("wan",)),
    # a race to DDP's final accuracy: the swarm may take twice DDP's steps (time_to_target)
    Entry(
        "fmnist-wan-race",
        "bench_fmnist_wan.toml",
        ("train.steps=300", "baselines.steps=150"),
        tags=("wan",),
    ),
    Entry(
        "fmnist-wan8-race",
        "bench_fmnist_wan.toml",
        ("experiment.peers=8", "train.steps=300", "baselines.steps=150"),
        tags=("wan",),
    ),
]


def _reseeded(seed: int) -> list[Entry]:
    """The digits ablation entries again with another seed (data, init and sampling)."""
    out = []
    for e in ENTRIES:
        if e.spec == DIGITS and "ablation" in e.tags:
            ref = f"{e.reference}-s{seed}" if e.reference else None
            tags = (*(t for t in e.tags if t != "ablation"), "seeds")
            sets = (*e.sets, f"experiment.seed={seed}")
            out.append(Entry(f"{e.name}-s{seed}", e.spec, sets, ref, tags=tags))
    return out


ENTRIES += _reseeded(1) + _reseeded(2)
# Fashion-MNIST headline rows again with seeds 1 and 2 (IID; Dirichlet with and without
# final rounds), each seed with its own baselines.
for _seed in (1, 2):
    _dirichlet = ('train.partition="dirichlet"', "train.alpha=0.5", f"experiment.seed={_seed}")
    ENTRIES += [
        Entry(f"fmnist-s{_seed}", FMNIST, (f"experiment.seed={_seed}",), tags=("fmnist-seeds",)),
        Entry(f"fmnist-dirichlet0.5-s{_seed}", FMNIST, _dirichlet, tags=("fmnist-seeds",)),
        Entry(
            f"fmnist-dirichlet0.5-final100-s{_seed}",
            FMNIST,
            _no_baselines(*_dirichlet, "gossip.final_rounds=100"),
            f"fmnist-dirichlet0.5-s{_seed}",
            tags=("fmnist-seeds",),
        ),
    ]


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


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / "report.json").read_text())
    except (OSError, ValueError):
        return None


def mean_model_metric(report: dict[str, Any], run_dir: Path) -> float | None:
    """Held-out metric of the peers' average model x̄ (from their final params.pt).

    Separates what gossip loses to disagreement between peers (per-peer metric below x̄'s)
    from what it loses in optimization (x̄ itself below DDP). Cached in mean_model.json.
    """
    cache = run_dir / "mean_model.json"
    if cache.exists():
        return json.loads(cache.read_text()).get("metric")
    import torch
    from gossipgrad.peer.tasks import TaskContext, build_task

    files = sorted((run_dir / "swarm").glob("peer*/params.pt"))
    if not files:
        return None
    train = report["spec"]["peer_raw"]["train"]
    ctx = TaskContext(
        peer_index=0,
        num_peers=int(report["peers"]),
        seed=int(report["seed"]),
        partition=str(train.get("partition", "iid")),
        alpha=float(train.get("alpha", 0.5)),
        batch_size=int(report["batch_size"]),
        device=torch.device("cpu"),
    )
    task = build_task(str(report["task"]), ctx)
    mean = torch.stack([torch.load(f, map_location="cpu") for f in files]).mean(0)
    params = [p for p in task.model.parameters() if p.requires_grad]
    torch.nn.utils.vector_to_parameters(mean, params)
    value = float(task.evaluate(task.model)[task.metric])
    cache.write_text(json.dumps({"metric": value, "peers": len(files)}))
    return value


def row(
    entry: Entry, report: dict[str, Any], ref: dict[str, Any] | None, run_dir: Path
) -> dict[str, str]:
    """One table row: the swarm against the DDP and PowerSGD of its reference run."""
    swarm = report["swarm"]
    metric = swarm.get("metric", "accuracy")
    finals = [p["final"][metric] for p in swarm["peers"] if p.get("final")]
    base = (ref or report).get("baselines", {})
    ddp, psgd = base.get("ddp", {}), base.get("powersgd", {})
    mean = sum(finals) / len(finals) if finals else float("nan")
    lo, hi = min(finals, default=mean), max(finals, default=mean)
    sent = swarm.get("mean_sent_bytes") or 0
    steps = max((p.get("steps", 0) for p in swarm["peers"]), default=0) or 1
    out = {
        "run": entry.name,
        "codec": str(report.get("codec")),
        "gamma": str(report.get("gamma")),
        "H": str(report.get("local_steps")),
        "peers": str(report.get("peers")),
        f"swarm {metric} (min-max)": f"{mean:.4f} ({lo:.4f}-{hi:.4f})",
        "x̄ " + metric: "-",
        "DDP": "-",
        "gap to DDP (pt)": "-",
        "PowerSGD": "-",
        "swarm KB/peer/step": f"{sent / steps / 1e3:.2f}",
        "DDP/swarm bytes": "-",
        "DDP/swarm update bytes": "-",
        "PowerSGD/swarm bytes": "-",
        "rel. consensus dist.": f"{swarm.get('relative_consensus_distance', float('nan')):.2e}",
        "swarm train s": f"{swarm.get('wall_seconds', 0):.1f}",
        "DDP train s": "-",
    }
    xbar = mean_model_metric(report, run_dir)
    if xbar is not None:
        out["x̄ " + metric] = f"{xbar:.4f}"
    if ddp.get("final"):
        d = ddp["final"][ddp["metric"]]
        out["DDP"] = f"{d:.4f}"
        if not higher_is_better(report, metric):
            out["gap to DDP (pt)"] = f"{100 * (mean - d) / d:+.2f}%"  # a loss: relative
        else:
            out["gap to DDP (pt)"] = f"{100 * (mean - d):+.2f}"
        out["DDP train s"] = f"{ddp.get('wall_seconds', 0):.1f}"
        if sent:
            out["DDP/swarm bytes"] = f"{ddp['mean_sent_bytes'] / sent:,.0f}x"
        upd = [p.get("sent_update_bytes", 0) for p in swarm["peers"]]
        if upd and sum(upd):
            out["DDP/swarm update bytes"] = f"{ddp['mean_sent_bytes'] * len(upd) / sum(upd):,.0f}x"
    if psgd.get("final"):
        out["PowerSGD"] = f"{psgd['final'][psgd['metric']]:.4f}"
        if sent:
            out["PowerSGD/swarm bytes"] = f"{psgd['mean_sent_bytes'] / sent:,.1f}x"
    return out


def tables(entries: list[Entry], root: Path) -> str:
    """Markdown: one table of every entry that has a report, in grid order."""
    rows = []
    for e in entries:
        rep = _load(root / e.name)
        if rep is None or not rep.get("swarm", {}).get("peers"):
            continue
        ref = _load(root / e.reference) if e.reference else None
        rows.append(row(e, rep, ref, root / e.name))
    if not rows:
        return "(no reports)\n"
    cols = list(dict.fromkeys(c for r in rows for c in r))  # rows of other metrics add theirs
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r.get(c, "-") for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def seed_summary(root: Path) -> str:
    """Markdown: each digits ablation over seeds 0, 1, 2 (mean and range of the gap to DDP)."""
    lines = [
        "| run | seeds | swarm acc. mean | gap to DDP (pt) mean [min, max] | x̄ − DDP (pt) mean |"
        " KB/peer/step | rel. CD mean |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for e in ENTRIES:
        if e.spec != DIGITS or "ablation" not in e.tags:
            continue
        gaps, xgaps, accs, kbs, cds = [], [], [], [], []
        for name, ref in [(e.name, e.reference or e.name)] + [
            (f"{e.name}-s{k}", f"{e.reference or e.name}-s{k}") for k in (1, 2)
        ]:
            rep, base = _load(root / name), _load(root / ref)
            if rep is None or base is None or not base.get("baselines", {}).get("ddp"):
                continue
            ddp = base["baselines"]["ddp"]["final"]["accuracy"]
            peers = [p for p in rep["swarm"]["peers"] if p.get("final")]
            acc = sum(p["final"]["accuracy"] for p in peers) / len(peers)
            xbar = mean_model_metric(rep, root / name)
            accs.append(acc)
            gaps.append(100 * (acc - ddp))
            xgaps.append(100 * ((xbar if xbar is not None else float("nan")) - ddp))
            kbs.append(rep["swarm"]["mean_sent_bytes"] / rep["steps"] / 1e3)
            cds.append(rep["swarm"].get("relative_consensus_distance", float("nan")))
        if not gaps:
            continue
        n = len(gaps)
        lines.append(
            f"| {e.name} | {n} | {sum(accs) / n:.4f} | {sum(gaps) / n:+.2f} "
            f"[{min(gaps):+.2f}, {max(gaps):+.2f}] | {sum(xgaps) / n:+.2f} | "
            f"{sum(kbs) / n:.2f} | {sum(cds) / n:.1e} |"
        )
    return "\n".join(lines) + "\n"


def plot(entries: list[Entry], root: Path, out: Path) -> list[Path]:
    """Per task: final metric against MB sent per process, every swarm run plus baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[tuple[str, dict[str, Any], Path]]] = {}
    for e in entries:
        rep = _load(root / e.name)
        if rep is not None and rep.get("mode") == "local" and rep["swarm"].get("peers"):
            groups.setdefault(str(rep["task"]), []).append((e.name, rep, root / e.name))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for task, runs in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        seen: set[str] = set()
        for name, rep, run_dir in runs:
            swarm = rep["swarm"]
            metric = swarm.get("metric", "accuracy")
            finals = [p["final"][metric] for p in swarm["peers"] if p.get("final")]
            if not finals:
                continue
            x = swarm["mean_sent_bytes"] / 1e6
            ax.scatter(x, sum(finals) / len(finals), color="tab:blue")
            ax.annotate(name, (x, sum(finals) / len(finals)), fontsize=7)
            xbar = mean_model_metric(rep, run_dir)
            if xbar is not None:
                ax.scatter(x, xbar, color="tab:blue", marker="x")
            for bname, b in rep.get("baselines", {}).items():
                key = f"{bname} ({rep['peers']} peers, {name})"
                if b.get("final") and key not in seen:
                    seen.add(key)
                    bx, by = b["mean_sent_bytes"] / 1e6, b["final"][b["metric"]]
                    ax.scatter(bx, by, color="tab:red" if bname == "ddp" else "tab:orange")
                    ax.annotate(key, (bx, by), fontsize=7)
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


def main(argv: list[str] | None = None) -> int:
    """Run the selected entries (reference entries first), then print and save the table."""
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    by_name = {e.name: e for e in ENTRIES}
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in by_name]
        if unknown:
            ap.error(f"unknown entries {unknown}; known: {sorted(by_name)}")
        chosen = [by_name[n] for n in args.only.split(",")]
    elif args.quick:
        chosen = [e for e in ENTRIES if e.quick]
    else:
        chosen = list(ENTRIES)
    if args.tag:
        chosen = [e for e in chosen if args.tag in e.tags]

    failed = []
    if not args.table:
        args.out.mkdir(parents=True, exist_ok=True)
        for e in chosen:
            if args.skip_done and _load(args.out / e.name):
                continue
            if e.reference and _load(args.out / e.reference) is None:
                logger.warning(
                    "%s: reference run %s has no report yet; its row has no baselines",
                    e.name,
                    e.reference,
                )
            if run_entry(e, args.out / e.name, sys.executable) != 0:
                failed.append(e.name)
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
