"""What one direction of an emulated WAN link does to the bytes it carries: per-stage rate,
delay, jitter, loss and resets, as release times (no sockets here; ``link_relay`` moves the
bytes).

A path is a list of stages (site i's uplink, then site j's downlink, as in netns mode); per
chunk of bytes read from a socket, in order:

1. Each stage serializes the chunk at its rate: it leaves at
   ``max(arrival, stage busy until) + bytes / rate``. A stage's transmitter (``Serializer``)
   is shared by every connection over the same access link, like one HTB class.
2. It then adds its one-way delay plus N(0, jitter²), truncated at 0 (netem's
   ``delay D J distribution normal``).
3. A chunk of k packets (1448-byte MSS) is "lost" with probability 1 - (1 - p)^k: TCP would
   retransmit it, so it arrives one retransmission timeout later (``LinkPath.loss_delay``).
4. Release = max(that, the previous chunk's release): TCP delivers in order, so a late chunk
   holds back the ones behind it (head-of-line blocking).
5. With probability 1 - (1 - r)^k the relay instead resets the connection (RST both ends).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from gossipgrad.experiment.spec import LinkProfile, NetworkSection, rate_bits, time_seconds

MSS_BYTES = 1448
MAX_CHUNK_BYTES = 64 * 1024
# Chunks carry about this much of a stage's serialization time (pipe granularity).
CHUNK_SECONDS = 0.005
QUEUE_SLACK_BYTES = 256 * 1024
# Timer wake-up compensation: at most this much early, adapting with this gain per wake-up.
MAX_WAKE_LEAD_S = 0.010
WAKE_LEAD_SHARE = 0.25
WAKE_LEAD_GAIN = 0.1
UNSHAPED_QUEUE_BYTES = 16 << 20
# Linux's TCP_RTO_MIN: the least a retransmission timeout waits.
DEFAULT_RTO_S = 0.2


class LinkReset(ConnectionError):
    """The emulated link reset the connection (``Stage.reset``)."""


class Serializer:
    """A link's transmitter: bytes leave at ``rate`` bytes/s, one chunk after another.

    Shared by every direction that crosses the same access link, so connections compete for
    its rate as flows do for an HTB class.
    """

    def __init__(self, rate: float | None = None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be positive bytes/s, got {rate}")
        self.rate = rate
        self.busy_until = 0.0

    def depart(self, t: float, nbytes: int) -> float:
        """When a chunk offered at ``t`` has been transmitted."""
        if not self.rate:
            return t
        self.busy_until = max(t, self.busy_until) + nbytes / self.rate
        return self.busy_until


def bytes_per_s(p: LinkProfile) -> float | None:
    """A profile's rate in bytes/s (None: unshaped)."""
    return rate_bits(p.rate) / 8 if p.rate else None


@dataclass
class Stage:
    """One hop of a path (seconds, probabilities per packet, bytes/s)."""

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    """Probability that a packet is lost (and so retransmitted)."""
    reset: float = 0.0
    """Probability, per packet's worth of bytes, that the connection is reset."""
    serializer: Serializer = field(default_factory=Serializer)

    @classmethod
    def from_profile(cls, p: LinkProfile, serializer: Serializer | None = None) -> Stage:
        """A stage from a spec profile (percent -> probability, tc units -> SI)."""
        return cls(
            delay=time_seconds(p.delay) if p.delay else 0.0,
            jitter=time_seconds(p.jitter) if p.jitter else 0.0,
            loss=p.loss / 100.0,
            reset=p.reset / 100.0,
            serializer=serializer or Serializer(bytes_per_s(p)),
        )


@dataclass
class PathStats:
    """What one path did (all connections through it)."""

    bytes: int = 0
    chunks: int = 0
    lost_chunks: int = 0
    resets: int = 0
    writes: int = 0
    release_error_seconds: float = 0.0
    """Sum over writes of |time written - release time|: the emulator's own timing error."""
    max_late_seconds: float = 0.0
    queue_drops: int = 0
    """Packets dropped because the path's queue was full (``link_tun`` only)."""


