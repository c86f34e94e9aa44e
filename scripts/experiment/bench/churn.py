"""Churn all through a run: a schedule of leave and join events, and a driver that applies
them to a :class:`~gossipgrad.experiment.launch.LocalSwarm` while it trains.

Every ``every_rounds`` rounds of the swarm -- its median round, read from the peers'
status.json as ``step // gossip.local_steps`` (a peer's rounds follow its steps: one round per
``local_steps`` steps) -- the driver applies one event:

* ``sigkill``: a crash; the peer's steps since its last checkpoint are lost.
* ``sigterm``: a clean leave; the peer finishes its step, checkpoints and says goodbye.
* ``restart``: the peer stopped longest starts again with the same config and its run dir, so
  it resumes from its checkpoint (or, the swarm ``peer.join_after_steps`` past it, takes the
  swarm's state); it bootstraps from a live peer (peer0 may be gone).
* ``join``: a brand-new peer (index ``n`` and up, run dir of its own) joins; having no
  checkpoint, it downloads the swarm's state from the most advanced live peer.

Events cycle through that order (or are drawn with a seeded RNG), skipping those that would
take the live count outside ``[min_live, max_live]``
(:mod:`~gossipgrad.experiment.bench.churn_schedule`);
victims are drawn with the same seed.
Only processes this driver's swarm started are ever signalled. Each event is appended to
``events.jsonl`` as it happens (time, round, event, peer); the whole trace -- every peer life
(spawn, end, how), every status sample, the events -- goes to ``trace.json`` at the end, and
:mod:`gossipgrad.experiment.bench.churn_figures` turns it into the figures.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from gossipgrad.experiment.bench.churn_schedule import ChurnSchedule
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.peer.records import PeerStatus
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Daemon states in which a peer steps or gossips.
WORKING = ("training", "final-rounds")
# A new life's metrics are scraped this often until its first exchange (or this long).
SCRAPE_EVERY_S = 0.1
SCRAPE_FOR_S = 600.0


@dataclass
class Life:
    """One process of one peer: from its spawn to its end."""

    peer: int
    pid: int
    how: str  # start, restart or join
    spawned: float  # unix time
    ended: float | None = None
    end: str | None = None  # sigkill, sigterm (the signal sent), exit, after-finish
    exit_code: int | None = None
    start_step: int | None = None  # the step it started training from (status.json)
    last_step: int = 0
    # From its Prometheus endpoint (when metrics are on), restarts and joins only: the first
    # scrape whose round had mixed a neighbour's copy, and its rounds by then; and the peer's
    # own gossipgrad_first_mix_seconds (its server start to its first mixing round, exact).
    first_exchange: float | None = None
    first_exchange_rounds: int | None = None
    first_mix_s: float | None = None
    log: str = ""  # its log file (a warm spare's own, else the peer's, shared by its lives)
    spare: bool = False  # a warm spare took this life (gossipgrad-peer --standby)


@dataclass(frozen=True)
class StatusSample:
    """What one poll read of one life's status.json."""

    time: float
    peer: int
    pid: int
    state: str
    step: int


@dataclass(frozen=True)
class ChurnEvent:
    """One event as it happened (a line of events.jsonl)."""

    time: float
    round: int
    event: str
    peer: int
    live_after: int


@dataclass
class ChurnTrace:
    """Everything a churn run recorded (``trace.json``)."""

    n: int
    steps: int
    local_steps: int
    started: float
    ended: float = 0.0
    lives: list[Life] = field(default_factory=list)
    samples: list[StatusSample] = field(default_factory=list)
    events: list[ChurnEvent] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ChurnTrace:
        return cls(
            n=data["n"],
            steps=data["steps"],
            local_steps=data["local_steps"],
            started=data["started"],
            ended=data["ended"],
            lives=[Life(**x) for x in data["lives"]],
            samples=[StatusSample(**x) for x in data["samples"]],
            events=[ChurnEvent(**x) for x in data["events"]],
        )


class MixingProgress(NamedTuple):
    """What a new life's Prometheus exposition says of its mixing so far."""

    mixed: float  # gossipgrad_neighbors: neighbours mixed in the last round
    rounds: float  # gossipgrad_gossip_rounds_total: rounds run by this process
    first_mix_s: float | None  # gossipgrad_first_mix_seconds; None before its first mix

    @property
    def has_mixed(self) -> bool:
        return self.mixed > 0 or self.first_mix_s is not None


