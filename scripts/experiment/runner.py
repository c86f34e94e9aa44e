"""Run one experiment: the swarm, then each baseline, in the same place; then the report.

    spec = load_spec(Path("scripts/experiments/digits-small.toml"))
    report = Experiment(spec, Path("runs/digits-small")).run()

Modes (``experiment.mode``): ``local`` runs every process on 127.0.0.1; ``netns`` runs site i
(peer i, and rank i of each baseline) inside its own network namespace with shaped links
(``gossipgrad.experiment.netns``); ``ssh`` runs peers on the inventory's hosts
(``gossipgrad.experiment.ssh``). Whatever happens -- a failure, Ctrl-C, SIGTERM -- every
process is stopped and every namespace removed before ``run()`` returns or raises.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gossipgrad.experiment import netns, ssh
from gossipgrad.experiment.analysis import consensus_distance
from gossipgrad.experiment.baselines import BaselineRun, RankPlacement
from gossipgrad.experiment.launch import LocalSwarm
from gossipgrad.experiment.link_swarm import SwarmRelays, site_host
from gossipgrad.experiment.live import LiveView, Progress
from gossipgrad.experiment.records import (
    BaselineResult,
    PeerResult,
    Report,
    Sample,
    SwarmResult,
)
from gossipgrad.experiment.report import write_outputs
from gossipgrad.experiment.spec import Spec
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.records import PeerStatus, PeerSummary, read_record
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

log = logging.getLogger(__name__)

SCRAPE_EVERY_S = 2.0
# Daemon states in which a peer is working (training, or gossip-only final rounds).
ACTIVE_STATES = ("training", "final-rounds")
_EDGE_COUNTERS = {
    "gossipgrad_sent_bytes_total": "sent",
    "gossipgrad_received_bytes_total": "received",
}


def edge_bytes(exposition: str) -> dict[str, dict[str, int]]:
    """Bytes per neighbour in a peer's Prometheus text exposition:
    ``{neighbour: {"sent": n, "received": n}}`` summed over message kinds."""
    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            direction = _EDGE_COUNTERS.get(sample.name)
            if direction is None:
                continue
            entry = out.setdefault(sample.labels.get("neighbor", "?"), {"sent": 0, "received": 0})
            entry[direction] += int(sample.value)
    return out


def scrape_edge_bytes(port: int, timeout: float = 1.0) -> dict[str, dict[str, int]]:
    """:func:`edge_bytes` of the peer whose Prometheus endpoint is on 127.0.0.1:``port``."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return edge_bytes(resp.read().decode())


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while cleaning up, so a second Ctrl-C cannot cut the
    cleanup short; a signal that arrived meanwhile is delivered afterwards."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, int]:
    """Per site access link: bytes sent (upload) and received (download) in a phase."""
    out = {}
    for site, c in after.items():
        b = before.get(site, {})
        out[f"{site} up"] = c["tx_bytes"] - b.get("tx_bytes", 0)
        out[f"{site} down"] = c["rx_bytes"] - b.get("rx_bytes", 0)
    return out


