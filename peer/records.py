"""The files a peer daemon leaves in its ``run_dir`` for others to read, as declared records.

``status.json`` (:class:`PeerStatus`) is rewritten atomically every few steps while the peer
runs; ``summary.json`` (:class:`PeerSummary`) once, at the end. The daemon writes both through
these models and every reader (``gossipgrad-swarm``, the experiment runner, the Prometheus
config writer, the benchmarks) parses them with the same models, so a field's name, type and
meaning are stated once, here. Keys a model does not declare are kept (the byte counters per
message kind, fields of newer or older daemons), so files from other versions still read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Record = TypeVar("Record", bound=BaseModel)


class RecordError(ValueError):
    """A record file holds valid JSON that does not fit its model (wrong type of a field)."""


class _Open(BaseModel):
    """Records keep keys they do not declare (other versions' fields, per-kind counters)."""

    model_config = ConfigDict(extra="allow")


class TrafficTotals(_Open):
    """Bytes a peer put on the wire so far, from its Prometheus counters. Per message kind
    (``sent_<kind>_bytes``, ``received_<kind>_bytes``) they are extra keys."""

    sent_bytes: int = Field(0, description="Bytes sent to neighbours, all message kinds.")
    received_bytes: int = Field(0, description="Bytes received from neighbours, all kinds.")
    dense_bytes: int = Field(
        0, description="What the compressed updates would have cost sent dense (float32)."
    )
    sent_update_bytes: int = Field(
        0, description="Bytes of compressed model updates sent (the compressed part of sent)."
    )


class ReachabilityStatus(_Open):
    """What the dial-back at start found (peer/runtime/reachability.py)."""

    status: str = Field(
        "unknown", description="reachable, unreachable, or unknown (no member could check)."
    )
    address: str = Field("", description="The advertised address that was dialled.")
    cause: str = Field(
        "",
        description="Why unreachable (refused, timed_out, wrong_identity, failed) or unknown "
        "(first_peer, no_answer, not_supported, busy, refused_check); empty when reachable.",
    )
    checker: str = Field("", description="Id of the member that dialled back.")
    detail: str = Field("", description="The transport's words, for a human.")


class PeerStatus(TrafficTotals):
    """``run_dir/status.json``: a running peer's progress, rewritten every few steps."""

    id: str = Field("", description="The peer's id (``peer.id``).")
    address: str | None = Field(None, description="host:port its gossip server advertises.")
    metrics_port: int | None = Field(
        None, description="Port of its Prometheus endpoint (0: metrics off)."
    )
    pid: int | None = Field(None, description="Process id of the daemon (to signal it).")
    state: str = Field(
        "starting", description="starting, training, final-rounds or done (the last write)."
    )
    step: int = Field(0, description="Local optimizer steps taken so far.")
    steps: int | None = Field(None, description="Steps it will take (``train.steps``).")
    time: float | None = Field(None, description="Unix time of this write.")
    loss: float | None = Field(None, description="Training loss of the latest step.")
    consensus_distance: float | None = Field(
        None, description="The latest round's local consensus-distance estimate."
    )
    joined_at_step: int | None = Field(
        None, description="Step it took over from the swarm when it joined late."
    )
    start_step: int | None = Field(
        None, description="Step training started from: 0, or a checkpoint's or donor's step."
    )
    start_params: str | None = Field(
        None,
        description="Digest of the parameters training started from (checkpoint.params_digest; "
        "a donor logs the digest of the state it serves).",
    )
    start_lr: float | None = Field(
        None, description="Learning rate of the first step taken (the schedule at start_step)."
    )
    start_schedule_step: int | None = Field(
        None,
        description="Step the learning-rate schedule stood at then (start_step once it was "
        "fast-forwarded; a restored optimizer alone gets start_lr right but not the steps after).",
    )
    final: dict[str, float] | None = Field(
        None, description="Final evaluation (metric name -> value), once training ended."
    )
    reachability: ReachabilityStatus | None = Field(
        None,
        description="Whether a member could dial this peer back at start: status (reachable, "
        "unreachable, unknown), address, cause, checker (the member's id), detail.",
    )
    relay: str | None = Field(
        None,
        description="Id of the member this peer is called through (docs/transport.md, Relays); "
        "empty: called directly.",
    )
    algorithm: str | None = Field(None, description="The gossip algorithm (``gossip.algorithm``).")
    anchor_checksum: str | None = Field(
        None,
        description="exact-diloco: checksum (hex) of the anchor the next phase starts from; "
        "every peer of a swarm whose replicas agree shows the same at the same phase.",
    )
    max_staleness: int | None = Field(
        None,
        description="The staleness bound the latest gossip round waited under: "
        "``gossip.max_staleness``, or what ``auto`` chose from the measured round trip.",
    )
    overlap: bool | None = Field(
        None,
        description="diloco: whether the latest phase end overlapped its exchange with the "
        "next phase: ``gossip.overlap``, or what ``auto`` chose from the measured round trip.",
    )
    algorithm_defaults: dict[str, Any] | None = Field(
        None,
        description="The ``[gossip]`` keys left unset that took the algorithm's recommended "
        "value (key -> value; peer/config/recommended.py); a key set explicitly is not here.",
    )


class SiteSummary(_Open):
    """The ``site`` entry of a multi-rank site's summary (docs/hierarchical.md)."""

    rank: int = Field(description="This process's rank within the site.")
    world_size: int = Field(description="Ranks in the site.")
    rounds_verified: int = Field(0, description="Gossip rounds whose state all ranks matched.")


class PeerSummary(TrafficTotals):
    """``run_dir/summary.json``: what a peer did, written once when it ends."""

    id: str = Field(description="The peer's id.")
    task: str = Field("", description="The task it trained (``train.task``).")
    steps: int = Field(description="Local optimizer steps taken.")
    rounds: int = Field(0, description="Gossip rounds run (final rounds included).")
    stopped_early: bool = Field(False, description="Stopped by a signal before its last step.")
    metric: str = Field(description="Name of the task's headline metric.")
    higher_is_better: bool | None = Field(
        None, description="The metric's direction (None in files from before it was recorded)."
    )
    final: dict[str, float] = Field(description="Final evaluation: metric name -> value.")
    final_seconds: float | None = Field(
        None, description="Training seconds (evaluation excluded) at the final evaluation."
    )
    final_before_final_rounds: dict[str, float] | None = Field(
        None, description="Evaluation before ``gossip.final_rounds`` (None without them)."
    )
    train_loss: float = Field(description="Training loss of the last step.")
    consensus_distance_estimate: float | None = Field(
        None, description="The last round's local consensus-distance estimate."
    )
    evals: list[dict[str, float]] = Field(
        default_factory=list,
        description="Every ``train.eval_every`` steps: step, seconds and the task's metrics.",
    )
    params: int = Field(description="Number of model parameters.")
    wall_seconds: float | None = Field(
        None, description="Seconds from start-up to the end, waiting and evaluation included."
    )
    cpu_seconds: float | None = Field(
        None,
        description="CPU seconds of the whole process (training, gRPC and heartbeat threads) "
        "from start-up to the end.",
    )
    gossip_blocking_seconds: float = Field(
        0.0, description="Training-thread seconds spent blocked in gossip (rounds, exchanges)."
    )
    compute_utilization: float | None = Field(
        None,
        description="1 - gossip_blocking_seconds / final_seconds: the share of training time "
        "spent computing rather than waiting for the network.",
    )
    neighbours: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="Bytes per neighbour at the end, ``{id: {sent, received}}`` (heartbeats "
        "left out; departed neighbours summed under ``(departed)``).",
    )
    exchanges: dict[str, int] = Field(
        default_factory=dict,
        description="CHOCO exchanges completed per neighbour at the end (both ends of an edge "
        "count the same; departed neighbours summed under ``(departed)``).",
    )
    anchor_checksums: dict[int, str] = Field(
        default_factory=dict,
        description="exact-diloco: phase -> checksum (hex) of the anchor the phase started "
        "from, the latest 4,096 phases (identical replicas: the same at every peer).",
    )
    site: SiteSummary | None = Field(None, description="Multi-rank sites only: this rank.")


def read_record(path: Path | str, model: type[Record]) -> Record | None:
    """The record in ``path``, or None while it is missing or not (yet) valid JSON.

    Raises:
        RecordError: valid JSON whose declared fields have the wrong type.
    """
    try:
        text = Path(path).read_text()
        data = json.loads(text)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise RecordError(f"{path}: not a {model.__name__}: {key}: {first['msg']}") from None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so that a reader polling
    ``path`` sees the old content or the new, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def write_record(path: Path, record: BaseModel) -> None:
    """Write ``record`` atomically (see :func:`write_json_atomic`)."""
    write_json_atomic(path, record.model_dump(mode="json"))