def mixing_progress(exposition: str) -> MixingProgress:
    """The :class:`MixingProgress` in a Prometheus text exposition (one parse)."""
    names = (
        "gossipgrad_neighbors",
        "gossipgrad_gossip_rounds_total",
        "gossipgrad_first_mix_seconds",
    )
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name in names
    }
    first = values.get("gossipgrad_first_mix_seconds")
    return MixingProgress(
        mixed=values.get("gossipgrad_neighbors", 0.0),
        rounds=values.get("gossipgrad_gossip_rounds_total", 0.0),
        first_mix_s=None if first is None or math.isnan(first) else first,
    )


class ChurnDriver:
    """Applies a :class:`ChurnSchedule` to a started swarm and records the run.

    Args:
        swarm: the swarm, already started (``start()``); peers ``0..n-1`` are its first lives.
        schedule: the churn (None: no events; the same recording, for the baseline run).
        steps: ``train.steps`` of the peers.
        local_steps: ``gossip.local_steps`` (steps per round).
        join_extra: config keys for brand-new joiners only (e.g. ``peer.expected_peers=1``:
            a fresh peer with the swarm's ``expected_peers`` waits up to
            ``peer.start_timeout`` while fewer peers than that are live). Restarted peers
            get the config they had.
        poll_s: seconds between two polls of the statuses.
    """

    def __init__(
        self,
        swarm: LocalSwarm,
        schedule: ChurnSchedule | None,
        *,
        steps: int,
        local_steps: int = 1,
        join_extra: dict[str, str] | None = None,
        poll_s: float = 0.25,
    ) -> None:
        self.swarm = swarm
        self.schedule = schedule
        self.join_extra = join_extra or {}
        self.poll_s = poll_s
        self.trace = ChurnTrace(n=swarm.n, steps=steps, local_steps=local_steps, started=0.0)
        self.current: dict[int, Life] = {}  # peer -> its life now (ended ones stay until respawn)
        self.stopped: list[int] = []  # peers not running, stopped longest first
        self._next_index = swarm.n
        self._rng = random.Random(schedule.seed if schedule else 0)
        self._last_event_round: int | None = None
        self.finishing = False  # a peer reached train.steps: no more events
        self._lives_lock = threading.Lock()  # current lives, read by the scraping thread
        self.events_path = swarm.out / "events.jsonl"

    # ------------------------------------------------------------------ lives

    def _adopt(self, i: int, how: str) -> None:
        proc = self.swarm.procs[i]
        life = Life(peer=i, pid=proc.pid, how=how, spawned=time.time())
        life.log = str(self.swarm.log_path.get(i, ""))
        life.spare = proc.pid in self.swarm.spare_pids
        self.trace.lives.append(life)
        with self._lives_lock:
            self.current[i] = life

    def _end(self, i: int, end: str) -> None:
        life = self.current[i]
        if life.ended is not None:
            return
        life.ended, life.end = time.time(), end
        life.exit_code = self.swarm.procs[i].poll()
        if end != "exit" or life.exit_code != 0:
            self.stopped.append(i)

    def live(self) -> list[int]:
        """Peers whose current life runs."""
        return [i for i, life in self.current.items() if life.ended is None]

    def working(self) -> list[int]:
        """Live peers whose status.json (written by this life) says they train."""
        out = []
        for i in self.live():
            s = self.swarm.status(i)
            if s.pid == self.current[i].pid and s.state in WORKING:
                out.append(i)
        return out

    # ------------------------------------------------------------------ polling

    def _sample(self) -> list[int]:
        """Read every live peer's status (and notice exits); the working peers' rounds."""
        now = time.time()
        rounds = []
        for i in list(self.live()):
            life = self.current[i]
            s: PeerStatus = self.swarm.status(i)
            if s.pid == life.pid:
                self._record(i, life, s, now)
                if s.state in WORKING and s.step >= (life.start_step or 0):
                    rounds.append(s.step // self.trace.local_steps)  # not its first writes
                if s.state == "done" or s.step >= self.trace.steps:
                    self.finishing = True
            if self.swarm.procs[i].poll() is not None:
                self._end(i, "exit")
        return rounds

    def _scrape_loop(self, stop: threading.Event) -> None:
        """Scrape on a thread of its own: a new life on a busy core may take seconds to
        answer, and status samples paused meanwhile would read as a stall of the swarm
        (measured: 2.6 s without a sample while every peer went on training)."""
        while not stop.wait(SCRAPE_EVERY_S):
            self._scrape_new(time.time())

    def _scrape_new(self, now: float) -> None:
        """Poll the metrics of restarted and joined lives until their first exchange."""
        with self._lives_lock:
            lives = [(i, life) for i, life in self.current.items() if life.ended is None]
        for i, life in lives:
            if life.how == "start" or life.first_exchange is not None:
                continue
            if now - life.spawned > SCRAPE_FOR_S:
                continue
            s = self.swarm.status(i)
            if s.pid != life.pid or not s.metrics_port:
                continue
            url = f"http://127.0.0.1:{s.metrics_port}/metrics"
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    text = resp.read().decode()
                progress = mixing_progress(text)
                if progress.has_mixed:
                    life.first_exchange, life.first_exchange_rounds = now, int(progress.rounds)
                    life.first_mix_s = progress.first_mix_s

    # ------------------------------------------------------------------ events

    def _bootstrap(self) -> str | None:
        """The address of a working peer, drawn with the schedule's RNG."""
        working = self.working()
        if not working:
            return None
        return self.swarm.address(self._rng.choice(working))

    def _apply(self, kind: str, swarm_round: int) -> int | None:
        """Apply one event; the peer it touched (None if it could not be applied)."""
        if kind in ("sigkill", "sigterm"):
            candidates = self.working()
            if not candidates:
                return None
            i = self._rng.choice(candidates)
            self._sample_one(i)
            if kind == "sigkill":
                self.swarm.kill(i)
            else:
                self.swarm.terminate(i, timeout=None)
            self._end(i, kind)
            return i
        bootstrap = self._bootstrap()
        if bootstrap is None:
            return None
        if kind == "restart":
            i = self.stopped.pop(0)
            self.swarm.spawn(i, bootstrap=bootstrap)
        else:
            i = self._next_index
            self._next_index += 1
            self.swarm.spawn(i, bootstrap=bootstrap, extra=self.join_extra)
        self._adopt(i, kind)
        return i

    def _record(self, i: int, life: Life, s: PeerStatus, now: float) -> None:
        """Keep one status sample of peer i's current life, and what it says of the life."""
        self.trace.samples.append(StatusSample(now, i, life.pid, s.state, s.step))
        if s.state in WORKING:
            if life.start_step is None and s.start_step is not None:
                life.start_step = s.start_step
            life.last_step = max(life.last_step, s.step)

    def _sample_one(self, i: int) -> None:
        """A last status sample of peer i before it is signalled."""
        life, s = self.current[i], self.swarm.status(i)
        if s.pid == life.pid:
            self._record(i, life, s, time.time())

    def _maybe_event(self, rounds: list[int]) -> None:
        if self.schedule is None or self.finishing or not rounds:
            return
        swarm_round = int(statistics.median(rounds))
        if not self.schedule.due(swarm_round, self._last_event_round):
            return
        live, stopped, working = len(self.live()), len(self.stopped), len(rounds)
        kind = self.schedule.pick(len(self.trace.events), live, stopped, self._rng, working)
        if kind is None:
            return
        i = self._apply(kind, swarm_round)
        self._last_event_round = swarm_round
        if i is None:
            return
        event = ChurnEvent(time.time(), swarm_round, kind, i, len(self.live()))
        self.trace.events.append(event)
        with open(self.events_path, "a") as f:
            f.write(json.dumps(asdict(event)) + "\n")
        log.info("round %d: %s peer%d (%d live)", swarm_round, kind, i, event.live_after)

    def _stop_late_lives(self) -> None:
        """Once the swarm has finished, stop the lives that never got to train.

        A join or restart applied just before the last peers finish would find no donor
        and wait ``peer.start_timeout`` for one (minutes) before giving up; the run is over
        for it either way. Lives that train, or trained, are left to finish by themselves.
        """
        if not self.finishing:
            return
        live = self.live()
        if not live or any(self.current[i].start_step is not None for i in live):
            return
        for i in live:
            log.info("peer%d never trained and the swarm has finished: stopped", i)
            self.swarm.terminate(i, timeout=None)
            self._end(i, "after-finish")

    # ------------------------------------------------------------------ the run

    def run(self, timeout: float) -> ChurnTrace:
        """Poll and apply events until every peer has exited or ``timeout`` seconds passed;
        the trace (also written to ``trace.json``). Peers still running then are left to
        the caller's ``swarm.stop()``."""
        self.trace.started = time.time()
        self.events_path.write_text("")
        for i in sorted(self.swarm.procs):
            self._adopt(i, "start")
        deadline = time.monotonic() + timeout
        stop = threading.Event()
        scraper = threading.Thread(target=self._scrape_loop, args=(stop,), name="scrape")
        scraper.start()
        try:
            while self.live() and time.monotonic() < deadline:
                self._maybe_event(self._sample())
                self._stop_late_lives()
                time.sleep(self.poll_s)
            self._sample()
        finally:
            stop.set()
            scraper.join()
        self.trace.ended = time.time()
        (self.swarm.out / "trace.json").write_text(json.dumps(self.trace.to_json()))
        return self.trace
