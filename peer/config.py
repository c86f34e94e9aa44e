"""The peer's configuration: one validated structure, loaded from TOML plus CLI overrides.

Each TOML section maps onto one pydantic model below, and each field's description is the
documentation of that key (``gossipgrad-peer --help`` and docs/config.md are generated from
it). Unknown keys and bad values fail before anything starts, with a one-line message naming
the key. Components receive only their own section, never the whole config.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ADDRESS_PATTERN = r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):\d{1,5}$"
Address = Annotated[str, Field(pattern=ADDRESS_PATTERN)]


class PeerSection(Section):
    """Who this peer is and how it reaches the swarm."""

    id: str = Field(
        "",
        description="Unique name of this peer in the swarm (letters, digits, '-', '_', '.'). "
        "Empty: derived from the host name and listen port.",
        pattern=r"^[A-Za-z0-9_.\-]{0,64}$",
    )
    swarm: str = Field(
        "gossipgrad",
        description="Swarm name; peers refuse updates from another swarm.",
        pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
    )
    listen: Address = Field(
        "127.0.0.1:0",
        description="host:port the gossip server binds; port 0 picks a free one.",
    )
    advertise: str = Field(
        "",
        description="host:port other peers use to reach this one. Empty: the listen host "
        "with the bound port.",
        pattern=rf"^$|{ADDRESS_PATTERN}",
    )
    bootstrap: list[Address] = Field(
        default_factory=list,
        description="Addresses of peers already in the swarm; one is enough to join. Empty "
        "for the first peer.",
    )
    run_dir: Path = Field(
        Path("runs/peer"),
        description="Directory for checkpoints, status.json and the final summary.",
    )
    expected_peers: int = Field(
        1,
        ge=1,
        description="Wait at start until this many peers (self included) are known, so a "
        "swarm started together begins with its full topology.",
    )
    start_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds to wait for expected_peers before training anyway.",
    )
    join_after_steps: int = Field(
        20,
        ge=0,
        description="A fresh peer (no checkpoint) downloads model and optimizer state from "
        "the most advanced peer when that one is at least this many steps in; peers started "
        "together begin from the same seeded initialisation instead.",
    )


class TrainSection(Section):
    """What this peer trains and how (local optimizer, data shard)."""

    task: str = Field(
        "digits",
        description="Built-in task (digits, fashion-mnist-mlp, fashion-mnist-cnn, "
        "shakespeare) or a user task 'package.module:factory'.",
    )
    steps: int = Field(300, ge=0, description="Local optimizer steps to run.")
    batch_size: int = Field(32, ge=1, description="Samples per local step.")
    seed: int = Field(0, ge=0, description="Seed of model init, data split and sampling.")
    shard_index: int = Field(0, ge=0, description="This peer's shard of the built-in data.")
    num_shards: int = Field(1, ge=1, description="Number of shards the data is split into.")
    partition: Literal["iid", "dirichlet"] = Field(
        "iid", description="How data is split over shards: iid, or non-IID Dirichlet(alpha)."
    )
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration for partition=dirichlet.")
    optimizer: Literal["sgd", "adam", "adamw"] = Field("sgd", description="Local optimizer.")
    lr: float = Field(0.05, gt=0, description="Learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (sgd only).")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    schedule: Literal["constant", "cosine"] = Field(
        "cosine",
        description="Learning rate after warm-up: cosine decay from lr to min_lr_ratio x lr "
        "at the last step (default: the peers' disagreement shrinks with the step size, so "
        "they end close together; see BENCHMARKS.md), or constant.",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Final learning rate of the cosine schedule, as a fraction of lr.",
    )
    eval_every: int = Field(100, ge=0, description="Evaluate every N steps (0: only at the end).")
    device: str = Field("auto", description="torch device: auto (cuda if available), cpu, cuda:N.")
    threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads (0: torch's default). 1 suits many peers per host.",
    )
    verify_site: bool = Field(
        False,
        description="Under torchrun (one site, many ranks): after every gossip round, check "
        "that all ranks hold bit-identical parameters (one tiny all-gather; for tests).",
    )

    @model_validator(mode="after")
    def _shard_in_range(self) -> TrainSection:
        if self.shard_index >= self.num_shards:
            raise ValueError(
                f"train.shard_index={self.shard_index} must be < train.num_shards={self.num_shards}"
            )
        return self


class GossipSection(Section):
    """How peers exchange and merge models (Koloskova et al., ICML 2019: CHOCO-SGD)."""

    algorithm: Literal["choco", "ef-gradient", "diloco"] = Field(
        "choco",
        description="choco: compressed model gossip with public copies (default). "
        "ef-gradient: compressed gradient exchange with error feedback, plus choco gossip "
        "every consensus_every rounds to keep models together. diloco: phases of "
        "local_steps inner steps, error-feedback-compressed pseudo-gradients averaged over "
        "the neighbours, an outer SGD step with Nesterov momentum on an anchor, and choco "
        "gossip that keeps the anchors together (for AdamW transformers; docs/algorithms.md).",
    )
    codec: str = Field(
        "topk:0.01+int8",
        description="Compression spec, e.g. none, fp16, int8, int4, sign, qsgd:16, "
        "topk:0.01, randomk:0.01, topk:0.01+int8 (docs/compression.md).",
    )
    topology: str = Field(
        "ring",
        description="ring, torus, full, random-regular, exponential, one-peer-exponential "
        "(docs/topologies.md).",
    )
    degree: int | None = Field(
        None,
        ge=2,
        description="Degree of the random-regular topology (empty: 3); other topologies "
        "have a fixed shape and reject it.",
    )
    gamma: float = Field(
        0.03,
        gt=0,
        le=1,
        description="CHOCO consensus step size: x_i += gamma * sum_j w_ij (xhat_j - xhat_i). "
        "Stability needs it small against the codec's precision (Koloskova et al. 2019): "
        "with topk:0.01 on digits, 0.1 drifted apart over a few thousand rounds while 0.03 "
        "stayed in consensus; dense-ish codecs (fp16, int8) tolerate 0.5.",
    )
    local_steps: int = Field(
        1,
        ge=1,
        description="Optimizer steps between gossip rounds (H); diloco: inner steps per phase "
        "(tens to hundreds).",
    )
    outer_lr: float = Field(
        0.7,
        gt=0,
        le=2,
        description="diloco: outer learning rate (DiLoCo, Douillard et al. 2023: 0.7).",
    )
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="diloco: outer momentum (DiLoCo: 0.9; 0: none)."
    )
    outer_nesterov: bool = Field(
        True, description="diloco: Nesterov momentum in the outer step (false: heavy ball)."
    )
    anchor_codec: str = Field(
        "int8",
        description="diloco: codec of the CHOCO gossip that keeps the anchors together (codec "
        "compresses the pseudo-gradients). An anchor moves densely once a phase, so it needs "
        "a codec precise enough for a large anchor_gamma.",
    )
    anchor_gamma: float = Field(
        0.5,
        gt=0,
        le=1,
        description="diloco: consensus step of the anchors' CHOCO gossip (0.5 with int8 held "
        "4 peers on digits at 3.6e-6 relative consensus distance; 0.03 with top-1% let them "
        "drift apart).",
    )
    overlap: bool = Field(
        False,
        description="diloco: exchange a phase's pseudo-gradient while the next phase "
        "computes, applying it one phase late (hides a WAN round trip behind compute).",
    )
    consensus_every: int = Field(
        1,
        ge=1,
        description="ef-gradient: local steps between CHOCO model-gossip rounds that keep the "
        "models together (1-2 measured best on digits; 4 and more lost accuracy).",
    )
    ef_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="ef-gradient: DGC momentum correction (Lin et al. 2018), the momentum "
        "folded into the compressed gradient; use it with a momentum-free local optimizer "
        "(0: off).",
    )
    error_feedback: bool = Field(
        True,
        description="Keep what the codec drops and send it later (error feedback). false is "
        "the ablation without it, where dropped information is lost for good. choco: each "
        "edge sends q = Q(x - b), b being x at the previous send on that edge (DCD-PSGD "
        "difference compression without memory, Tang et al. 2018) instead of "
        "Q(x - xhat), so xhat drifts away from x; costs one more model-sized copy per "
        "out-edge. ef-gradient: c = Q(g) with no residual, and its choco consensus rounds "
        "drop error feedback as above. Both ends of an edge stay identical either way.",
    )
    final_rounds: int = Field(
        0,
        ge=0,
        description="Gossip-only rounds after the last training step (no gradients, the "
        "same codec): the peers' models move towards their average, so each site ends "
        "closer to the swarm's consensus. Every peer of a swarm must use the same value. "
        "Pure consensus: keep gamma in the range where gossip alone converges "
        "(scripts/bench_consensus.py; 0.03 with top-1%, not 0.1).",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1,
        description="0: each round waits for the exchanges it opens (lock-step). 1: an "
        "exchange opened in one round is waited for and mixed in the next, so compute "
        "overlaps communication. Both ends of an edge mix the same copies either way; "
        "waiting is bounded by round_timeout.",
    )
    round_timeout: float = Field(
        10.0, gt=0, description="Seconds to wait for a lagging neighbour before suspecting it."
    )
    robust_clip: float = Field(
        0.0,
        ge=0,
        description="Robust merging against a faulty or malicious neighbour: clip each "
        "neighbour's pull xhat_j - xhat_i to this L2 norm before mixing (self-centred "
        "clipping, He, Karimireddy, Jaggi 2022, ClippedGossip). 0: off (plain CHOCO). Set it "
        "to a few times the usual gossipgrad_consensus_distance; see SECURITY.md.",
    )

    @field_validator("codec", "anchor_codec")
    @classmethod
    def _codec_parses(cls, spec: str) -> str:
        from gossipgrad.compression import from_spec

        return from_spec(spec).spec

    @model_validator(mode="after")
    def _topology_known(self) -> GossipSection:
        from gossipgrad.peer.topology import topology_from_name

        topology_from_name(self.topology, seed=0, degree=self.degree)
        return self


class MembershipSection(Section):
    """Failure detection: heartbeats, suspicion, removal (phi-less, timeout based)."""

    heartbeat_interval: float = Field(0.5, gt=0, description="Seconds between heartbeats.")
    suspect_after: float = Field(
        3.0, gt=0, description="Seconds of silence before a peer is suspect (excluded from mixing)."
    )
    dead_after: float = Field(
        10.0, gt=0, description="Seconds of silence before a peer is dropped from the topology."
    )
    far_every: int = Field(
        4,
        ge=1,
        description="Heartbeat peers that are not gossip neighbours only every N intervals "
        "(neighbours every interval), so heartbeat bytes per peer grow slowly with the swarm.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> MembershipSection:
        if not self.heartbeat_interval < self.suspect_after <= self.dead_after:
            raise ValueError(
                "membership: need heartbeat_interval < suspect_after <= dead_after, got "
                f"{self.heartbeat_interval} / {self.suspect_after} / {self.dead_after}"
            )
        if self.far_every * self.heartbeat_interval >= self.dead_after:
            raise ValueError(
                "membership: far_every * heartbeat_interval must stay below dead_after, got "
                f"{self.far_every} * {self.heartbeat_interval} >= {self.dead_after}"
            )
        return self


class CheckpointSection(Section):
    """Atomic checkpoints (temp file + fsync + rename) and resume."""

    every: int = Field(100, ge=0, description="Checkpoint every N steps (0: only at exit).")
    resume: bool = Field(True, description="Resume from run_dir/checkpoint.pt if it exists.")


class MetricsSection(Section):
    """Prometheus endpoint."""

    enabled: bool = Field(True, description="Serve Prometheus metrics over HTTP.")
    host: str = Field(
        "127.0.0.1", description="Address the metrics endpoint binds (loopback by default)."
    )
    port: int = Field(0, ge=0, le=65535, description="Metrics port (0: a free one).")


class TransportSection(Section):
    """gRPC limits and timeouts."""

    chunk_bytes: int = Field(1 << 20, ge=4096, le=4 << 20, description="Streaming chunk size.")
    max_payload_bytes: int = Field(
        1 << 30, ge=1 << 16, description="Largest update or state a peer accepts."
    )
    push_timeout: float = Field(30.0, gt=0, description="Deadline of one push, seconds.")
    retries: int = Field(3, ge=0, description="Retries of an idempotent call on UNAVAILABLE.")
    dial_via: list[str] = Field(
        default_factory=list,
        description="Connect to some peers through another address, e.g. an emulated WAN "
        "link: entries FROM=VIA, where FROM is a peer's host:port, or a bare host for every "
        "port on it, and VIA the host:port actually dialled. Peers are still known by their "
        "own addresses. The experiment runner sets it for its link emulator.",
    )

    @field_validator("dial_via")
    @classmethod
    def _dial_via(cls, v: list[str]) -> list[str]:
        addr = r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+)"
        for entry in v:
            if not re.fullmatch(rf"{addr}(:\d{{1,5}})?={addr}:\d{{1,5}}", entry):
                raise ValueError(f"{entry!r} must look like HOST[:PORT]=HOST:PORT")
        return v

    def dial_target(self, address: str) -> str:
        """The address to dial for a peer at ``address`` (``dial_via``, else itself)."""
        via = dict(entry.split("=", 1) for entry in self.dial_via)
        return via.get(address) or via.get(address.rsplit(":", 1)[0]) or address


class SecuritySection(Section):
    """Peer authentication and admission limits (SECURITY.md).

    Mutual TLS is required as soon as any address (listen, advertise, bootstrap) is not
    loopback; a swarm that lives entirely on 127.0.0.1 / ::1 may run plaintext without
    certificates. Plaintext on other addresses needs ``insecure = true`` (or ``--insecure``)
    and is logged as a warning.
    """

    ca: str = Field(
        "",
        description="PEM file of the swarm CA certificate; peers must present a certificate "
        "it signed (make them with 'gossipgrad-peer certs').",
    )
    cert: str = Field(
        "",
        description="PEM file of this peer's certificate; its common name must equal peer.id.",
    )
    key: str = Field("", description="PEM file of this peer's private key (keep it mode 0600).")
    token: str = Field(
        "",
        description="Optional shared swarm secret every call must carry, on top of TLS. Prefer "
        "the GOSSIPGRAD_TOKEN environment variable to writing it into a file.",
    )
    insecure: bool = Field(
        False,
        description="Allow plaintext gRPC on non-loopback addresses (no authentication, no "
        "encryption). For trusted private networks only.",
    )
    max_streams_per_peer: int = Field(
        8, ge=0, description="Calls one peer may have in flight on this server (0: no limit)."
    )
    peer_rate: float = Field(
        1000.0, ge=0, description="Sustained calls per second one peer may make (0: no limit)."
    )
    peer_burst: int = Field(2000, ge=1, description="Calls a quiet peer may make at once.")

    @model_validator(mode="after")
    def _tls_files_together(self) -> SecuritySection:
        given = [k for k in ("ca", "cert", "key") if getattr(self, k)]
        if given and len(given) != 3:
            raise ValueError(f"security: set all of ca, cert and key, not only {given}")
        if given and self.insecure:
            raise ValueError("security: insecure = true contradicts ca/cert/key; drop one")
        return self


class PeerConfig(Section):
    """The whole configuration of one peer daemon."""

    peer: PeerSection = Field(default_factory=PeerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    gossip: GossipSection = Field(default_factory=GossipSection)
    membership: MembershipSection = Field(default_factory=MembershipSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    security: SecuritySection = Field(default_factory=SecuritySection)


def _one_line(err: ValidationError) -> str:
    """Turn pydantic's report into 'key: problem' lines (one per error)."""
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    node = tree
    for s in sections:
        node = node.setdefault(s, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{s}' is not a section")
    node[leaf] = value


def build_config(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Validate a raw TOML tree plus dotted-key overrides into a PeerConfig.

    Raises:
        ConfigError: naming each bad key and why.
    """
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for key, value in (overrides or {}).items():
        _set_path(tree, key, value)
    try:
        return PeerConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> PeerConfig:
    """Read a TOML file (or none) and apply overrides; see build_config."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return build_config(raw, overrides)


def iter_fields() -> list[tuple[str, Any, str, Any]]:
    """(dotted key, annotation, description, default) for every leaf key, in order."""
    out = []
    for section_name, section_field in PeerConfig.model_fields.items():
        model = section_field.annotation
        for name, f in model.model_fields.items():  # type: ignore[union-attr]
            default = f.get_default(call_default_factory=True)
            out.append((f"{section_name}.{name}", f.annotation, f.description or "", default))
    return out


def markdown_reference() -> str:
    """The config reference as markdown (docs/config.md is this, committed)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `peer/config.py` by `gossipgrad-peer --config-reference`.",
        "Every key can be set in the TOML file under its section, or on the command line as",
        "`--section.key=value`.",
        "",
    ]
    current = None
    for key, _ann, desc, default in iter_fields():
        section = key.split(".")[0]
        if section != current:
            current = section
            doc = (PeerConfig.model_fields[section].annotation.__doc__ or "").strip()
            lines += [
                "",
                f"## [{section}]",
                "",
                doc,
                "",
                "| key | default | meaning |",
                "|---|---|---|",
            ]
        shown = str(default) if not isinstance(default, str) else repr(default)
        lines.append(f"| `{key.split('.', 1)[1]}` | `{shown}` | {desc} |")
    return "\n".join(lines) + "\n"
