"""The figures of a churn run, from its :class:`~gossipgrad.experiment.bench.churn.ChurnTrace`.

* **Window**: from the moment every first-generation peer has trained a step to the moment the
  first peer reaches ``train.steps``. Start-up and the tail (peers finishing one by one) are
  left out, so a run with churn and one without are compared over their steady part.
* **Useful steps**: the optimizer steps all peers took inside the window (each life's step
  increments between two status samples), less the steps a restarted peer takes again because
  its crash lost them (its last step before SIGKILL minus the checkpoint step it resumed from).
* **Throughput**: useful steps per second of the window. **Goodput** is the throughput with
  churn over the throughput of the same swarm without churn. On one machine whose cores the
  peers share, fewer live peers each get more CPU, so this counts what the swarm as a whole
  got done; the rate per live peer-second is given too.
* **Max stall**: the longest stretch of the window in which no peer advanced a step (status
  samples every ``poll_s``, status.json rewritten every 0.5 s: finer stalls are not seen).
* **Survivors' CPU**: the median CPU seconds (whole process) of the peers that trained from
  the start to the end in one life: with and without churn, what churn costs the peers it
  does not touch.
* **Restarts and joins**: seconds from the life's gRPC server start (its log line) to its
  first mixed exchange (from its metrics), its rounds by then, and how far behind the swarm's
  median step it began training, in rounds.
"""

from __future__ import annotations

import datetime
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path

from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.bench.churn import WORKING, ChurnTrace, Life, StatusSample
from gossipgrad.peer.records import PeerSummary, read_record

SERVING = "serving gossip on"


@dataclass(frozen=True)
class NewLife:
    """A restarted or joined peer life."""

    peer: int
    how: str
    start_step: int | None
    lag_rounds: float | None  # swarm median step minus its start step, in rounds
    first_exchange_s: float | None  # from its gRPC server start
    first_exchange_rounds: int | None
    spare: bool = False  # a warm spare took it


@dataclass(frozen=True)
class ChurnFigures:
    """What :func:`figures` measures over one run."""

    window_s: float
    useful_steps: int
    redone_steps: int
    throughput: float  # useful steps per second
    per_peer_rate: float  # useful steps per live peer-second
    max_stall_s: float
    events: int
    final_peers: int
    relative_consensus_distance: float | None
    new_lives: list[NewLife]
    survivor_cpu_s: float | None = None


def _by_life(trace: ChurnTrace) -> dict[int, list[StatusSample]]:
    """Each life's working samples (by pid), in time order. Samples below the step the life
    started from are left out: a joined peer's first status.json writes say step 0, and a
    restarted one's its checkpoint's step, until its first step past the state it trains
    from (a restarted peer may take a donor's, further on)."""
    floor = {life.pid: life.start_step or 0 for life in trace.lives}
    out: dict[int, list[StatusSample]] = {}
    for s in trace.samples:
        if (s.state in WORKING or s.state == "done") and s.step >= floor.get(s.pid, 0):
            out.setdefault(s.pid, []).append(s)
    return out


def window(trace: ChurnTrace) -> tuple[float, float]:
    """(start, end) unix times of the steady window (see the module docstring)."""
    lives = _by_life(trace)
    first = [life for life in trace.lives if life.how == "start"]
    starts = []
    for life in first:
        moved = [s.time for s in lives.get(life.pid, []) if s.step > (life.start_step or 0)]
        if moved:
            starts.append(moved[0])
    start = max(starts) if starts else trace.started
    done = [s.time for s in trace.samples if s.step >= trace.steps or s.state == "done"]
    end = min(done) if done else trace.ended
    return start, max(start, end)


def _advances(trace: ChurnTrace, start: float, end: float) -> tuple[int, list[float], float]:
    """(steps advanced in the window, times of advances, live peer-seconds in the window)."""
    total, times, peer_seconds = 0, [], 0.0
    for samples in _by_life(trace).values():
        inside = [s for s in samples if start <= s.time <= end]
        if inside:
            peer_seconds += inside[-1].time - inside[0].time
        prev = None
        for s in samples:
            if prev is not None and s.time > start and s.time <= end and s.step > prev.step:
                total += s.step - prev.step
                times.append(s.time)
            prev = s
    return total, sorted(times), peer_seconds


def _lives_by_peer(trace: ChurnTrace) -> dict[int, list[Life]]:
    """Each peer's lives, in the order they began."""
    by_peer: dict[int, list[Life]] = {}
    for life in trace.lives:
        by_peer.setdefault(life.peer, []).append(life)
    return by_peer


