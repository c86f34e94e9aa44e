"""Emulated WAN on one machine: a network namespace per site, joined to a bridge in a hub
namespace through veth links, shaped with ``tc``.

Layout for sites 0..n-1 (run prefix ``ggPIDxTOKEN-``)::

    [PREFIXp0] eth0 198.18.0.1 ──veth── v0 ┐
    [PREFIXp1] eth0 198.18.0.2 ──veth── v1 ┼─ br0 [PREFIXhub]
    ...                                     ┘

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544) and exist only inside the
namespaces created here; no host interface is touched. A site's upload is shaped on its
``eth0`` (egress), its download on the hub's ``v{i}`` (egress towards the site): an HTB class
caps the rate, a netem leaf adds delay, jitter and loss. Per-link (pair) profiles get their own
HTB class on the sender's ``eth0``, selected by a u32 filter on the destination address.

A site in ``network.natted`` sits behind a NAT of its own (:mod:`gossipgrad.experiment.nat`):
its veth from the hub ends in a router namespace ``PREFIXr<i>`` holding the site's address,
which masquerades what the site sends and drops every new connection to it; the site's own
``eth0`` (10.77.<i>.2) is a private link to that router.

netem is a kernel module (sch_netem) that some kernels lack. Where it is missing and the spec
asks for delay, jitter or loss (``network.emulator = "auto"``), or where the spec says
``emulator = "tun"``, each site's ``eth0`` is instead a TUN device and a user-space switch in
the runner (``link_tun``) carries every packet between sites with the same rate, delay,
jitter and loss; no veth joins a site to the hub's bridge then, and no qdisc is set. Either
way every program in a site's namespace -- peers and baselines alike -- crosses the same
emulated links.

``NetnsLab`` removes every namespace it made in ``down()`` (also called on Ctrl-C, SIGTERM and
crashes by the runner), first killing what still runs inside them; ``cleanup_stale()`` removes
namespaces left by runners that died (their pid is part of the name).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence

from gossipgrad.experiment.link_path import swarm_paths
from gossipgrad.experiment.link_tun import TunError, TunSwitch, open_tun, subnet_sites
from gossipgrad.experiment.nat import nat_unavailable, private_address, put_behind_nat
from gossipgrad.experiment.spec import LinkProfile, NetworkSection

log = logging.getLogger(__name__)

ROOT_PREFIX = "gg"
SUBNET = "198.18.0"
PREFIX_LEN = 24
MAX_SITES = 250
# HTB class for traffic a pair profile does not cover, when the site itself is unshaped.
UNSHAPED_RATE = "10gbit"
_STALE = re.compile(rf"^{ROOT_PREFIX}(\d+)x[0-9a-f]{{4}}-")


class NetnsError(RuntimeError):
    """Namespaces cannot be set up here (no root, no iproute2, a missing qdisc)."""


def available() -> str | None:
    """None when netns mode can run here, else the reason it cannot."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "netns mode needs root (creates namespaces, veth links and qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netns mode needs iproute2 ('{tool}' not found on PATH)"
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    log.debug("netns: %s", " ".join(cmd))
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def list_namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL the processes still running in a namespace this module created."""
    proc = _run(["ip", "netns", "pids", ns], check=False)
    for pid in proc.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def delete_namespace(ns: str) -> None:
    _kill_inside(ns)
    _run(["ip", "netns", "del", ns], check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces left behind by runners that are no longer alive; returns them."""
    removed = []
    for ns in list_namespaces():
        m = _STALE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            delete_namespace(ns)
            removed.append(ns)
    if removed:
        log.warning("removed %d stale namespaces: %s", len(removed), " ".join(removed))
    return removed


def netem_supported(ns: str, dev: str) -> bool:
    """Whether this kernel has the netem qdisc (probed on a device in our namespace)."""
    probe = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                  "netem", "delay", "1ms"], check=False)  # fmt: skip
    if probe.returncode == 0:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        return True
    return False


