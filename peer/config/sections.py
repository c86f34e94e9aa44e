"""The config sections other than ``[gossip]``: one pydantic model per TOML section.

Each field's description is the documentation of its key (docs/config.md is generated from
them). Components receive only their own section, never the whole config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from gossipgrad.peer.config.base import ADDRESS_PATTERN, Address, Section
from pydantic import Field, field_validator, model_validator


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
        "with the bound port (logged as a warning when that host is 0.0.0.0 or [::], which "
        "no other machine can dial).",
        pattern=rf"^$|{ADDRESS_PATTERN}",
    )
    bootstrap: list[Address] = Field(
        default_factory=list,
        description="Addresses of peers already in the swarm, all heartbeated at once (again "
        "with backoff) until any answers: one live address is enough to join. Empty for the "
        "first peer.",
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
        description="Seconds to wait at start: for expected_peers (then training anyway); "
        "for a peer with a bootstrap list (fresh or resumed), for any bootstrap address to "
        "answer (retried with backoff; counted together with the wait for expected_peers), then "
        "for a donor to send its state (busy or failing donors retried). Either running out "
        "is a one-line error naming what was tried and a non-zero exit.",
    )
    require_reachable: bool = Field(
        True,
        description="At start a peer with a bootstrap list asks a bootstrap peer to dial it "
        "back at its advertised address; if that fails (refused, timed out, another identity "
        "there) the peer exits with a one-line error naming the cause, since its neighbours "
        "could never push to it and it would train alone. false: log it, record it in "
        "status.json and the gossipgrad_reachable metric, and go on. A check that cannot be "
        "made (first peer, older or busy members) is never an error.",
    )
    relay: Literal["auto", "off"] = Field(
        "auto",
        description="What a peer the check found unreachable does. auto: it is called through "
        "a relay, a reachable member it keeps an outbound connection to (the one with the "
        "lowest heartbeat round trip that takes it; another when that one dies or leaves); "
        "it exits only if no member takes it (or goes on alone, with require_reachable = "
        "false). off: as if no member took it. docs/transport.md, Relays.",
    )
    relay_capacity: int = Field(
        4,
        ge=0,
        description="Unreachable peers this peer relays for at once, if others can dial it "
        "(0: none). Each costs the bytes that peer's neighbours exchange with it, twice "
        "through this host, and a few threads per connection to it.",
    )
    relay_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="TCP port of the raw tunnel listener this peer opens when it relays "
        "(relay_capacity > 0), on peer.listen's host: a tunnel whose two ends can connect "
        "there is spliced below gRPC, its bytes copied between two plain connections (the "
        "caller's TLS runs through it end to end), at a fraction of the relay's CPU of "
        "carrying them in gRPC calls (BENCHMARKS.md, Relays). 0: any free port (advertised "
        "in heartbeats); -1: none. An end that cannot connect (a firewall that lets only "
        "the gossip port in) or that reaches the relay through transport.dial_via keeps to "
        "gRPC calls.",
    )

    @model_validator(mode="after")
    def _relay_port_apart(self) -> PeerSection:
        listen_port = int(self.listen.rsplit(":", 1)[1])
        if self.relay_port > 0 and self.relay_port == listen_port:
            raise ValueError(
                f"relay_port {self.relay_port} is listen's port: the tunnel listener needs "
                "a port of its own (or 0: any free one)"
            )
        return self

    join_after_steps: int = Field(
        20,
        ge=0,
        description="A fresh peer (no checkpoint) downloads model and optimizer state from "
        "a live peer at least this many steps in (one near the most advanced step, picked at "
        "random so joiners spread over donors); when no peer is that far, as for peers "
        "started together, it begins from the same seeded initialisation instead. A "
        "restarted peer does the same when the swarm is at least this many steps past its "
        "checkpoint (resuming it, it would lag the others to the end and train its last "
        "steps alone).",
    )


class TrainSection(Section):
    """What this peer trains and how (local optimizer, data shard)."""

    task: str = Field(
        "digits",
        description="Built-in task (digits, fashion-mnist-mlp, fashion-mnist-cnn, "
        "fashion-mnist-cnn-bn, shakespeare) or a user task 'package.module:factory'.",
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
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Autocast dtype of the forward pass and loss: fp32 (off), bf16, or fp16 "
        "with a dynamic loss scaler (torch.amp.GradScaler) that skips a step whose gradients "
        "overflow (meant for CUDA). Parameters, optimizer state and everything gossiped "
        "stay fp32.",
    )
    grad_clip: float = Field(
        0.0,
        ge=0,
        description="Clip the gradients' global L2 norm to this before the optimizer step "
        "(and before ef-gradient sends them; 0: off).",
    )
    eval_every: int = Field(100, ge=0, description="Evaluate every N steps (0: only at the end).")
    eval_samples: int = Field(
        0,
        ge=0,
        description="Held-out samples per evaluation (0: the task's default: all of digits' "
        "and the Fashion-MNIST MLP's test sets, 2,000 images for the CNNs, 256 windows of 64 "
        "characters for shakespeare). At 2,000 images one accuracy carries about +-0.6 points "
        "of sampling error; 10000 evaluates the CNNs on the whole test set.",
    )
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


class MembershipSection(Section):
    """Failure detection: heartbeats, suspicion, removal (phi-less, timeout based)."""

    heartbeat_interval: float = Field(0.5, gt=0, description="Seconds between heartbeats.")
    suspect_after: float = Field(
        3.0,
        gt=0,
        description="Seconds a peer leaves our heartbeats unanswered before it is suspect "
        "(excluded from mixing); at once if its address refuses connections (its process "
        "is gone).",
    )
    dead_after: float = Field(
        10.0,
        gt=0,
        description="Seconds a peer leaves our heartbeats unanswered before it is dead (dropped "
        "from the topology); a peer reported dead by another is dropped at its first unanswered "
        "heartbeat.",
    )
    far_every: int = Field(
        4,
        ge=1,
        description="A far round every N intervals: it heartbeats a few peers that are not "
        "gossip neighbours (neighbours are heartbeated every interval).",
    )
    far_fanout: float = Field(
        1.0,
        gt=0,
        le=8,
        description="Peers a far round heartbeats, as a multiple of log2(swarm size), taken "
        "round-robin so each is reached once per pass; heartbeats per peer grow with log n, "
        "not n.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> MembershipSection:
        if not self.heartbeat_interval < self.suspect_after <= self.dead_after:
            raise ValueError(
                "membership: need heartbeat_interval < suspect_after <= dead_after, got "
                f"{self.heartbeat_interval} / {self.suspect_after} / {self.dead_after}"
            )
        # Far rounds carry joins and death reports across the graph: slower than dead_after,
        # the swarm would agree on a death long after the neighbours saw it.
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

    chunk_bytes: int = Field(
        1 << 20,
        ge=4096,
        le=4 << 20,
        description="Streaming chunk size; an update whose header and payload fit in one "
        "chunk goes in one unary call.",
    )
    max_payload_bytes: int | None = Field(
        None,
        ge=1 << 16,
        description="Largest update a peer accepts, bytes. Unset: the model's dense copy "
        "plus 1 MiB of envelope, the largest update an honest neighbour sends (a resync).",
    )
    max_state_bytes: int | None = Field(
        None,
        ge=1 << 16,
        description="Largest state download a joiner accepts, bytes. Unset: 8 times the "
        "model's bytes plus 64 MiB (parameters, an optimizer with up to three moments, the "
        "algorithm's anchor and momentum, the buffers).",
    )
    push_timeout: float = Field(
        30.0,
        gt=0,
        description="Deadline of one push, seconds, plus the payload's size over "
        "min_rate_bytes: a push's deadline grows with what it carries.",
    )
    min_rate_bytes: float = Field(
        1e6,
        gt=0,
        description="The slowest link the swarm must work over, bytes per second (1e6: 8 "
        "Mbit/s). A push of S bytes may take push_timeout + S / min_rate_bytes seconds, at "
        "both ends, so a dense resync of a large model is not cut off on a slow link.",
    )
    retries: int = Field(3, ge=0, description="Retries of an idempotent call on UNAVAILABLE.")
    state_timeout: float = Field(
        120.0,
        gt=0,
        description="Deadline of one state download from one donor, seconds, plus the "
        "state's declared size over min_rate_bytes (or over state_rate_bytes where that is "
        "slower): a download's deadline grows with what it carries.",
    )
    max_state_downloads: int = Field(
        2,
        ge=1,
        description="State downloads this peer serves at once (they send from one snapshot "
        "of model and optimizer state, taken once per step); a joiner asking while all are "
        "taken is told the donor is busy and asks another.",
    )
    state_rate_bytes: float = Field(
        0.0,
        ge=0,
        description="Bytes per second this peer serves its state at, all joiners together "
        "(0: unlimited), so joiners leave bandwidth for gossip; a download of S bytes then "
        "takes at least (S - chunk_bytes) / state_rate_bytes seconds.",
    )
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
