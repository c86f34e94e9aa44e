"""``report.json``, the record an experiment leaves, declared as pydantic models.

The runner builds a :class:`Report` and ``write_outputs`` writes it; ``--report DIR``, the
benchmarks and the tests read it back with ``Report.model_validate``. Keys a model does not
declare are kept (a baseline's own figures, fields of other versions), and fields that older
reports lack default to None or empty, so reports from earlier runs still load.
``records_reference()`` renders every record's fields as the tables in docs/experiments.md.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, get_args

from gossipgrad.peer.records import PeerStatus, PeerSummary
from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Sample(_Open):
    """One point of a process's training history (a peer's status.json, a rank's step)."""

    step: int = Field(description="Local step.")
    loss: float | None = Field(None, description="Training loss at that step.")
    sent_bytes: float = Field(0, description="Bytes the process had sent so far.")
    received_bytes: float = Field(0, description="Bytes it had received so far.")
    time: float | None = Field(None, description="Unix time of a peer's status write.")
    seconds: float | None = Field(None, description="Seconds since the phase's first sample.")
    consensus_distance: float | None = Field(
        None, description="A peer's local consensus-distance estimate then."
    )


class PeerResult(_Open):
    """One peer in the report: its summary.json's figures plus what the runner sampled."""

    id: str = Field(description="The peer's id.")
    ok: bool = Field(
        False,
        description="It exited cleanly with a summary and was not stopped early (a peer the "
        "runner stopped at experiment.timeout is not ok).",
    )
    final: dict[str, float] | None = Field(None, description="Final evaluation (None: failed).")
    final_seconds: float | None = Field(None, description="Training seconds at ``final``.")
    metric: str | None = Field(None, description="The task's headline metric.")
    higher_is_better: bool | None = Field(None, description="The metric's direction.")
    steps: int | None = Field(None, description="Local steps taken.")
    rounds: int | None = Field(None, description="Gossip rounds run.")
    train_loss: float | None = Field(None, description="Training loss of the last step.")
    evals: list[dict[str, float]] = Field(
        default_factory=list, description="Periodic evaluations: step, seconds, metrics."
    )
    params: int | None = Field(None, description="Number of model parameters.")
    wall_seconds: float | None = Field(None, description="The daemon's start-to-end seconds.")
    consensus_distance_estimate: float | None = Field(
        None, description="The last round's local consensus-distance estimate."
    )
    final_before_final_rounds: dict[str, float] | None = Field(
        None, description="Evaluation before ``gossip.final_rounds``."
    )
    sent_bytes: int = Field(0, description="Bytes sent, all message kinds.")
    received_bytes: int = Field(0, description="Bytes received, all message kinds.")
    dense_bytes: int = Field(0, description="The compressed updates' dense equivalent.")
    sent_update_bytes: int = Field(0, description="Bytes of compressed updates sent.")
    history: list[Sample] = Field(
        default_factory=list, description="Training progress sampled from its status.json."
    )
    compute_utilization: float | None = Field(
        None,
        description="1 - seconds blocked in gossip / training seconds (its summary.json).",
    )
    neighbours: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="Bytes per neighbour, ``{id: {sent, received}}``: the peer's final counts "
        "(its summary.json), else the last scrape of its metrics (local mode).",
    )
    relay: str | None = Field(
        None,
        description="The relay it was called through at its last status.json write (a peer "
        "nobody could dial, e.g. behind NAT); empty: called directly; None: no status.",
    )


class SwarmResult(_Open):
    """The swarm phase: every peer and the swarm-level figures."""

    ok: bool = Field(False, description="Every peer finished within experiment.timeout.")
    elapsed_seconds: float | None = Field(None, description="Seconds the phase took.")
    peers: list[PeerResult] = Field(default_factory=list, description="One entry per peer.")
    metric: str | None = Field(None, description="The task's headline metric.")
    wall_seconds: float | None = Field(
        None, description="Training seconds as sampled (start-up and waiting excluded)."
    )
    peer_wall_seconds: float | None = Field(None, description="Longest daemon lifetime.")
    mean_sent_bytes: float | None = Field(None, description="Bytes sent, mean over peers.")
    mean_received_bytes: float | None = Field(None, description="Bytes received, mean.")
    mean_dense_bytes: float | None = Field(None, description="Dense-equivalent bytes, mean.")
    compute_utilization: float | None = Field(
        None, description="Compute utilization, mean over the peers that finished."
    )
    consensus_distance: float | None = Field(
        None, description="True (1/n) Σ‖x_i − x̄‖² from the peers' final params.pt."
    )
    relative_consensus_distance: float | None = Field(
        None, description="The same over ‖x̄‖² (scale-free)."
    )
    link_emulator: dict[str, Any] | None = Field(
        None,
        description="The user-space link emulator of this phase (relays in local mode, the "
        "TUN switch in netns mode): its CPU seconds, bytes, paths.",
    )
    link_bytes: dict[str, float] = Field(
        default_factory=dict,
        description="Bytes per link: per neighbour edge (local) or per site up/down (netns).",
    )


