"""A tiny network lab of Linux network namespaces for fault tests (root and ``ip`` needed).

Layout: one hub namespace holding two bridges, ``br0`` and ``br1``, joined by a veth pair
(``lk0``-``lk1``); peer i lives in its own namespace with ``eth0`` = 198.18.0.(i+1)/24 (the
benchmarking range, RFC 2544), plugged into ``br0`` or ``br1`` by its group. Taking ``lk0``
down partitions the two groups; a peer's own link can be delayed (netem) or flapped. Nothing
is created in the caller's namespace, and :meth:`close` deletes every namespace.

A peer in ``natted`` sits behind a NAT of its own (nftables needed;
:mod:`gossipgrad.experiment.nat`, which the experiment runner uses too): its namespace holds
only ``eth0`` = 10.77.(i).2/24, routed through a router namespace ``<prefix>r<i>`` whose
``eth0`` on the bridge has the peer's public address 198.18.0.(i+1) and which masquerades
what goes out and drops every new connection coming in (a site behind a typical NAT or
stateful firewall: it can dial out, nobody can dial it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

from gossipgrad.experiment.nat import nat_unavailable, private_address, put_behind_nat


def netlab_unavailable(nat: bool = False) -> str | None:
    """Why a NetLab (``nat``: with peers behind NAT) cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return nat_unavailable() if nat else None


class NetLab:
    """Namespaces ``<prefix>h`` (hub) and ``<prefix>0..n-1`` (peers)."""

    def __init__(self, groups: list[int], natted: set[int] = frozenset()) -> None:
        self.groups = groups
        self.natted = set(natted)
        self.prefix = f"ggt{uuid.uuid4().hex[:6]}"
        self.hub = f"{self.prefix}h"
        self.created: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    @staticmethod
    def address(i: int) -> str:
        """Peer i's public address (its NAT router's, for a peer behind NAT)."""
        return f"198.18.0.{i + 1}"

    @staticmethod
    def private_address(i: int) -> str:
        """The address a peer behind NAT has inside (nobody outside can route to it)."""
        return private_address(i)

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def up(self) -> NetLab:
        self._ip("netns", "add", self.hub)
        self.created.append(self.hub)
        hub = ("-n", self.hub)
        self._ip(*hub, "link", "set", "lo", "up")
        for br in ("br0", "br1"):
            self._ip(*hub, "link", "add", br, "type", "bridge")
            self._ip(*hub, "link", "set", br, "up")
        self._ip(*hub, "link", "add", "lk0", "type", "veth", "peer", "name", "lk1")
        self._ip(*hub, "link", "set", "lk0", "master", "br0", "up")
        self._ip(*hub, "link", "set", "lk1", "master", "br1", "up")
        for i, group in enumerate(self.groups):
            ns = self.ns(i)
            self._ip("netns", "add", ns)
            self.created.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            public = f"{self.prefix}r{i}" if i in self.natted else ns
            if public != ns:
                self._ip("netns", "add", public)
                self.created.append(public)
                self._ip("-n", public, "link", "set", "lo", "up")
            self._ip(*hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0")
            self._ip(*hub, "link", "set", "eth0", "netns", public)
            self._ip(*hub, "link", "set", f"v{i}", "master", f"br{group}", "up")
            self._ip("-n", public, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            self._ip("-n", public, "link", "set", "eth0", "up")
            if public != ns:  # a private link to its router, which masquerades
                put_behind_nat(i, ns, public)
        return self

    def partition(self) -> None:
        """Cut the link between the two groups."""
        self._ip("-n", self.hub, "link", "set", "lk0", "down")

    def heal(self) -> None:
        self._ip("-n", self.hub, "link", "set", "lk0", "up")

    def set_link(self, i: int, up: bool) -> None:
        """Plug or unplug peer i (its hub-side veth)."""
        self._ip("-n", self.hub, "link", "set", f"v{i}", "up" if up else "down")

    def delay(self, i: int, ms: int) -> bool:
        """Add ``ms`` of delay to peer i's outgoing traffic; False if netem is unavailable."""
        run = subprocess.run(
            ["ip", "netns", "exec", self.ns(i), "tc", "qdisc", "add", "dev", "eth0", "root",
             "netem", "delay", f"{ms}ms"],
            capture_output=True,
            timeout=10,
        )  # fmt: skip
        return run.returncode == 0

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def close(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.created.clear()
