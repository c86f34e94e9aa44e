"""A WAN for netns mode on kernels without netem: every site's ``eth0`` is a TUN device, and
one thread of the runner moves each IP packet from site to site through the path of that pair
(``link_path.swarm_paths``: rate, delay, jitter, loss), as a router with netem would.

Unlike the relay emulator (local mode), this works below TCP: any program in a site's
namespace -- the peers, gloo's DDP, PowerSGD and DiLoCo ranks, hivemind -- reaches another
site only through it, with no change to how it connects. A lost packet is dropped (TCP
retransmits it, as over netem); a path whose queue is full drops the packet at its tail, like
the 1000-packet FIFO under an HTB class (``queue_limit``); packets of one path leave in the
order they came (FIFO: jitter delays, never reorders).

Its cost is one thread's CPU: every packet is one ``read`` and one ``write`` in Python
(``TunSwitch.report``'s ``cpu_seconds`` and ``cpu_seconds_per_gb``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import itertools
import logging
import os
import selectors
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from gossipgrad.experiment.link_path import MAX_WAKE_LEAD_S, WAKE_LEAD_GAIN, LinkPath

log = logging.getLogger(__name__)

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
TUN_DEVICE = "/dev/net/tun"
# A shaped path holds what is in flight on it plus this many full-size packets of queue.
QUEUE_PACKETS = 1000
MTU_BYTES = 1500
# Packets read from one device before the others get a turn.
READ_BURST = 64
IDLE_WAIT_S = 0.5
CLOSE_TIMEOUT_S = 10.0

SiteOf = Callable[[bytes], int | None]


class TunError(OSError):
    """A TUN device could not be made (no /dev/net/tun, no such namespace, not root)."""


def open_tun(namespace: str, name: str = "eth0") -> int:
    """Create TUN device ``name`` inside network namespace ``namespace`` (``ip netns``'s);
    returns its file descriptor (non-blocking, not inherited by child processes). The device
    lives while the descriptor is open.

    The namespace is entered by a short-lived thread (``setns`` moves only the calling
    thread), so no other thread of this process ever changes namespace.
    """
    result: dict[str, Any] = {}

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            target = os.open(f"{NETNS_DIR}/{namespace}", os.O_RDONLY)
        except OSError as err:
            result["error"] = TunError(f"network namespace {namespace!r}: {err.strerror}")
            return
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                result["error"] = TunError(f"setns({namespace}): {os.strerror(err)}")
                return
            fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK)
            try:
                ifr = struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI)
                fcntl.ioctl(fd, TUNSETIFF, ifr)
            except BaseException:
                os.close(fd)
                raise
            result["fd"] = fd
        except OSError as err:
            result["error"] = TunError(f"TUN device {name} in {namespace}: {err}")
        finally:
            os.close(target)

    thread = threading.Thread(target=make, name=f"tun-{namespace}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["fd"]


def subnet_sites(subnet: str, n: int) -> SiteOf:
    """The site of a destination address in ``subnet`` (three octets, e.g. "198.18.0"):
    site i is ``subnet.(i + 1)``; None for any other address."""
    head = bytes(int(x) for x in subnet.split("."))

    def site_of(dst: bytes) -> int | None:
        if dst[:3] != head or not 1 <= dst[3] <= n:
            return None
        return dst[3] - 1

    return site_of


def queue_limit(path: LinkPath) -> int | None:
    """Bytes a path may hold (in flight plus queued) before it drops at the tail: its rate
    times its delay (the packets in flight) plus ``QUEUE_PACKETS`` full packets, as an HTB
    class with a netem leaf holds them; None for an unshaped path (never full)."""
    rates = [s.serializer.rate for s in path.stages if s.serializer.rate]
    if not rates:
        return None
    in_flight = min(rates) * sum(s.delay + 2 * s.jitter for s in path.stages)
    return int(in_flight) + QUEUE_PACKETS * MTU_BYTES


class TunSwitch:
    """Moves IPv4 packets between the sites' TUN devices through their paths, in one thread.

    Args:
        fds: site i's TUN descriptor (``open_tun``); the switch closes them.
        paths: ``(i, j) -> LinkPath`` for every directed pair (``swarm_paths``).
        site_of: destination address (4 bytes) -> its site, or None (dropped, counted).
    """

    def __init__(self, fds: list[int], paths: dict[tuple[int, int], LinkPath], site_of: SiteOf):
        self.fds = list(fds)
        self.paths = paths
        self.site_of = site_of
        self.queued = dict.fromkeys(paths, 0)
        self.limit = {key: queue_limit(path) for key, path in paths.items()}
        self.last = dict.fromkeys(paths, 0.0)
        self.unroutable = 0
        self.write_errors = 0
        self._cpu_seconds = 0.0
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        delays = [sum(s.delay for s in p.stages) for p in paths.values()]
        # Writes are timed early by the loop's recent timer lateness, at most a quarter of
        # the shortest path's delay (link_path's rule), so no packet leaves without its delay.
        self._max_lead = min([MAX_WAKE_LEAD_S] + [d / 4 for d in delays if d > 0])
        self._lead = 0.0

    def start(self) -> TunSwitch:
        self._thread = threading.Thread(target=self._serve, name="tun-switch", daemon=True)
        self._thread.start()
        log.info("tun switch: %d sites, %d paths", len(self.fds), len(self.paths))
        return self

    def close(self) -> None:
        """Stop the thread and close every device and pipe (idempotent)."""
        if self._thread is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.error("tun switch did not stop within %.0f s", CLOSE_TIMEOUT_S)
                return
            self._thread = None
        for fd in [*self.fds, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self._wake_r = self._wake_w = -1

    def _serve(self) -> None:
        heap: list[tuple[float, int, int, bytes, tuple[int, int]]] = []
        order = itertools.count()
        with selectors.DefaultSelector() as sel:
            for i, fd in enumerate(self.fds):
                sel.register(fd, selectors.EVENT_READ, i)
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            while True:
                target = heap[0][0] - self._lead if heap else None
                wait = IDLE_WAIT_S if target is None else max(0.0, target - time.monotonic())
                events = sel.select(wait)
                now = time.monotonic()
                if not events and target is not None:
                    late = min(max(now - target, 0.0), self._max_lead)
                    self._lead += WAKE_LEAD_GAIN * (late - self._lead)
                for key, _ in events:
                    if key.data is None:
                        self._cpu_seconds = time.thread_time()
                        return
                    self._read(key.data, now, heap, order)
                self._write_due(heap)
                self._cpu_seconds = time.thread_time()

    def _read(self, i: int, now: float, heap: list, order: itertools.count) -> None:
        for _ in range(READ_BURST):
            try:
                packet = os.read(self.fds[i], 65536)
            except BlockingIOError:
                return
            except OSError:
                self.write_errors += 1
                return
            j = self.site_of(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
            if j is None or j == i:
                self.unroutable += 1
                continue
            key = (i, j)
            path = self.paths[key]
            limit = self.limit[key]
            if limit is not None and self.queued[key] + len(packet) > limit:
                path.stats.queue_drops += 1
                continue
            at = path.deliver(now, len(packet), self.last[key])
            if at is None:
                continue
            self.last[key] = at
            self.queued[key] += len(packet)
            heapq.heappush(heap, (at, next(order), j, packet, key))

    def _write_due(self, heap: list) -> None:
        while heap:
            now = time.monotonic()
            if heap[0][0] > now + self._lead:
                return
            at, _, j, packet, key = heapq.heappop(heap)
            self.queued[key] -= len(packet)
            stats = self.paths[key].stats
            try:
                os.write(self.fds[j], packet)
            except OSError:
                self.write_errors += 1
                continue
            stats.writes += 1
            stats.release_error_seconds += abs(now - at)
            stats.max_late_seconds = max(stats.max_late_seconds, now - at)

    def cpu_seconds(self) -> float:
        """CPU seconds the switch's thread has used so far (its whole cost)."""
        return self._cpu_seconds

    def report(self) -> dict[str, Any]:
        """Counters per directed path (i->j: every packet site i sent to site j), the packets
        no path took, and the switch's CPU cost."""
        paths = {f"{i}->{j}": vars(p.stats).copy() for (i, j), p in self.paths.items()}
        total = sum(p["bytes"] for p in paths.values())
        cpu = self.cpu_seconds()
        return {
            "emulator": "tun",
            "cpu_seconds": cpu,
            "forwarded_bytes": total,
            "forwarded_packets": sum(p["chunks"] for p in paths.values()),
            "cpu_seconds_per_gb": cpu / (total / 1e9) if total else None,
            "unroutable_packets": self.unroutable,
            "write_errors": self.write_errors,
            "paths": paths,
        }


def report_since(after: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """What a switch did between two ``report()`` snapshots (one phase of a run): every
    counter as the difference, the CPU cost per GB recomputed, the largest lateness kept."""
    if not before:
        return after

    def minus(a: Any, b: Any, key: str = "") -> Any:
        if isinstance(a, dict):
            return {k: minus(v, b.get(k, 0) if isinstance(b, dict) else 0, k) for k, v in a.items()}
        if isinstance(a, bool) or not isinstance(a, int | float) or key.startswith("max_"):
            return a
        return a - (b or 0)

    out = minus(after, before)
    total, cpu = out["forwarded_bytes"], out["cpu_seconds"]
    out["cpu_seconds_per_gb"] = cpu / (total / 1e9) if total else None
    return out
