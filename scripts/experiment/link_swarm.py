"""A spec's ``[network]`` section as relays: one emulated link per directed site pair of a
local swarm, and the daemon keys that make peers dial through them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gossipgrad.experiment.link_emulator import LinkEmulator
from gossipgrad.experiment.link_path import LinkPath, Serializer, Stage, bytes_per_s
from gossipgrad.experiment.link_relay import Relay
from gossipgrad.experiment.spec import LinkProfile, NetworkSection, time_seconds

# Loopback addresses of the sites in local mode: site i listens on 127.1.0.(i + 1).
SITE_HOST = "127.1.0.{}"


def site_host(i: int) -> str:
    """Loopback address site i listens on in local mode (all of 127/8 is loopback on Linux)."""
    return SITE_HOST.format(i + 1)


def _uplinks(
    network: NetworkSection, n: int
) -> tuple[dict[tuple[int, int], LinkProfile], dict[tuple[int, int], Serializer]]:
    """Site i's uplink towards j: its profile, or the pair's ``[[network.links]]`` entry merged
    over it with a transmitter of its own; else the site's one transmitter."""
    up: dict[tuple[int, int], Serializer] = {}
    uplink: dict[tuple[int, int], LinkProfile] = {}
    for i in range(n):
        default = Serializer(bytes_per_s(network.site(i)))
        for j in range(n):
            pair = network.pair(i, j) if i != j else None
            uplink[i, j] = network.site(i).merged(pair) if pair else network.site(i)
            up[i, j] = Serializer(bytes_per_s(uplink[i, j])) if pair else default
    return uplink, up


class SwarmRelays:
    """One relay per directed site pair i->j of a local swarm, shaped as netns mode would.

    Path i->j: site i's uplink (its profile, or the ``[[network.links]]`` entry of {i, j}
    merged over it, with its own transmitter like an HTB class), then site j's downlink (its
    profile; one transmitter for all traffic into j). A relay i->j carries i's connections to
    j: i's bytes on path i->j, j's replies on path j->i, sharing transmitters with relay j->i.

    Args:
        network: the spec's [network] section.
        n: number of sites.
        seed: seeds every path's randomness (path i->j gets its own stream).
        upstream: ``j -> site j's real address`` once known (None before).
    """

    def __init__(
        self, network: NetworkSection, n: int, seed: int, upstream: Callable[[int], str | None]
    ) -> None:
        self.network = network
        self.n = n
        self.emulator = LinkEmulator()
        rto = time_seconds(network.rto)
        down = {j: Serializer(bytes_per_s(network.site(j))) for j in range(n)}
        uplink, up = _uplinks(network, n)
        self.paths: dict[tuple[int, int], LinkPath] = {}
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                stages = [
                    Stage.from_profile(uplink[i, j], up[i, j]),
                    Stage.from_profile(network.site(j), down[j]),
                ]
                self.paths[i, j] = LinkPath(stages, seed=seed * 1_000_003 + i * 1009 + j, rto=rto)
        self.relay: dict[tuple[int, int], Relay] = {}
        for (i, j), path in self.paths.items():
            relay = Relay(f"{i}->{j}", _bind(upstream, j), path, self.paths[j, i])
            self.relay[i, j] = relay
            self.emulator.relays.append(relay)

    def start(self) -> SwarmRelays:
        self.emulator.start()
        return self

    def close(self) -> None:
        self.emulator.close()

    def dial_via(self, i: int) -> list[str]:
        """Site i's ``transport.dial_via`` entries: every other site's host -> its relay."""
        return [f"{site_host(j)}={self.relay[i, j].address}" for j in range(self.n) if j != i]

    def peer_overrides(self, i: int) -> dict[str, str]:
        """Daemon keys of peer i: listen on its site address, dial the others via relays."""
        return {
            "peer.listen": f"{site_host(i)}:0",
            "transport.dial_via": ",".join(self.dial_via(i)),
        }

    def one_way_seconds(self, i: int, j: int) -> float:
        """Configured mean one-way delay i->j (no queueing, jitter or loss)."""
        return sum(s.delay for s in self.paths[i, j].stages)

    def report(self) -> dict[str, Any]:
        """Counters per directed path (i->j: every byte site i sent to site j, on i's
        connections and as replies on j's), per relay, and the emulator's CPU cost."""
        paths = {f"{i}->{j}": vars(p.stats).copy() for (i, j), p in self.paths.items()}
        total = sum(p["bytes"] for p in paths.values())
        cpu = self.emulator.cpu_seconds()
        return {
            "emulator": "relay",
            "cpu_seconds": cpu,
            "relayed_bytes": total,
            "cpu_seconds_per_gb": cpu / (total / 1e9) if total else None,
            "paths": paths,
            "relays": {
                r.name: {k: v for k, v in r.stats().items() if k not in ("forward", "reverse")}
                for r in self.emulator.relays
            },
        }

    def __enter__(self) -> SwarmRelays:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(upstream: Callable[[int], str | None], j: int) -> Callable[[], str | None]:
    return lambda: upstream(j)
