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

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gossipgrad.experiment import netns, plan, ssh
from gossipgrad.experiment.baselines import BaselineRun, RankPlacement, refusal
from gossipgrad.experiment.launch import LocalSwarm, signals_deferred
from gossipgrad.experiment.link_swarm import SwarmRelays
from gossipgrad.experiment.link_tun import report_since
from gossipgrad.experiment.live import LiveView, Progress
from gossipgrad.experiment.records import BaselineResult, Report, SwarmResult
from gossipgrad.experiment.report import write_outputs
from gossipgrad.experiment.spec import Spec
from gossipgrad.experiment.swarm_result import swarm_result
from gossipgrad.experiment.swarm_sampling import SwarmSampler
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.records import PeerStatus, read_record
from rich.console import Console

log = logging.getLogger(__name__)

#: The port a peer behind NAT (``network.natted``, netns mode) listens on and advertises.
NATTED_PORT = 7000


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
        if self.lab.natted(i):
            # Behind NAT it binds its private address and advertises its router's public one
            # (where every new connection is dropped): a fixed port, the namespace its own.
            opts["peer.listen"] = f"{self.lab.listen_address(i)}:{NATTED_PORT}"
            opts["peer.advertise"] = f"{self.lab.address(i)}:{NATTED_PORT}"
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
        s = self.spec
        lines = [plan.experiment_line(s, self.cfg)]
        if s.experiment.mode == "netns":
            self.lab = netns.NetnsLab(self.n, s.network, prefix="ggPLANx0000-")
            lines += plan.netns_lines(self.lab, s.network, self.n)
        if s.network.uses_relay(s.experiment.mode):
            lines += plan.relay_lines(s.network, self.n)
            self.relays = SwarmRelays(s.network, self.n, s.experiment.seed, lambda j: None)
        try:
            swarm = self.make_swarm()
            for i in range(self.n):
                boot = "<peer0's address>" if i else None
                lines.append(f"peer {i}: {' '.join(swarm.command(i, boot))}")
            place = self._placement()
        finally:
            self.lab = None
            self.relays = None
        lines += plan.baseline_lines(s, self.cfg, place.host)
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
        sampler = SwarmSampler(self.n, scrape=self.spec.experiment.mode == "local")
        before = self.lab.counters() if self.lab else {}
        switch_before = self._switch_report()
        t0 = time.monotonic()
        ok = False
        relays = self._start_relays(swarm)
        try:
            swarm.start()
            ok = self._watch(view, "swarm", swarm.running, swarm.statuses, sampler.sample)
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
        result = swarm_result(swarm, self.n, sampler, link_bytes, ok, elapsed)
        if relays is not None:
            result.link_emulator = relays.report()
        elif switch_before is not None:
            result.link_emulator = report_since(self._switch_report() or {}, switch_before)
        return result

    def _switch_report(self) -> dict[str, Any] | None:
        """The netns lab's TUN switch counters so far (None: tc shapes, or local mode)."""
        switch = self.lab.switch if self.lab else None
        return switch.report() if switch is not None else None

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

    def baseline_train(self) -> TrainSection:
        """The [train] section every baseline rank runs: the swarm's, with the run's seed and
        ``baselines.steps`` when set."""
        steps = self.spec.baselines.steps or self.cfg.train.steps
        return self.cfg.train.model_copy(update={"seed": self.spec.experiment.seed, "steps": steps})

    def refusal(self, name: str) -> str | None:
        """Why baseline ``name`` would not run over the swarm's links (None: it would)."""
        mode = self.spec.experiment.mode
        return refusal(name, mode, self.spec.network.uses_relay(mode))

    def run_baseline(self, name: str, view: LiveView) -> BaselineResult:
        b = self.spec.baselines
        train = self.baseline_train()
        run = BaselineRun(
            name, self.n, train, self.out / "baselines" / name, self._placement(),
            b.powersgd_rank, b.powersgd_start_iter,
            b.diloco_settings(self.cfg.gossip),
        )  # fmt: skip
        before = self.lab.counters() if self.lab else {}
        switch_before = self._switch_report()
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
            if switch_before is not None:
                result.link_emulator = report_since(self._switch_report() or {}, switch_before)
        else:
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
                seed = self.spec.experiment.seed
                self.lab = netns.NetnsLab(self.n, self.spec.network, seed=seed).up()
                report.namespaces = self.lab.prefix
            with LiveView(self.console, self.live) as view:
                report.swarm = self.run_swarm(view)
                view.finish(self._line("swarm", report.swarm))
                for name in self.spec.baselines.run:
                    why = self.refusal(name)
                    if why is not None:
                        log.warning("baseline %s %s", name, why)
                        report.baselines[name] = BaselineResult(name=name, refused=why)
                    else:
                        report.baselines[name] = self.run_baseline(name, view)
                    view.finish(self._line(name, report.baselines[name]))
        finally:
            if self.lab is not None:
                with signals_deferred():
                    self.lab.down()
                self.lab = None
        report.finished = time.time()
        report.ok = report.swarm.ok and all(
            b.ok or b.refused is not None for b in report.baselines.values()
        )
        write_outputs(self.out, report)
        return report

    @staticmethod
    def _line(phase: str, result: SwarmResult | BaselineResult) -> str:
        if isinstance(result, BaselineResult) and result.refused is not None:
            return f"{phase}: {result.refused}"
        if not result.ok or not result.metric:
            return f"{phase}: FAILED"
        sent = (result.mean_sent_bytes or 0) / 1e6
        if isinstance(result, SwarmResult):
            finals = [(p.final or {})[result.metric] for p in result.peers]
            return (
                f"swarm: {result.metric} {min(finals):.4f}-{max(finals):.4f}, "
                f"{sent:.3f} MB sent per peer, {_util(result.compute_utilization)}"
            )
        final = (result.final or {})[result.metric]
        return (
            f"{phase}: {result.metric} {final:.4f}, {sent:.3f} MB sent per rank, "
            f"{_util(result.compute_utilization)}"
        )


def _util(value: float | None) -> str:
    return "compute utilization " + ("unknown" if value is None else f"{value:.2f}")