class LinkPath:
    """The stages one direction of traffic crosses, with its seeded randomness and counters.

    Args:
        stages: hops in order.
        seed: seeds jitter, loss and reset draws.
        loss_delay: extra seconds a lost chunk waits (None: ``max(rto, 2 * one-way delay)``).
        rto: minimum retransmission timeout used for ``loss_delay``'s default.
    """

    def __init__(
        self,
        stages: list[Stage],
        seed: int = 0,
        loss_delay: float | None = None,
        rto: float = DEFAULT_RTO_S,
    ) -> None:
        self.stages = list(stages)
        self.rng = random.Random(seed)
        one_way = sum(s.delay for s in self.stages)
        spread = sum(s.jitter for s in self.stages)
        # RFC 6298: RTO = SRTT + 4 RTTVAR, at least the kernel's minimum.
        rto_estimate = max(rto, 2 * one_way + 4 * spread)
        self.loss_delay = rto_estimate if loss_delay is None else loss_delay
        self.stats = PathStats()
        # How late the loop thread wakes from a timer, lately (EWMA); writes are timed that
        # much early, so a loaded machine's scheduling delay does not add to the link's. At
        # most a quarter of the path's delay, so no chunk ever leaves without its delay.
        self.wake_lead = 0.0
        self.max_wake_lead = min(MAX_WAKE_LEAD_S, WAKE_LEAD_SHARE * one_way)
        rates = [s.serializer.rate for s in self.stages if s.serializer.rate]
        rate = min(rates) if rates else None
        self.chunk_bytes = (
            int(min(MAX_CHUNK_BYTES, max(MSS_BYTES, rate * CHUNK_SECONDS)))
            if rate
            else MAX_CHUNK_BYTES
        )
        self.queue_bytes = (
            int(rate * (one_way + spread)) + QUEUE_SLACK_BYTES if rate else UNSHAPED_QUEUE_BYTES
        )

    def adapt_wake_lead(self, woke_late: float) -> None:
        """Move the wake-up lead towards the lateness of the latest timer wake-up."""
        sample = min(max(woke_late, 0.0), self.max_wake_lead)
        self.wake_lead += WAKE_LEAD_GAIN * (sample - self.wake_lead)

    def release(self, t: float, nbytes: int, previous: float) -> float:
        """When a chunk read at ``t`` reaches the other end (after ``previous``, the release
        of the chunk before it on the same connection); a lost chunk arrives a retransmission
        timeout later, as TCP would deliver it.

        Raises:
            LinkReset: the link resets the connection instead.
        """
        packets = max(1, math.ceil(nbytes / MSS_BYTES))
        at = self._cross(t, nbytes, packets, drop_lost=False)
        assert at is not None
        return max(at, previous)

    def deliver(self, t: float, nbytes: int, previous: float) -> float | None:
        """When one IP packet offered at ``t`` leaves the path (after ``previous``, so the
        path stays FIFO), or None if it is lost: dropped, as netem drops it, and TCP's own
        retransmission does the rest (``link_tun``)."""
        at = self._cross(t, nbytes, 1, drop_lost=True)
        return None if at is None else max(at, previous)

    def _cross(self, t: float, nbytes: int, packets: int, drop_lost: bool) -> float | None:
        for s in self.stages:
            if s.reset and self.rng.random() < 1.0 - (1.0 - s.reset) ** packets:
                self.stats.resets += 1
                raise LinkReset("emulated connection reset")
            t = s.serializer.depart(t, nbytes)
            t += max(0.0, s.delay + (self.rng.gauss(0.0, s.jitter) if s.jitter else 0.0))
            if s.loss and self.rng.random() < 1.0 - (1.0 - s.loss) ** packets:
                self.stats.lost_chunks += 1
                if drop_lost:
                    return None
                t += self.loss_delay
        self.stats.bytes += nbytes
        self.stats.chunks += 1
        return t


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


def swarm_paths(network: NetworkSection, n: int, seed: int) -> dict[tuple[int, int], LinkPath]:
    """The path of every directed site pair i->j of a ``[network]`` section, shaped as netns
    mode's qdiscs would: site i's uplink (its profile, or the ``[[network.links]]`` entry of
    {i, j} merged over it, with its own transmitter like an HTB class), then site j's downlink
    (its profile; one transmitter for all traffic into j). Path i->j draws from its own
    seeded stream."""
    rto = time_seconds(network.rto)
    down = {j: Serializer(bytes_per_s(network.site(j))) for j in range(n)}
    uplink, up = _uplinks(network, n)
    paths: dict[tuple[int, int], LinkPath] = {}
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            stages = [
                Stage.from_profile(uplink[i, j], up[i, j]),
                Stage.from_profile(network.site(j), down[j]),
            ]
            paths[i, j] = LinkPath(stages, seed=seed * 1_000_003 + i * 1009 + j, rto=rto)
    return paths