def netem_args(p: LinkProfile) -> list[str]:
    """``tc ... netem`` arguments for the delay/jitter/loss of a profile ([] if none)."""
    args: list[str] = []
    if p.delay:
        args += ["delay", p.delay]
        if p.jitter:
            args += [p.jitter, "distribution", "normal"]
    if p.loss:
        args += ["loss", f"{p.loss}%"]
    if args:
        args += ["limit", "100000"]
    return args


def shaping_commands(
    dev: str, site: LinkProfile, pairs: dict[str, LinkProfile] | None = None
) -> list[list[str]]:
    """``tc`` commands (without the netns wrapper) shaping egress of ``dev``.

    Args:
        dev: the interface.
        site: profile of all traffic on it.
        pairs: destination address -> profile of the traffic to that address.
    """
    pairs = pairs or {}
    if not (site.rate or site.needs_netem() or pairs):
        return []
    cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"]]
    classes = [(1, site, None)] + [
        (10 + k, site.merged(p), addr) for k, (addr, p) in enumerate(sorted(pairs.items()))
    ]
    for cls, prof, addr in classes:
        rate = prof.rate or UNSHAPED_RATE
        cmds.append(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{cls}",
                     "htb", "rate", rate, "ceil", rate])  # fmt: skip
        if prof.needs_netem():
            cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", f"1:{cls}", "handle",
                         f"{cls}:", "netem", *netem_args(prof)])  # fmt: skip
        if addr is not None:
            cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                         "prio", "1", "u32", "match", "ip", "dst", f"{addr}/32", "flowid",
                         f"1:{cls}"])  # fmt: skip
    return cmds