class RankResult(_Open):
    """One baseline rank's result file (``rank<N>.json``), as far as the report reads it."""

    id: str = Field("", description="rank<N>.")
    sent_bytes: float | None = Field(None, description="Bytes it sent (None: not counted).")
    received_bytes: float | None = Field(None, description="Bytes it received.")
    communication_seconds: float | None = Field(
        None,
        description="Training seconds the rank spent waiting on communication: DDP's "
        "gradient hook, DiLoCo's outer sync, hivemind's optimizer step.",
    )
    compute_utilization: float | None = Field(
        None, description="1 - communication_seconds / training seconds."
    )
    history: list[Sample] = Field(default_factory=list, description="One sample per step.")


class BaselineResult(_Open):
    """One baseline phase (ddp, powersgd, hivemind, ...): its ranks and headline figures."""

    name: str = Field("", description="The baseline's name.")
    ok: bool = Field(False, description="Every rank finished within experiment.timeout.")
    ranks: list[RankResult | None] = Field(
        default_factory=list, description="Each rank's result (None: it wrote none)."
    )
    elapsed_seconds: float | None = Field(None, description="Seconds the phase took.")
    final: dict[str, float] | None = Field(None, description="Rank 0's final evaluation.")
    final_seconds: float | None = Field(None, description="Training seconds at ``final``.")
    evals: list[dict[str, float]] = Field(
        default_factory=list, description="Periodic evaluations: step, seconds, metrics."
    )
    metric: str | None = Field(None, description="The task's headline metric.")
    higher_is_better: bool | None = Field(None, description="The metric's direction.")
    steps: int | None = Field(None, description="Steps each rank took.")
    params: int | None = Field(None, description="Number of model parameters.")
    wall_seconds: float | None = Field(None, description="Longest training loop, seconds.")
    mean_sent_bytes: float | None = Field(
        None, description="Bytes sent per rank (None: unknown, e.g. hivemind without ss)."
    )
    mean_received_bytes: float | None = Field(None, description="Bytes received per rank.")
    dense_bytes_per_rank: float | None = Field(
        None, description="What dense ring all-reduce would send per rank."
    )
    powersgd_rank: int | None = Field(None, description="PowerSGD only: its rank.")
    powersgd_start_iter: int | None = Field(None, description="PowerSGD only: start iteration.")
    local_steps: int | None = Field(None, description="DiLoCo only: inner steps per phase (H).")
    outer_lr: float | None = Field(None, description="DiLoCo only: outer learning rate.")
    outer_momentum: float | None = Field(None, description="DiLoCo only: outer momentum.")
    pseudo_gradient_dtype: str | None = Field(
        None, description="DiLoCo only: pseudo-gradients on the wire (float32 or int8)."
    )
    outer_steps: int | None = Field(None, description="DiLoCo only: outer steps taken.")
    mean_wire_sent_bytes: float | None = Field(
        None, description="Gloo baselines: bytes each rank's TCP connections sent (ss)."
    )
    link_bytes: dict[str, float] = Field(
        default_factory=dict, description="Bytes per rank (local) or per site up/down (netns)."
    )
    link_emulator: dict[str, Any] | None = Field(
        None, description="netns mode over TUN links: the switch's CPU seconds, bytes, paths."
    )
    compute_utilization: float | None = Field(
        None, description="Compute utilization, mean over the ranks."
    )
    refused: str | None = Field(
        None,
        description="Why the runner did not run this baseline: it could not cross the "
        "swarm's links (None: it ran over them).",
    )
    network: str | None = Field(
        None,
        description="Reports before ``refused``: set when the baseline ran over other links "
        "than the swarm's (no speed-up is computed against it).",
    )