class Experiment:
    """One spec run into one output directory.

    Args:
        spec: the validated experiment.
        out: output directory (created).
        console: where the live view and messages go.
        live: redraw a live table (else a plain line every few seconds).
    """

    def __init__(
        self, spec: Spec, out: Path, console: Console | None = None, live: bool = True
    ) -> None:
        self.spec = spec
        self.out = Path(out)
        self.console = console or Console()
        self.live = live
        self.n = spec.experiment.peers
        self.cfg = spec.peer_config()
        self.lab: netns.NetnsLab | None = None
        self.relays: SwarmRelays | None = None
        self.inventory: ssh.Inventory | None = None
        if spec.experiment.mode == "ssh":
            assert spec.ssh.inventory is not None
            self.inventory = ssh.load_inventory(spec.ssh.inventory)
            if len(self.inventory.hosts) < self.n:
                raise ValueError(
                    f"ssh.inventory lists {len(self.inventory.hosts)} hosts for "
                    f"experiment.peers = {self.n}"
                )
        self.run_name = f"{spec.experiment.name}-{int(time.time())}"

    # -- placement -------------------------------------------------------------------------

    def _prefix(self) -> Callable[[int], list[str]] | None:
        return self.lab.exec_prefix if self.lab else None

    def _peer_overrides(self, i: int) -> dict[str, str]:
        if self.relays is not None:
            return self.relays.peer_overrides(i)
        if not self.lab:
            return {}
        opts = {"peer.listen": f"{self.lab.address(i)}:0"}
        # The namespaces form a private network with no route out of this host, so plaintext
        # gRPC is fine there unless the spec configures [security] itself.
        if "security" not in self.spec.peer_raw:
            opts["security.insecure"] = "true"
        return opts

    def _placement(self) -> RankPlacement:
        if self.lab:
            return RankPlacement(
                prefix=self.lab.exec_prefix, host=self.lab.address(0), ifname="eth0"
            )
        return RankPlacement()

    def make_swarm(self) -> LocalSwarm | ssh.SshSwarm:
        overrides = self.spec.peer_overrides()
        if self.inventory is not None:
            return ssh.SshSwarm(
                self.out / "swarm", self.n, overrides, self.inventory, self.run_name,
                self.spec.ssh.options,
            )  # fmt: skip
        return LocalSwarm(
            self.out / "swarm",
            self.n,
            overrides,
            command_prefix=self._prefix(),
            peer_overrides=self._peer_overrides,
        )

    def plan(self) -> list[str]:
        """What ``run()`` would do, one line per step (``--dry-run``)."""
        s, lines = self.spec, []
        lines.append(
            f"experiment {s.experiment.name}: {self.n} peers, mode {s.experiment.mode}, "
            f"task {self.cfg.train.task}, {self.cfg.train.steps} steps of batch "
            f"{self.cfg.train.batch_size}, seed {s.experiment.seed}, codec "
            f"{self.cfg.gossip.codec}, topology {self.cfg.gossip.topology}, gamma "
            f"{self.cfg.gossip.gamma}"
        )
        if s.experiment.mode == "netns":
            lab = netns.NetnsLab(self.n, s.network, prefix="ggPLANx0000-")
            for i in range(self.n):
                site = s.network.site(i)
                lines.append(
                    f"site {i}: namespace {lab.ns(i)} address {lab.address(i)} "
                    f"rate={site.rate or 'unshaped'} delay={site.delay or 0} "
                    f"jitter={site.jitter or 0} loss={site.loss}%"
                )
            for link in s.network.links:
                lines.append(f"link {link.a}<->{link.b}: {link.model_dump(exclude={'a', 'b'})}")
            self.lab = lab
        if s.network.uses_relay(s.experiment.mode):
            lines.append(
                f"links: {self.n * (self.n - 1)} user-space relays on 127.0.0.1 (one per "
                f"directed site pair, ports picked at run time: 127.0.0.1:0 below); site i "
                f"listens on {site_host(0)[:-1]}<i+1>"
            )
            for i in range(self.n):
                site = s.network.site(i)
                lines.append(
                    f"site {i}: rate={site.rate or 'unshaped'} delay={site.delay or 0} "
                    f"jitter={site.jitter or 0} loss={site.loss}% reset={site.reset}%"
                )
            for link in s.network.links:
                pair = link.model_dump(exclude={"a", "b"}, exclude_unset=True)
                lines.append(f"link {link.a}<->{link.b}: {pair}")
            self.relays = SwarmRelays(s.network, self.n, s.experiment.seed, lambda j: None)
        try:
            swarm = self.make_swarm()
            for i in range(self.n):
                boot = "<peer0's address>" if i else None
                cmd = swarm.command(i, boot)
                lines.append(f"peer {i}: {' '.join(cmd)}")
            place = self._placement()
        finally:
            self.lab = None
            self.relays = None
        outer = s.baselines.diloco_settings(self.cfg.gossip.local_steps)
        for name in s.baselines.run:
            how, extra = "torch DDP", ""
            if name == "powersgd":
                extra = f", PowerSGD rank {s.baselines.powersgd_rank}"
            elif name.startswith("diloco"):
                how = "all-reduce DiLoCo"
                extra = f", H={outer.local_steps}, outer lr {outer.outer_lr}, momentum "
                extra += str(outer.outer_momentum)
            lines.append(
                f"baseline {name}: {self.n} ranks, {how} over gloo, rank 0 at {place.host}{extra}"
            )
        lines.append(f"outputs: {self.out}/report.json, summary.md, *.png")
        return lines

    # -- phases ----------------------------------------------------------------------------

    def _watch(
        self,
        view: LiveView,
        phase: str,
        running: Callable[[], bool],
        statuses: Callable[[], Sequence[Progress]],
        on_sample: Callable[[Any], None] | None = None,
    ) -> bool:
        """Sample statuses until the phase ends; False if it ran past experiment.timeout."""
        deadline = time.monotonic() + self.spec.experiment.timeout
        steps = self.cfg.train.steps
        while running():
            if time.monotonic() > deadline:
                log.error("%s ran past experiment.timeout; stopping it", phase)
                return False
            time.sleep(self.spec.experiment.sample_every)
            st = statuses()
            if on_sample:
                on_sample(st)
            view.update(phase, st, steps)
        return True

    def run_swarm(self, view: LiveView) -> SwarmResult:
        swarm = self.make_swarm()
        history: list[list[Sample]] = [[] for _ in range(self.n)]
        edges: dict[int, dict[str, dict[str, int]]] = {}
        last_scrape = [0.0]

        def on_sample(statuses: list[PeerStatus]) -> None:
            for i, s in enumerate(statuses):
                if s.state in ACTIVE_STATES and s.loss is not None and s.time is not None:
                    h = history[i]
                    if not h or h[-1].time != s.time:
                        h.append(
                            Sample(
                                step=s.step,
                                loss=s.loss,
                                sent_bytes=s.sent_bytes,
                                received_bytes=s.received_bytes,
                                time=s.time,
                                consensus_distance=s.consensus_distance,
                            )
                        )
            now = time.monotonic()
            if self.spec.experiment.mode == "local" and now - last_scrape[0] > SCRAPE_EVERY_S:
                last_scrape[0] = now
                for i, s in enumerate(statuses):
                    if s.metrics_port and s.state in ACTIVE_STATES:
                        with contextlib.suppress(OSError, ValueError):  # not up, or cut short
                            edges[i] = scrape_edge_bytes(s.metrics_port)

        before = self.lab.counters() if self.lab else {}
        t0 = time.monotonic()
        ok = False
        relays = self._start_relays(swarm)
        try:
            swarm.start()
            ok = self._watch(view, "swarm", swarm.running, swarm.statuses, on_sample)
        finally:
            with signals_deferred():
                swarm.stop()
                if relays is not None:
                    relays.close()
                self.relays = None
        elapsed = time.monotonic() - t0
        link_bytes = _delta(self.lab.counters(), before) if self.lab else {}
        if isinstance(swarm, ssh.SshSwarm):
            swarm.fetch()
        result = self._swarm_result(swarm, history, edges, link_bytes, ok, elapsed)
        if relays is not None:
            result.link_emulator = relays.report()
        return result

    def _start_relays(self, swarm: LocalSwarm | ssh.SshSwarm) -> SwarmRelays | None:
        """Local mode with a shaped [network]: one relay per directed site pair; peer j's
        address is read from its status.json once it is up."""
        if not self.spec.network.uses_relay(self.spec.experiment.mode):
            return None

        def address(j: int) -> str | None:
            status = read_record(swarm.peer_dir(j) / "status.json", PeerStatus)
            return status.address if status is not None else None

        self.relays = SwarmRelays(self.spec.network, self.n, self.spec.experiment.seed, address)
        return self.relays.start()

    @staticmethod
    def _peer_result(
        i: int, run_dir: Path, ok: bool, history: list[Sample], edges: dict[str, dict[str, int]]
    ) -> PeerResult:
        """Peer i's entry: its summary.json (when it wrote one) plus the sampled history."""
        summary = read_record(run_dir / "summary.json", PeerSummary)
        entry = PeerResult(
            id=f"peer{i}", ok=ok and summary is not None, history=history, neighbours=edges
        )
        if summary is None:
            return entry
        fields = set(PeerResult.model_fields) - {"ok", "history", "neighbours"}
        return entry.model_copy(update=summary.model_dump(include=fields))

    def _swarm_result(self, swarm, history, edges, link_bytes, ok, elapsed) -> SwarmResult:
        failed = swarm.failed()
        t_start = min((h[0].time for h in history if h and h[0].time), default=0.0)
        for hist in history:
            for h in hist:
                h.seconds = (h.time or t_start) - t_start
        peers = [
            self._peer_result(i, swarm.peer_dir(i), i not in failed, history[i], edges.get(i, {}))
            for i in range(self.n)
        ]
        done = [p for p in peers if p.final]
        result = SwarmResult(
            ok=ok and not failed and len(done) == self.n, elapsed_seconds=elapsed, peers=peers
        )
        if done:
            result.metric = done[0].metric
            # Training time as sampled from status.json (start-up and waiting excluded),
            # comparable with the baselines' training-loop time.
            result.wall_seconds = max(
                (p.history[-1].seconds or 0.0 for p in done if p.history), default=0.0
            )
            result.peer_wall_seconds = max(p.wall_seconds or 0.0 for p in done)
            result.mean_sent_bytes = sum(p.sent_bytes for p in done) / len(done)
            result.mean_received_bytes = sum(p.received_bytes for p in done) / len(done)
            result.mean_dense_bytes = sum(p.dense_bytes for p in done) / len(done)
        cd = consensus_distance([swarm.peer_dir(i) / "params.pt" for i in range(self.n)])
        if cd is not None:
            result.consensus_distance, result.relative_consensus_distance = cd
        result.link_bytes = link_bytes or {
            f"{p.id}→{nb}": c["sent"] for p in peers for nb, c in p.neighbours.items()
        }
        return result

    def baseline_train(self) -> TrainSection:
        """The [train] section every baseline rank runs: the swarm's, with the run's seed and
        ``baselines.steps`` when set."""
        steps = self.spec.baselines.steps or self.cfg.train.steps
        return self.cfg.train.model_copy(update={"seed": self.spec.experiment.seed, "steps": steps})

    def run_baseline(self, name: str, view: LiveView) -> BaselineResult:
        b = self.spec.baselines
        train = self.baseline_train()
        run = BaselineRun(
            name, self.n, train, self.out / "baselines" / name, self._placement(),
            b.powersgd_rank, b.powersgd_start_iter,
            b.diloco_settings(self.cfg.gossip.local_steps),
        )  # fmt: skip
        before = self.lab.counters() if self.lab else {}
        ok = False
        try:
            run.start()
            ok = self._watch(view, name, run.running, run.statuses)
        finally:
            with signals_deferred():
                run.stop()
        result = BaselineResult.model_validate(run.collect())
        result.ok = result.ok and ok
        if self.lab:
            result.link_bytes = _delta(self.lab.counters(), before)
        else:
            if self.spec.network.uses_relay(self.spec.experiment.mode):
                # gloo's ranks dial each other on ports published at run time: not relayed.
                result.network = "unshaped loopback: baselines do not go through the relays"
                log.warning("baseline %s ran on unshaped loopback (not through the relays)", name)
            result.link_bytes = {
                f"rank{r.id[4:]} ring": r.sent_bytes
                for r in result.ranks
                if r and r.sent_bytes is not None
            }
        return result

    # -- whole run -------------------------------------------------------------------------

    def run(self) -> Report:
        """Run everything and write the outputs; returns the report."""
        self.out.mkdir(parents=True, exist_ok=True)
        spec_dump = self.spec.model_dump(mode="json", exclude={"source"})
        (self.out / "spec.json").write_text(json.dumps(spec_dump, indent=1))
        t, g = self.cfg.train, self.cfg.gossip
        report = Report(
            name=self.spec.experiment.name, mode=self.spec.experiment.mode, peers=self.n,
            task=t.task, steps=t.steps, batch_size=t.batch_size, seed=self.spec.experiment.seed,
            codec=g.codec, topology=g.topology, gamma=g.gamma, local_steps=g.local_steps,
            spec=spec_dump, started=time.time(),
        )  # fmt: skip
        try:
            if self.spec.experiment.mode == "netns":
                netns.cleanup_stale()
                self.lab = netns.NetnsLab(self.n, self.spec.network).up()
                report.namespaces = self.lab.prefix
            with LiveView(self.console, self.live) as view:
                report.swarm = self.run_swarm(view)
                view.finish(self._line("swarm", report.swarm))
                for name in self.spec.baselines.run:
                    report.baselines[name] = self.run_baseline(name, view)
                    view.finish(self._line(name, report.baselines[name]))
        finally:
            if self.lab is not None:
                with signals_deferred():
                    self.lab.down()
                self.lab = None
        report.finished = time.time()
        report.ok = report.swarm.ok and all(b.ok for b in report.baselines.values())
        write_outputs(self.out, report)
        return report

    @staticmethod
    def _line(phase: str, result: SwarmResult | BaselineResult) -> str:
        if not result.ok or not result.metric:
            return f"{phase}: FAILED"
        sent = (result.mean_sent_bytes or 0) / 1e6
        if isinstance(result, SwarmResult):
            finals = [(p.final or {})[result.metric] for p in result.peers]
            return (
                f"swarm: {result.metric} {min(finals):.4f}-{max(finals):.4f}, "
                f"{sent:.3f} MB sent per peer"
            )
        final = (result.final or {})[result.metric]
        return f"{phase}: {result.metric} {final:.4f}, {sent:.3f} MB sent per rank"
