"""The report's swarm entry, built once the swarm has stopped: each peer's summary.json plus
what the runner sampled, and the figures over all peers that finished."""

from __future__ import annotations

from pathlib import Path

from gossipgrad.experiment.analysis import consensus_distance, mean_of_all
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.experiment.records import PeerResult, Sample, SwarmResult
from gossipgrad.experiment.ssh import SshSwarm
from gossipgrad.experiment.swarm_sampling import EdgeBytes, SwarmSampler
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record


def peer_result(
    i: int, run_dir: Path, ok: bool, history: list[Sample], edges: EdgeBytes
) -> PeerResult:
    """Peer i's entry: its summary.json (when it wrote one) plus the sampled history.

    Bytes per neighbour come from the summary (the final counts) when it has them, else
    from the last scrape (``edges``: up to ``SCRAPE_EVERY_S`` old, empty for a run shorter
    than that)."""
    summary = read_record(run_dir / "summary.json", PeerSummary)
    status = read_record(run_dir / "status.json", PeerStatus)
    finished = summary is not None and not summary.stopped_early
    entry = PeerResult(
        id=f"peer{i}",
        ok=ok and finished,
        history=history,
        neighbours=edges,
        relay=None if status is None else status.relay or "",
    )
    if summary is None:
        return entry
    fields = set(PeerResult.model_fields) - {"ok", "history", "relay"}
    if not summary.neighbours:
        fields.discard("neighbours")
    return entry.model_copy(update=summary.model_dump(include=fields))


def _stamp_seconds(history: list[list[Sample]]) -> None:
    """Set each sample's ``seconds`` since the first sample of any peer."""
    t_start = min((h[0].time for h in history if h and h[0].time), default=0.0)
    for hist in history:
        for h in hist:
            h.seconds = (h.time or t_start) - t_start


def _summarize_finished(result: SwarmResult, done: list[PeerResult]) -> None:
    """The figures over the peers that finished: metric, wall time, mean bytes."""
    result.metric = done[0].metric
    # Training time as sampled from status.json (start-up and waiting excluded),
    # comparable with the baselines' training-loop time.
    result.wall_seconds = max(
        (p.history[-1].seconds or 0.0 for p in done if p.history), default=0.0
    )
    result.peer_wall_seconds = max(p.wall_seconds or 0.0 for p in done)
    result.mean_sent_bytes = sum(p.sent_bytes for p in done) / len(done)
    result.mean_received_bytes = sum(p.received_bytes for p in done) / len(done)
    result.mean_dense_bytes = sum(p.dense_bytes for p in done) / len(done)
    result.compute_utilization = mean_of_all([p.compute_utilization for p in done])


def swarm_result(
    swarm: LocalSwarm | SshSwarm,
    n: int,
    sampled: SwarmSampler,
    link_bytes: dict[str, int],
    ok: bool,
    elapsed: float,
) -> SwarmResult:
    """The swarm phase's result; ``ok`` only if it ran in time, no peer failed and all
    ``n`` finished. ``link_bytes``: per access link (netns), else per edge from the scrapes."""
    failed = swarm.failed()
    _stamp_seconds(sampled.history)
    peers = [
        peer_result(
            i, swarm.peer_dir(i), i not in failed, sampled.history[i], sampled.edges.get(i, {})
        )
        for i in range(n)
    ]
    done = [p for p in peers if p.final]
    result = SwarmResult(
        ok=ok and not failed and len(done) == n, elapsed_seconds=elapsed, peers=peers
    )
    if done:
        _summarize_finished(result, done)
    cd = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in range(n)])
    if cd is not None:
        result.consensus_distance, result.relative_consensus_distance = cd
    result.link_bytes = link_bytes or {
        f"{p.id}→{nb}": c["sent"] for p in peers for nb, c in p.neighbours.items()
    }
    return result