class SystemTime(_Open):
    """When one system first reached the targets (None: never)."""

    seconds: float | None = Field(None, description="Training seconds to the target.")
    step: int | None = Field(None, description="Step at which it got there.")
    loose_seconds: float | None = Field(None, description="Training seconds to the loose one.")
    loose_step: int | None = Field(None, description="Step at the loose target.")


class TimeToTarget(_Open):
    """When each system first reached DDP's final metric (``analysis.time_to_target``)."""

    metric: str = Field(description="The metric compared.")
    higher_is_better: bool = Field(description="Its direction.")
    target: float = Field(description="DDP's final value.")
    loose_target: float = Field(description="1 point under it (accuracy-type), or 2% over.")
    systems: dict[str, SystemTime] = Field(description="The swarm and each baseline.")
    speedup: dict[str, float | None] = Field(
        description="Baseline's seconds over the swarm's, per baseline that ran over the "
        "swarm's links (the others are left out)."
    )
    loose_speedup: dict[str, float | None] = Field(description="The same for the loose target.")


class Report(_Open):
    """``DIR/report.json``: one experiment run, every phase."""

    name: str = Field(description="experiment.name.")
    mode: str = Field(description="local, netns or ssh.")
    peers: int = Field(description="Number of peers (and ranks per baseline).")
    task: str = Field(description="train.task.")
    steps: int = Field(description="train.steps of each peer.")
    batch_size: int = Field(description="train.batch_size.")
    seed: int = Field(description="experiment.seed.")
    codec: str | None = Field(None, description="gossip.codec.")
    topology: str | None = Field(None, description="gossip.topology.")
    gamma: float | None = Field(None, description="gossip.gamma.")
    local_steps: int | None = Field(None, description="gossip.local_steps.")
    spec: dict[str, Any] = Field(default_factory=dict, description="The whole spec as run.")
    started: float | None = Field(None, description="Unix time the run started.")
    finished: float | None = Field(None, description="Unix time it finished.")
    namespaces: str | None = Field(None, description="netns mode: the namespaces' prefix.")
    swarm: SwarmResult = Field(default_factory=SwarmResult, description="The swarm phase.")
    baselines: dict[str, BaselineResult] = Field(
        default_factory=dict, description="Each baseline phase, by name."
    )
    ok: bool | None = Field(
        None, description="Every phase that ran succeeded (a refused baseline does not run)."
    )
    time_to_target: TimeToTarget | None = Field(
        None, description="None without a DDP result (recomputed on write)."
    )


RECORDS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("run_dir/status.json", PeerStatus),
    ("run_dir/summary.json", PeerSummary),
    ("report.json", Report),
    ("report.json: swarm", SwarmResult),
    ("report.json: swarm.peers[i]", PeerResult),
    ("report.json: swarm.peers[i].history[j], baselines.X.ranks[r].history[j]", Sample),
    ("report.json: baselines.X", BaselineResult),
    ("report.json: baselines.X.ranks[r]", RankResult),
    ("report.json: time_to_target", TimeToTarget),
    ("report.json: time_to_target.systems.X", SystemTime),
)


def _type_name(annotation: Any) -> str:
    """``int``, ``dict[str, float]``, ``list[Sample]``: module paths left out."""
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation.__name__
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(annotation))


def model_rows(model: type[BaseModel]) -> list[list[str]]:
    """(field, type, default, meaning) of every field of a model, its own before inherited."""
    own = set(inspect.get_annotations(model))
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] not in own)
    rows = []
    for name, f in fields:
        default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
        rows.append([f"`{name}`", f"`{_type_name(f.annotation)}`", default, f.description or ""])
    return rows


def records_reference() -> str:
    """Markdown: one table per record (the part of docs/experiments.md between its
    ``records`` markers is exactly this)."""
    from gossipgrad.experiment.markdown import table

    parts = []
    for where, model in RECORDS:
        doc = (model.__doc__ or "").strip().replace("\n", " ")
        parts += [f"#### {where} ({model.__name__})", "", " ".join(doc.split()), ""]
        parts += [table(["field", "type", "default", "meaning"], model_rows(model)), ""]
    return "\n".join(parts)


BEGIN, END = "<!-- records:begin -->", "<!-- records:end -->"


def with_records_reference(page: str) -> str:
    """``page`` (markdown) with the part between its records markers regenerated."""
    head, sep, rest = page.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"no {BEGIN} ... {END} section in the page")
    return f"{head}{BEGIN}\n{records_reference()}{END}{tail}"
