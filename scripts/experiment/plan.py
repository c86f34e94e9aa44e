"""The lines of a dry run (``gossipgrad-experiment --dry-run``) that depend on the spec alone:
the experiment, its sites and links, and the baselines. The peer commands come from the
runner, which builds the swarm to print them."""

from __future__ import annotations

from gossipgrad.experiment.baselines import refusal
from gossipgrad.experiment.link_swarm import site_host
from gossipgrad.experiment.netns import NetnsLab
from gossipgrad.experiment.spec import NetworkSection, Spec
from gossipgrad.peer.config import PeerConfig


def experiment_line(spec: Spec, cfg: PeerConfig) -> str:
    """One line: size, mode, task, steps, seed, codec, topology and gamma."""
    e = spec.experiment
    return (
        f"experiment {e.name}: {e.peers} peers, mode {e.mode}, task {cfg.train.task}, "
        f"{cfg.train.steps} steps of batch {cfg.train.batch_size}, seed {e.seed}, codec "
        f"{cfg.gossip.codec}, topology {cfg.gossip.topology}, gamma {cfg.gossip.gamma}"
    )


def netns_lines(lab: NetnsLab, network: NetworkSection, n: int) -> list[str]:
    """Each site's namespace, address and shaping, then each per-pair link override."""
    lines = []
    if network.emulator == "tun" or (network.needs_netem() and network.emulator == "auto"):
        how = "TUN links" if network.emulator == "tun" else "netem, or TUN links without it"
        lines.append(f"links: {how} (delay, jitter, loss); TUN links: a user-space switch")
    for i in range(n):
        site = network.site(i)
        behind = f" behind NAT (router {lab.router(i)})" if i in network.natted else ""
        lines.append(
            f"site {i}: namespace {lab.ns(i)} address {lab.address(i)}{behind} "
            f"rate={site.rate or 'unshaped'} delay={site.delay or 0} "
            f"jitter={site.jitter or 0} loss={site.loss}%"
        )
    for link in network.links:
        lines.append(f"link {link.a}<->{link.b}: {link.model_dump(exclude={'a', 'b'})}")
    return lines


def relay_lines(network: NetworkSection, n: int) -> list[str]:
    """The user-space relays, each site's shaping, then each per-pair link override (only
    the keys the spec set)."""
    lines = [
        f"links: {n * (n - 1)} user-space relays on 127.0.0.1 (one per "
        f"directed site pair, ports picked at run time: 127.0.0.1:0 below); site i "
        f"listens on {site_host(0)[:-1]}<i+1>"
    ]
    for i in range(n):
        site = network.site(i)
        lines.append(
            f"site {i}: rate={site.rate or 'unshaped'} delay={site.delay or 0} "
            f"jitter={site.jitter or 0} loss={site.loss}% reset={site.reset}%"
        )
    for link in network.links:
        pair = link.model_dump(exclude={"a", "b"}, exclude_unset=True)
        lines.append(f"link {link.a}<->{link.b}: {pair}")
    return lines


def baseline_lines(spec: Spec, cfg: PeerConfig, host: str) -> list[str]:
    """One line per baseline the spec runs: how it trains and where rank 0 listens."""
    b, n = spec.baselines, spec.experiment.peers
    outer = b.diloco_settings(cfg.gossip)
    lines = []
    relayed = spec.network.uses_relay(spec.experiment.mode)
    for name in b.run:
        why = refusal(name, spec.experiment.mode, relayed)
        if why is not None:
            lines.append(f"baseline {name}: {why}")
            continue
        how, extra = "torch DDP", ""
        if name == "powersgd":
            extra = f", PowerSGD rank {b.powersgd_rank}"
        elif name.startswith("diloco"):
            how = "all-reduce DiLoCo"
            extra = f", H={outer.local_steps}, outer lr {outer.outer_lr}, momentum "
            extra += str(outer.outer_momentum)
        lines.append(f"baseline {name}: {n} ranks, {how} over gloo, rank 0 at {host}{extra}")
    return lines
