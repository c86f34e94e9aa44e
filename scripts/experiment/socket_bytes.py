"""Bytes a process's TCP connections really carried, from the kernel's per-socket counters.

``ss -tinpH`` lists every TCP socket with its owner's pid and, per socket, ``bytes_acked``
(sent and acknowledged by the other end) and ``bytes_received``. ``ConnectionBytes`` reads it
twice, at the start and at the end of a phase, and sums the difference over this process's
connections: the payload the process put on the wire above TCP (what the collectives moved plus
gloo's own framing), without TCP/IP headers. Without ``ss`` (iproute2) the figures are None:
unknown, not zero.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess

log = logging.getLogger(__name__)

Counters = dict[tuple[str, str], tuple[int, int]]
"""(local address, peer address) -> (bytes_acked, bytes_received)."""

_SOCKET = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\(.*\bpid=(\d+),")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")
SS_TIMEOUT_S = 10.0


def parse_ss(text: str, pid: int) -> Counters:
    """The counters of ``pid``'s sockets in ``ss -tinpH`` output (socket line, then an
    indented line of counters)."""
    out: Counters = {}
    current: tuple[str, str] | None = None
    for line in text.splitlines():
        m = _SOCKET.match(line)
        if m:
            current = (m[1], m[2]) if int(m[3]) == pid else None
            continue
        if current is not None and line[:1].isspace():
            got = dict(_COUNTER.findall(line))
            out[current] = (int(got.get("bytes_acked", 0)), int(got.get("bytes_received", 0)))
        current = None
    return out


def read_counters(pid: int | None = None) -> Counters | None:
    """This process's (or ``pid``'s) TCP counters now; None when ``ss`` is missing or fails."""
    if shutil.which("ss") is None:
        return None
    try:
        proc = subprocess.run(
            ["ss", "-tinpH"], capture_output=True, text=True, timeout=SS_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("ss failed, bytes on the wire unknown: %s", err)
        return None
    return parse_ss(proc.stdout, os.getpid() if pid is None else pid)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class ConnectionBytes:
    """Bytes sent and received on this process's TCP connections between ``start()`` and
    ``totals()``, leaving out connections to or from ``exclude_port`` (the rendezvous store's
    port: it carries the store's keys, not the collectives)."""

    def __init__(self, exclude_port: int | None = None) -> None:
        self.exclude_port = exclude_port
        self.before: Counters | None = None

    def _kept(self, counters: Counters) -> Counters:
        return {
            k: v for k, v in counters.items() if self.exclude_port not in (_port(k[0]), _port(k[1]))
        }

    def start(self) -> None:
        got = read_counters()
        self.before = None if got is None else self._kept(got)

    def totals(self) -> tuple[int | None, int | None]:
        """(sent, received) since ``start()``; (None, None) when the counters are unknown."""
        now = read_counters()
        if now is None or self.before is None:
            return None, None
        sent = received = 0
        for key, (s, r) in self._kept(now).items():
            s0, r0 = self.before.get(key, (0, 0))
            sent, received = sent + s - s0, received + r - r0
        return sent, received