def redone_steps(trace: ChurnTrace) -> int:
    """Steps taken twice: a SIGKILLed life's last step minus the checkpoint step its peer's
    next life resumed from."""
    redone = 0
    for lives in _lives_by_peer(trace).values():
        for before, after in itertools.pairwise(lives):
            if before.end == "sigkill" and after.start_step is not None:
                redone += max(0, before.last_step - after.start_step)
    return redone


def max_stall(times: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive advances, the window's edges included."""
    points = [start, *[t for t in times if start <= t <= end], end]
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


def server_starts(log_file: Path) -> list[float]:
    """Unix times of each life's "serving gossip on" line in a peer's log (local time)."""
    if not log_file.exists():
        return []
    out = []
    for line in log_file.read_text(errors="replace").splitlines():
        if SERVING in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            out.append(stamp.timestamp())
    return out


def _lag_rounds(trace: ChurnTrace, pid: int, lives: dict[int, list[StatusSample]]) -> float | None:
    """Swarm median step (other lives, their latest sample) minus this life's first working
    step, in rounds."""
    mine = lives.get(pid)
    if not mine:
        return None
    t0, step0 = mine[0].time, mine[0].step  # at least the step it started from
    latest: dict[int, int] = {}
    for other, samples in lives.items():
        if other == pid:
            continue
        before = [s for s in samples if s.time <= t0 and s.state in WORKING]
        if before and samples[-1].time >= t0:
            latest[other] = before[-1].step
    if not latest:
        return None
    return (statistics.median(latest.values()) - step0) / trace.local_steps


def new_lives(trace: ChurnTrace, out: Path) -> list[NewLife]:
    """The figures of every restarted and joined life."""
    lives = _by_life(trace)
    logs = [Path(x.log) if x.log else out / f"peer{x.peer}.log" for x in trace.lives]
    starts = {log: server_starts(log) for log in set(logs)}
    count: dict[Path, int] = {}  # a log's lives so far: the k-th life is its k-th start
    result = []
    for life, log in zip(trace.lives, logs, strict=True):
        k = count.get(log, 0)
        count[log] = k + 1
        if life.how == "start":
            continue
        started = starts[log][k] if k < len(starts[log]) else None
        # The peer's own figure where it exported one; else the driver's first scrape that
        # saw a mixing round (later by up to a scrape interval and the driver's own delay).
        first = life.first_mix_s
        if first is None and life.first_exchange is not None and started is not None:
            first = life.first_exchange - started
        result.append(
            NewLife(
                peer=life.peer,
                how=life.how,
                start_step=life.start_step,
                lag_rounds=_lag_rounds(trace, life.pid, lives),
                first_exchange_s=first,
                first_exchange_rounds=life.first_exchange_rounds,
                spare=life.spare,
            )
        )
    return result


def final_params(trace: ChurnTrace, out: Path) -> list[Path]:
    """params.pt of every peer whose last life trained to the end."""
    files = []
    for i in sorted({life.peer for life in trace.lives}):
        run_dir = out / f"peer{i}"
        summary = read_record(run_dir / "summary.json", PeerSummary)
        if summary and not summary.stopped_early and summary.steps >= trace.steps:
            files.append(run_dir / "params.pt")
    return files


def figures(trace: ChurnTrace, out: Path) -> ChurnFigures:
    """Every figure of one run (``out``: the swarm's directory: logs, run dirs)."""
    start, end = window(trace)
    advanced, times, peer_seconds = _advances(trace, start, end)
    redone = redone_steps(trace)
    useful = max(0, advanced - redone)
    span = max(end - start, 1e-9)
    params = final_params(trace, out)
    cd = consensus_distance(params)
    return ChurnFigures(
        window_s=end - start,
        useful_steps=useful,
        redone_steps=redone,
        throughput=useful / span,
        per_peer_rate=useful / peer_seconds if peer_seconds > 0 else 0.0,
        max_stall_s=max_stall(times, start, end),
        events=len(trace.events),
        final_peers=len(params),
        relative_consensus_distance=cd[1] if cd else None,
        new_lives=new_lives(trace, out),
        survivor_cpu_s=survivor_cpu_seconds(trace, out),
    )


def survivor_cpu_seconds(trace: ChurnTrace, out: Path) -> float | None:
    """Median ``cpu_seconds`` of the peers that trained to the end in their first life."""
    cpu = []
    for peer, mine in _lives_by_peer(trace).items():
        if len(mine) != 1 or mine[0].how != "start":
            continue
        summary = read_record(out / f"peer{peer}" / "summary.json", PeerSummary)
        if summary and summary.cpu_seconds and summary.steps >= trace.steps:
            cpu.append(summary.cpu_seconds)
    return statistics.median(cpu) if cpu else None
