"""Numbers from an experiment's records: consensus distance, evaluation series, time to target.

No plotting and no formatting here (``plots`` and ``markdown`` do those); every function reads
a :class:`~gossipgrad.experiment.records.Report` (or the peers' final parameters) and returns
plain numbers, so the plots, summary.md and the benchmarks agree on one computation.
"""

from __future__ import annotations

from pathlib import Path

from gossipgrad.experiment.records import (
    BaselineResult,
    PeerResult,
    Report,
    SystemTime,
    TimeToTarget,
)

LOOSE_POINTS = 0.01  # "within 1 point" of an accuracy-type metric reported as a fraction
LOOSE_FACTOR = 1.02  # the same for a loss-type metric: within 2% of it
LOWER_IS_BETTER_WORDS = ("loss", "perplexity", "error", "bpc")

# (step, training seconds, metric value) of one evaluation.
Point = tuple[int, float, float]


#: Entries of every peer's parameters read at a time by ``consensus_distance``.
CONSENSUS_CHUNK = 1 << 20


def consensus_distance(param_files: list[Path]) -> tuple[float, float] | None:
    """True consensus distance (1/n) Σ_i ||x_i − x̄||² from the peers' final parameters,
    and the same relative to ||x̄||² (scale-free, comparable across models); None with fewer
    than two parameter files (Koloskova et al. 2019, CHOCO-SGD, measure the same quantity).

    The files are memory-mapped and read ``CONSENSUS_CHUNK`` entries at a time, in float64:
    the memory it takes does not grow with the model (8 peers of 100M parameters held at once
    in float64 would be 6.4 GB, and the deviations as much again)."""
    import torch

    xs = [torch.load(p, weights_only=True, mmap=True) for p in param_files if p.exists()]
    if len(xs) < 2:
        return None
    dist = norm2 = 0.0
    for lo in range(0, xs[0].numel(), CONSENSUS_CHUNK):
        stacked = torch.stack([x[lo : lo + CONSENSUS_CHUNK] for x in xs]).double()
        mean = stacked.mean(dim=0)
        dist += float(((stacked - mean) ** 2).sum()) / len(xs)
        norm2 += float((mean**2).sum())
    return dist, dist / max(norm2, 1e-30)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (train loss on one batch is noisy)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def loss_curves(report: Report, x_key: str) -> list[tuple[str, list[float], list[float]]]:
    """(label, x, smoothed loss) per peer and per baseline (its rank 0), x being a
    :class:`~gossipgrad.experiment.records.Sample` field: step, sent_bytes or seconds."""
    curves = []
    histories = [(p.id, p.history) for p in report.swarm.peers]
    for name, b in report.baselines.items():
        rank0 = b.ranks[0] if b.ranks else None
        histories.append((name, rank0.history if rank0 else []))
    for label, history in histories:
        hist = [h for h in history if h.loss is not None and getattr(h, x_key) is not None]
        if hist:
            ys = smooth([h.loss for h in hist], max(1, len(hist) // 20))  # type: ignore[misc]
            curves.append((label, [float(getattr(h, x_key)) for h in hist], ys))
    return curves


def consensus_series(report: Report) -> list[tuple[str, list[int], list[float]]]:
    """(peer id, steps, estimate) per peer whose samples carry a positive estimate."""
    out = []
    for p in report.swarm.peers:
        pts = [(h.step, h.consensus_distance) for h in p.history if (h.consensus_distance or 0) > 0]
        if pts:
            out.append((p.id, [s for s, _ in pts], [float(c or 0) for _, c in pts]))
    return out


def report_metric(report: Report) -> str:
    """The headline metric's name (the swarm's, else DDP's, else accuracy)."""
    ddp = report.baselines.get("ddp")
    return report.swarm.metric or (ddp.metric if ddp else None) or "accuracy"


def higher_is_better(report: Report, metric: str) -> bool:
    """The metric's direction as a process recorded it (``Task.higher_is_better``); for older
    reports, the same rule by name: loss, perplexity, error and bpc are lower-is-better."""
    recorded = [b.higher_is_better for b in report.baselines.values()]
    recorded += [p.higher_is_better for p in report.swarm.peers]
    for value in recorded:
        if value is not None:
            return value
    return not any(word in metric.lower() for word in LOWER_IS_BETTER_WORDS)


def done_peers(report: Report) -> list[PeerResult]:
    """The peers that finished (they have a final evaluation)."""
    return [p for p in report.swarm.peers if p.final]


def _timed_evals(proc: PeerResult | BaselineResult, metric: str) -> list[Point]:
    return [(int(e["step"]), float(e["seconds"]), float(e[metric]))
            for e in proc.evals if "seconds" in e and metric in e]  # fmt: skip


def _final_point(proc: PeerResult | BaselineResult, metric: str) -> Point | None:
    if not proc.final or metric not in proc.final or proc.final_seconds is None:
        return None
    return int(proc.steps or 0), float(proc.final_seconds), float(proc.final[metric])


def eval_points(proc: PeerResult | BaselineResult, metric: str) -> list[Point]:
    """(step, seconds, value) of one process's timed evaluations, its final one last; empty
    when it recorded no times (reports from before evaluations were timed)."""
    pts, last = _timed_evals(proc, metric), _final_point(proc, metric)
    if last is None:
        return pts
    return [pt for pt in pts if pt[0] < last[0]] + [last]


def swarm_points(report: Report, metric: str) -> list[Point]:
    """(step, seconds, mean value) of the swarm: at each step every finished peer evaluated,
    the mean over peers, timed when the slowest of them got there; finals as the last point."""
    peers = done_peers(report)
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


def first_reaching(points: list[Point], target: float, higher: bool) -> tuple[int, float] | None:
    """(step, seconds) of the first point at or past ``target``; None if none is."""
    for step, seconds, value in points:
        if (value >= target) if higher else (value <= target):
            return step, seconds
    return None


def _system_time(points: list[Point], target: float, loose: float, higher: bool) -> SystemTime:
    hit, loose_hit = first_reaching(points, target, higher), first_reaching(points, loose, higher)
    return SystemTime(
        seconds=hit[1] if hit else None,
        step=hit[0] if hit else None,
        loose_seconds=loose_hit[1] if loose_hit else None,
        loose_step=loose_hit[0] if loose_hit else None,
    )


def _speedup(base: float | None, ours: float | None) -> float | None:
    """How many times sooner the swarm got there than a baseline."""
    return base / ours if base is not None and ours else None


def same_links(b: BaselineResult) -> bool:
    """Whether baseline ``b`` ran over the swarm's links: it ran (was not refused) and no
    older report marked its network as another."""
    return b.refused is None and b.network is None


def comparable_baselines(report: Report) -> dict[str, BaselineResult]:
    """The baselines a time can be compared with the swarm's (``same_links``)."""
    return {name: b for name, b in report.baselines.items() if same_links(b)}


def time_to_target(report: Report) -> TimeToTarget | None:
    """When each system first reached DDP's final metric, and a looser target (1 point under
    it for accuracy-type metrics, 2% over it for loss-type ones); None without a DDP result
    over the swarm's links.

    The swarm is judged on the mean over its peers at each evaluation step; times are training
    seconds with evaluation excluded, the same clock for the swarm and the baselines. Only
    baselines that ran over the swarm's links take part (``same_links``): a time over other
    links says nothing of gossip against all-reduce.
    """
    metric = report_metric(report)
    baselines = comparable_baselines(report)
    ddp = baselines.get("ddp")
    if ddp is None or not ddp.final or metric not in ddp.final:
        return None
    higher = higher_is_better(report, metric)
    target = float(ddp.final[metric])
    point = LOOSE_POINTS if abs(target) <= 1 else 1.0  # of a fraction, or of a percentage
    loose = target - point if higher else target * LOOSE_FACTOR
    series = {"swarm": swarm_points(report, metric)}
    series.update({name: eval_points(b, metric) for name, b in baselines.items()})
    systems = {name: _system_time(pts, target, loose, higher) for name, pts in series.items()}
    ours = systems["swarm"]
    others = {n: s for n, s in systems.items() if n != "swarm"}
    return TimeToTarget(
        metric=metric,
        higher_is_better=higher,
        target=target,
        loose_target=loose,
        systems=systems,
        speedup={n: _speedup(s.seconds, ours.seconds) for n, s in others.items()},
        loose_speedup={n: _speedup(s.loose_seconds, ours.loose_seconds) for n, s in others.items()},
    )


def kernel_up_bytes(links: dict[str, float]) -> float | None:
    """Mean bytes a site uploaded as the kernel counted them (netns mode), else None."""
    ups = [v for k, v in links.items() if k.endswith(" up")]
    return sum(ups) / len(ups) if ups else None


def mean_of_all(values: list[float | None]) -> float | None:
    """The mean when every value is known; None otherwise (a process that did not measure
    it, e.g. of an older version): a mean over some of them would pass for all."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]
