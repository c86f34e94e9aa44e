"""A spec's ``[network]`` section as relays: one emulated link per directed site pair of a
local swarm, and the daemon keys that make peers dial through them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gossipgrad.experiment.link_emulator import LinkEmulator
from gossipgrad.experiment.link_path import swarm_paths
from gossipgrad.experiment.link_relay import Relay
from gossipgrad.experiment.spec import NetworkSection

# Loopback addresses of the sites in local mode: site i listens on 127.1.0.(i + 1).
SITE_HOST = "127.1.0.{}"


def site_host(i: int) -> str:
    """Loopback address site i listens on in local mode (all of 127/8 is loopback on Linux)."""
    return SITE_HOST.format(i + 1)


class SwarmRelays:
    """One relay per directed site pair i->j of a local swarm, shaped as netns mode would.

    The paths are ``swarm_paths``'s. A relay i->j carries i's connections to j: i's bytes on
    path i->j, j's replies on path j->i, sharing transmitters with relay j->i.

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
        self.paths = swarm_paths(network, n, seed)
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
