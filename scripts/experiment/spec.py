"""The experiment spec: one TOML file, validated into typed sections.

Sections:
  [experiment]   name, peers, mode (local | netns | ssh), seed, timeout
  [network]      emulated WAN (tc in netns mode, user-space relays in local mode): default
                 rate/delay/jitter/loss, per-site and per-link overrides
  [baselines]    which baselines run in the same conditions (ddp, powersgd, diloco,
                 diloco-int8, hivemind) and their knobs
  [ssh]          inventory file for ssh mode
  [train], [gossip], [membership], [checkpoint], [metrics], [transport], ...
                 peer daemon config (docs/config.md), passed to every peer and validated by
                 the daemon's own config model, so a typo fails before anything starts.

Every error names the offending key (``network.rate: ...``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gossipgrad.peer.config import ConfigError, PeerConfig, build_config
from gossipgrad.peer.config.base import split_list_strings
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from gossipgrad.experiment.diloco import OuterSettings
    from gossipgrad.peer.config import GossipSection

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Daemon config sections a spec may set (all but [peer], which the runner fills per peer).
PEER_SECTIONS = tuple(name for name in PeerConfig.model_fields if name != "peer")
# Keys the runner sets per peer; a spec may not set them.
RUNNER_KEYS = {
    "peer.id",
    "peer.run_dir",
    "peer.listen",
    "peer.advertise",
    "peer.bootstrap",
    "peer.expected_peers",
    "train.shard_index",
    "train.num_shards",
    "train.seed",
}
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
_TIME = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class SpecError(ValueError):
    """A bad experiment spec; the message names the key."""


def rate_bits(rate: str) -> float:
    """'10mbit' -> 1e7 bits per second (tc's decimal units)."""
    m = re.match(r"^(\d+(?:\.\d+)?)([a-z]+)$", rate)
    if not m or m.group(2) not in _RATE_SCALE:
        raise ValueError(f"rate {rate!r} must look like 10mbit (bit, kbit, mbit, gbit)")
    return float(m.group(1)) * _RATE_SCALE[m.group(2)]


def time_seconds(value: str) -> float:
    """'20ms' -> 0.02."""
    m = re.match(r"^(\d+(?:\.\d+)?)([a-z]+)$", value)
    if not m or m.group(2) not in _TIME_SCALE:
        raise ValueError(f"time {value!r} must look like 20ms (us, ms, s)")
    return float(m.group(1)) * _TIME_SCALE[m.group(2)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _lists_from_strings(cls, data: Any) -> Any:
        return split_list_strings(cls, data)  # --set baselines.run=ddp,powersgd


class LinkProfile(_Model):
    """How one direction of a link behaves (tc units: rate '10mbit', times '20ms')."""

    rate: str | None = None
    """Bandwidth cap, e.g. '100mbit' (None: unshaped)."""
    delay: str | None = None
    """One-way added latency, e.g. '20ms' (netem, the TUN switch or the relays)."""
    jitter: str | None = None
    """Delay variation, e.g. '5ms' (normally distributed; needs delay)."""
    loss: float = Field(0.0, ge=0.0, le=100.0)
    """Random packet loss in percent (netem and the TUN switch drop packets; the relay
    emulator turns it into the retransmission delays TCP would see)."""
    reset: float = Field(0.0, ge=0.0, le=100.0)
    """Relay emulator only: chance in percent, per packet's worth of bytes, that the link
    resets the TCP connection."""

    @field_validator("rate")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None and not _RATE.match(v):
            raise ValueError(f"{v!r} must look like 10mbit (bit, kbit, mbit, gbit)")
        return v

    @field_validator("delay", "jitter")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _TIME.match(v):
            raise ValueError(f"{v!r} must look like 20ms (us, ms, s)")
        return v

    @model_validator(mode="after")
    def _jitter_needs_delay(self) -> LinkProfile:
        if self.jitter and not self.delay:
            raise ValueError("jitter needs a delay")
        return self

    def needs_netem(self) -> bool:
        return bool(self.delay or self.jitter or self.loss)

    def merged(self, over: LinkProfile) -> LinkProfile:
        """This profile with the fields ``over`` sets explicitly replacing ours."""
        return self.model_copy(update=over.model_dump(exclude_unset=True))


class SiteProfile(LinkProfile):
    """A profile for the access links of some sites (peer indices), both directions."""

    peers: list[int] = Field(min_length=1)


class PairProfile(LinkProfile):
    """A profile for traffic between two sites, both directions (rate and netem per pair)."""

    a: int = Field(ge=0)
    b: int = Field(ge=0)

    @model_validator(mode="after")
    def _distinct(self) -> PairProfile:
        if self.a == self.b:
            raise ValueError("a link joins two different peers (a == b)")
        return self


class NetworkSection(LinkProfile):
    """Emulated WAN: the default profile of every site's access link, plus per-site and
    per-link overrides, and which emulator applies them."""

    emulator: Literal["auto", "netem", "relay", "tun"] = "auto"
    """relay: user-space TCP relays (local mode; gossipgrad.experiment.links); netem: tc
    qdiscs (netns mode); tun: TUN devices and a user-space packet switch (netns mode,
    gossipgrad.experiment.link_tun); auto: relay in local mode; in netns mode tc, or tun
    where delay, jitter or loss need netem and the kernel lacks it."""
    rto: str = "200ms"
    """Relay emulator: least extra delay of a lost chunk (its retransmission timeout is
    max(rto, RTT + 4 x jitter), RFC 6298 with Linux's 200 ms minimum)."""
    sites: list[SiteProfile] = Field(default_factory=list)
    links: list[PairProfile] = Field(default_factory=list)
    natted: list[int] = Field(default_factory=list)
    """netns mode: sites (peer indices) behind a NAT of their own that masquerades what goes
    out and drops every new connection coming in (gossipgrad.experiment.nat, nftables): they
    can dial out, nobody can dial them, and their peers are called through relays. Not
    peer 0 (every peer's bootstrap), and no baselines (their ranks dial each other)."""

    @field_validator("rto")
    @classmethod
    def _rto(cls, v: str) -> str:
        if not _TIME.match(v):
            raise ValueError(f"{v!r} must look like 20ms (us, ms, s)")
        return v

    def site(self, i: int) -> LinkProfile:
        keep = {"sites", "links", "emulator", "rto", "natted"}
        base = LinkProfile(**self.model_dump(exclude=keep, exclude_unset=True))
        for s in self.sites:
            if i in s.peers:
                over = s.model_dump(exclude={"peers"}, exclude_unset=True)
                base = base.merged(LinkProfile(**over))
        return base

    def pair(self, i: int, j: int) -> LinkProfile | None:
        for link in self.links:
            if {link.a, link.b} == {i, j}:
                return LinkProfile(**link.model_dump(exclude={"a", "b"}, exclude_unset=True))
        return None

    def shaped(self) -> bool:
        profiles = [self, *self.sites, *self.links]
        return any(p.rate or p.needs_netem() or p.reset for p in profiles)

    def needs_netem(self) -> bool:  # type: ignore[override]
        profiles: list[LinkProfile] = [self, *self.sites, *self.links]
        return any(LinkProfile.needs_netem(p) for p in profiles)

    def resets(self) -> bool:
        return any(p.reset for p in [self, *self.sites, *self.links])

    def uses_relay(self, mode: str) -> bool:
        """Whether the relay emulator shapes this network in ``mode``."""
        return self.shaped() and mode == "local" and self.emulator in ("auto", "relay")


class ExperimentSection(_Model):
    """What runs where."""

    name: str = Field("experiment", pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    """Name used in the report and plots."""
    peers: int = Field(4, ge=1, le=250)
    """Number of peer daemons (sites)."""
    mode: Literal["local", "netns", "ssh"] = "local"
    """local: processes on 127.0.0.1; netns: one network namespace per site with shaped
    links (root, iproute2); ssh: hosts from an inventory."""
    seed: int = 0
    """Seed of model init, data shards and sampling (peers and baselines alike)."""
    timeout: float = Field(1800.0, gt=0)
    """Seconds each phase (swarm, each baseline) may run before it is stopped."""
    sample_every: float = Field(0.5, gt=0)
    """Seconds between samples of the peers' progress (loss curves, live view)."""


class BaselinesSection(_Model):
    """Baselines run after the swarm on the same task, seed, shards and sample budget."""

    run: list[Literal["ddp", "powersgd", "diloco", "diloco-int8", "hivemind"]] = Field(
        default_factory=lambda: ["ddp", "powersgd"]
    )
    """ddp: dense DDP all-reduce over gloo; powersgd: DDP with PyTorch's PowerSGD hook;
    diloco / diloco-int8: all-reduce DiLoCo (Douillard et al. 2023) with fp32 / int8
    pseudo-gradients; hivemind: hivemind.Optimizer's gradient all-reduce (needs
    ``scripts/setup.sh --hivemind``)."""
    powersgd_rank: int = Field(2, ge=1)
    """matrix_approximation_rank of the PowerSGD hook."""
    powersgd_start_iter: int = Field(10, ge=1)
    """Iterations of dense all-reduce before PowerSGD starts (start_powerSGD_iter)."""
    diloco_local_steps: int = Field(0, ge=0)
    """DiLoCo's H, inner optimizer steps between outer steps; 0: gossip.local_steps, the
    swarm's own H (DiLoCo at the same H as the swarm)."""
    diloco_outer_lr: float | None = Field(None, gt=0)
    """Learning rate of DiLoCo's outer SGD; empty: gossip.outer_lr, the swarm's own (the
    paper's is 0.7)."""
    diloco_outer_momentum: float | None = Field(None, ge=0, lt=1)
    """Momentum of DiLoCo's outer SGD (Nesterov when > 0); empty: gossip.outer_momentum, the
    swarm's own (the paper's is 0.9); 0: plain SGD on the mean pseudo-gradient (with lr 1 and
    H 1: parameter averaging after every step)."""
    steps: int = Field(0, ge=0)
    """Steps of every baseline rank; 0: train.steps, the same sample budget as each peer.
    Another value turns the comparison into a race to an accuracy (report time_to_target),
    e.g. a swarm allowed twice the steps of DDP on a slow WAN."""

    @field_validator("run")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"baselines listed twice: {v}")
        if "hivemind" in v:
            from gossipgrad.experiment.baselines import hivemind_python

            hivemind_python()  # fails now, with the setup command, not after the swarm ran
        return v

    def diloco_settings(self, gossip: GossipSection) -> OuterSettings:
        """The DiLoCo baselines' outer loop: the swarm's H, outer lr and momentum (``gossip``)
        where ``diloco_local_steps``, ``diloco_outer_lr``, ``diloco_outer_momentum`` are not
        set, so that by default the baseline differs from the swarm by its all-reduce only."""
        from gossipgrad.experiment.diloco import OuterSettings

        lr, momentum = self.diloco_outer_lr, self.diloco_outer_momentum
        return OuterSettings(
            local_steps=self.diloco_local_steps or gossip.local_steps,
            outer_lr=gossip.outer_lr if lr is None else lr,
            outer_momentum=gossip.outer_momentum if momentum is None else momentum,
        )


class SshSection(_Model):
    """ssh mode: where the inventory is (relative paths: next to the spec)."""

    inventory: Path | None = None
    """TOML inventory: [[hosts]] address, python, data, workdir, ssh_port, identity
    (docs/experiments.md)."""
    options: list[str] = Field(default_factory=lambda: ["-o", "BatchMode=yes"])
    """Options of every ssh command the runner runs (each host's ssh_port and identity
    follow them)."""


class Spec(_Model):
    """A whole experiment."""

    experiment: ExperimentSection = Field(default_factory=ExperimentSection)
    network: NetworkSection = Field(default_factory=NetworkSection)
    baselines: BaselinesSection = Field(default_factory=BaselinesSection)
    ssh: SshSection = Field(default_factory=SshSection)
    peer_raw: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """The peer daemon sections as written (validated against the daemon's config)."""
    source: Path | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Spec:
        n = self.experiment.peers
        for k, s in enumerate(self.network.sites):
            bad = [i for i in s.peers if not 0 <= i < n]
            if bad:
                raise ValueError(f"network.sites.{k}.peers: {bad} out of range 0..{n - 1}")
        for k, link in enumerate(self.network.links):
            if max(link.a, link.b) >= n:
                raise ValueError(f"network.links.{k}: peer index out of range 0..{n - 1}")
        mode, net = self.experiment.mode, self.network
        if net.natted:
            bad = [i for i in net.natted if not 0 <= i < n]
            if bad:
                raise ValueError(f"network.natted: {bad} out of range 0..{n - 1}")
            if len(set(net.natted)) != len(net.natted):
                raise ValueError(f"network.natted: a site listed twice: {net.natted}")
            if mode != "netns":
                raise ValueError(
                    f"network.natted: sites behind NAT need experiment.mode = 'netns' (a "
                    f"namespace per site), not {mode!r}"
                )
            if 0 in net.natted:
                raise ValueError(
                    "network.natted: peer 0 is every peer's bootstrap and must be reachable"
                )
            if self.baselines.run:
                raise ValueError(
                    "network.natted: baseline ranks dial each other directly, which a NAT "
                    "drops; set baselines.run = [] (the swarm alone) with sites behind NAT"
                )
        if mode == "ssh" and net.shaped():
            raise ValueError("network: ssh mode runs over real links; drop [network] shaping")
        if mode == "local" and net.shaped() and net.emulator in ("netem", "tun"):
            raise ValueError(
                f"network.emulator: {net.emulator} needs experiment.mode = 'netns'; local mode "
                "emulates links with the relay (emulator = 'relay' or 'auto')"
            )
        if mode == "netns" and net.emulator == "relay":
            raise ValueError(
                "network.emulator: the relay emulator runs in local mode only; netns mode "
                "shapes with tc or TUN devices (emulator = 'auto', 'netem' or 'tun')"
            )
        if mode == "netns" and net.resets():
            raise ValueError("network.reset: needs the relay emulator (experiment.mode = 'local')")
        if self.experiment.mode == "ssh" and self.ssh.inventory is None:
            raise ValueError("ssh.inventory: required for experiment.mode = 'ssh'")
        return self

    def peer_config(self) -> PeerConfig:
        """The daemon config every peer starts from (runner keys at their defaults)."""
        return build_config(self.peer_raw, {"train.seed": self.experiment.seed})

    def peer_overrides(self) -> dict[str, str]:
        """The spec's daemon keys as ``--section.key VALUE`` strings, plus the seed."""
        out: dict[str, str] = {}
        for section, table in self.peer_raw.items():
            for key, value in table.items():
                out[f"{section}.{key}"] = _cli_value(value)
        out["train.seed"] = str(self.experiment.seed)
        return out


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_cli_value(v) for v in value)
    return str(value)


def _loc(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "spec"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{key}: {msg}")
    return "; ".join(parts)


def parse_spec(raw: dict[str, Any], source: Path | None = None) -> Spec:
    """Validate a TOML tree into a Spec (and the peer sections into a PeerConfig).

    Raises:
        SpecError: naming each bad key.
    """
    raw = dict(raw)
    peer_raw: dict[str, dict[str, Any]] = {}
    for section in PEER_SECTIONS:
        if section in raw:
            table = raw.pop(section)
            if not isinstance(table, dict):
                raise SpecError(f"{section}: must be a table")
            peer_raw[section] = table
    if "peer" in raw:
        raise SpecError(
            "peer: the runner sets the [peer] section per peer (id, addresses, run_dir); "
            "set swarm-wide keys under [train], [gossip], ..."
        )
    for section, table in peer_raw.items():
        for key in table:
            if f"{section}.{key}" in RUNNER_KEYS:
                where = "experiment.seed" if key == "seed" else "the runner"
                raise SpecError(f"{section}.{key}: set by {where}, not in the spec")
    try:
        spec = Spec.model_validate({**raw, "peer_raw": peer_raw, "source": source})
    except ValidationError as err:
        raise SpecError(_loc(err)) from None
    try:
        spec.peer_config()
    except ConfigError as err:
        raise SpecError(str(err)) from None
    return spec


def load_spec(path: Path) -> Spec:
    """Read and validate a spec file; relative ssh.inventory resolves next to it."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"spec file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: invalid TOML: {err}") from None
    inv = raw.get("ssh", {}).get("inventory") if isinstance(raw.get("ssh"), dict) else None
    if inv and not Path(inv).is_absolute():
        raw["ssh"] = {**raw["ssh"], "inventory": str(path.parent / inv)}
    return parse_spec(raw, source=path)