class NetnsLab:
    """n sites in their own namespaces around a hub bridge; ``with NetnsLab(...) as lab``.

    Args:
        n: number of sites.
        network: link profiles (defaults: unshaped).
        prefix: namespace name prefix (default: ``gg{pid}x{random}-``, unique per run).
        seed: seeds the TUN switch's jitter and loss draws (netem draws its own).
    """

    def __init__(
        self, n: int, network: NetworkSection | None = None, prefix: str = "", seed: int = 0
    ) -> None:
        if not 1 <= n <= MAX_SITES:
            raise ValueError(f"netns mode supports 1..{MAX_SITES} sites, got {n}")
        self.n = n
        self.network = network or NetworkSection()
        self.prefix = prefix or f"{ROOT_PREFIX}{os.getpid()}x{secrets.token_hex(2)}-"
        self.seed = seed
        self.hub = f"{self.prefix}hub"
        self.created: list[str] = []
        self.switch: TunSwitch | None = None
        """The user-space switch when the links are TUN devices (else None: tc shapes)."""

    def ns(self, i: int) -> str:
        return f"{self.prefix}p{i}"

    def router(self, i: int) -> str:
        """The namespace of site i's NAT router (sites in ``network.natted`` only)."""
        return f"{self.prefix}r{i}"

    @staticmethod
    def address(i: int) -> str:
        """Site i's address on the shared network (its NAT router's, for a site behind NAT)."""
        return f"{SUBNET}.{i + 1}"

    def natted(self, i: int) -> bool:
        """Whether site i is behind a NAT (``network.natted``)."""
        return i in self.network.natted

    def listen_address(self, i: int) -> str:
        """The address site i's programs bind: its own (private, behind NAT)."""
        return private_address(i) if self.natted(i) else self.address(i)

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside site i's namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def up(self) -> NetnsLab:
        """Create namespaces, links and qdiscs; on any failure remove what was made."""
        reason = available() or (nat_unavailable() if self.network.natted else None)
        if reason:
            raise NetnsError(reason)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        if self._uses_tun():
            self._up_tun()
        else:
            self._up_veth()
        log.info("netns lab up: %d sites, prefix %s", self.n, self.prefix)

    def _uses_tun(self) -> bool:
        """TUN links when asked for, or when delay/jitter/loss need netem and it is missing."""
        emulator = self.network.emulator
        if emulator == "tun":
            return True
        if not self.network.needs_netem() or netem_supported(self.hub, "br0"):
            return False
        if emulator == "netem":
            raise NetnsError(
                "network.emulator = 'netem': delay, jitter and loss need the netem qdisc "
                "(kernel module sch_netem), which this kernel lacks; use emulator = 'auto' "
                "or 'tun' (a user-space switch over TUN devices) instead"
            )
        log.info("no netem qdisc in this kernel: links are TUN devices and a user-space switch")
        return True

    def _up_tun(self) -> None:
        if self.network.natted:
            raise NetnsError(
                "network.natted: sites behind NAT need veth links (tc shaping), not TUN links; "
                "set network.emulator = 'netem', or drop delay, jitter and loss where this "
                "kernel has no netem"
            )
        fds: list[int] = []
        try:
            for i in range(self.n):
                self._add_ns(self.ns(i))
                fds.append(open_tun(self.ns(i), "eth0"))
        except TunError as err:
            for fd in fds:
                os.close(fd)
            raise NetnsError(f"TUN links: {err}") from err
        paths = swarm_paths(self.network, self.n, self.seed)
        self.switch = TunSwitch(fds, paths, subnet_sites(SUBNET, self.n)).start()
        for i in range(self.n):
            ns = self.ns(i)
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/{PREFIX_LEN}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def _up_veth(self) -> None:
        for i in range(self.n):
            ns = self.ns(i)
            self._add_ns(ns)
            # A site behind NAT: the public link ends in its router, the site sits behind.
            public = self.router(i) if self.natted(i) else ns
            if public != ns:
                self._add_ns(public)
            _run(["ip", "link", "add", f"v{i}", "netns", self.hub, "type", "veth",
                  "peer", "name", "eth0", "netns", public])  # fmt: skip
            _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "up"])
            _run(["ip", "-n", public, "addr", "add", f"{self.address(i)}/{PREFIX_LEN}",
                  "dev", "eth0"])  # fmt: skip
            _run(["ip", "-n", public, "link", "set", "eth0", "up"])
            if public != ns:
                put_behind_nat(i, ns, public, _run)
        for i in range(self.n):
            site = self.network.site(i)
            pairs = {}
            for j in range(self.n):
                p = self.network.pair(i, j) if j != i else None
                if p is not None:
                    pairs[self.address(j)] = p
            for cmd in shaping_commands("eth0", site, pairs):
                _run(["ip", "netns", "exec", self.ns(i), *cmd])
            for cmd in shaping_commands(f"v{i}", site):
                _run(["ip", "netns", "exec", self.hub, *cmd])

    def down(self) -> None:
        """Kill what runs inside our namespaces and delete them (idempotent)."""
        if self.switch is not None:
            self.switch.close()
            self.switch = None
        for ns in reversed(self.created):
            delete_namespace(ns)
        left = [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
        for ns in left:
            delete_namespace(ns)
        self.created.clear()

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes on each site's access link as the kernel counts them (headers included):
        ``{"peer0": {"tx_bytes": ..., "rx_bytes": ...}, ...}`` read from eth0 in each site."""
        out = {}
        for i in range(self.n):
            proc = _run(["ip", "-n", self.ns(i), "-s", "-j", "link", "show", "eth0"], check=False)
            try:
                stats = json.loads(proc.stdout)[0]["stats64"]
                out[f"peer{i}"] = {
                    "tx_bytes": int(stats["tx"]["bytes"]),
                    "rx_bytes": int(stats["rx"]["bytes"]),
                }
            except (json.JSONDecodeError, IndexError, KeyError):
                out[f"peer{i}"] = {"tx_bytes": 0, "rx_bytes": 0}
        return out

    def __enter__(self) -> NetnsLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
