"""A site behind NAT in network namespaces: it can dial out, nobody can dial it.

The site's namespace keeps only a private link to a router namespace of its own; the router
holds the site's public address on the shared network, masquerades what goes out and drops
every new connection coming in (nftables), as a typical home, office or cluster NAT or
stateful firewall does::

    [site] eth0 10.77.<i>.2 ──veth── in0 10.77.<i>.1 [router] eth0 <public address> ── ...

Used by the experiment runner's netns mode (``network.natted``) and by the fault tests' lab;
the namespaces and the router's public link are the caller's, this module adds the private
link, the route and the rules.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

#: The router's rules: masquerade outbound, drop every new connection from outside.
NAT_RULES = """
table ip nat {
  chain outbound_nat { type nat hook postrouting priority 100; oifname "eth0" masquerade; }
}
table inet filter {
  chain from_outside {
    type filter hook forward priority 0; policy drop;
    iifname "in0" accept
    ct state established,related accept
  }
  chain to_router {
    type filter hook input priority 0; policy drop;
    iifname "lo" accept
    iifname "in0" accept
    ct state established,related accept
  }
}
"""


def nat_unavailable() -> str | None:
    """Why sites cannot be put behind NAT here (no ``nft``), or None."""
    if shutil.which("nft") is None:
        return "sites behind NAT need nftables ('nft' not found on PATH)"
    return None


def private_address(i: int) -> str:
    """Site i's address inside its NAT (nobody outside can route to it)."""
    return f"10.77.{i}.2"


def _router_address(i: int) -> str:
    return f"10.77.{i}.1"


def _default_run(cmd: Sequence[str]) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=30)


def put_behind_nat(
    i: int,
    site: str,
    router: str,
    run: Callable[[Sequence[str]], object] = _default_run,
) -> None:
    """Join namespace ``site`` to namespace ``router`` by a private link (the site's
    ``eth0``, the router's ``in0``), route the site through it and load the NAT rules into
    the router, whose own ``eth0`` (the public side) the caller has set up.

    Args:
        i: the site's index (its private subnet is 10.77.<i>.0/24, so i < 256).
        site, router: namespace names, both existing.
        run: runs one command, raising on failure (default: subprocess, checked).
    """
    if not 0 <= i < 256:
        raise ValueError(f"a site behind NAT needs an index in 0..255, got {i}")
    run(["ip", "-n", router, "link", "add", "in0", "type", "veth", "peer", "name", "out0"])
    run(["ip", "-n", router, "link", "set", "out0", "netns", site])
    run(["ip", "-n", site, "link", "set", "out0", "name", "eth0"])
    run(["ip", "-n", router, "addr", "add", f"{_router_address(i)}/24", "dev", "in0"])
    run(["ip", "-n", router, "link", "set", "in0", "up"])
    run(["ip", "-n", site, "addr", "add", f"{private_address(i)}/24", "dev", "eth0"])
    run(["ip", "-n", site, "link", "set", "eth0", "up"])
    run(["ip", "-n", site, "route", "add", "default", "via", _router_address(i)])
    run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    load_rules(router)


def load_rules(router: str) -> None:
    """Load :data:`NAT_RULES` into namespace ``router`` (``nft -f -``)."""
    subprocess.run(
        ["ip", "netns", "exec", router, "nft", "-f", "-"],
        input=NAT_RULES,
        text=True,
        check=True,
        capture_output=True,
        timeout=30,
    )
