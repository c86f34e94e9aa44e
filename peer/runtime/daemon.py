"""The peer daemon's training loop: config -> task -> GossipOptimizer -> train -> summary.

Writes into ``peer.run_dir``:
  status.json      progress, rewritten atomically every few steps (read by gossipgrad-swarm
                   and the experiment runner)
  checkpoint.pt    every ``checkpoint.every`` steps and at exit (atomic; never with a NaN or
                   infinity anywhere in it); beside the state it holds how many batches were
                   drawn and the random generators' state, so a resumed peer goes on with
                   the batch and the random draws an uninterrupted run would take next
  summary.json     final evaluation, steps, bytes, wall-clock seconds; ``evals`` (every
                   ``train.eval_every`` steps) and ``final_seconds`` carry ``seconds``: training
                   time since the loop started, evaluation time excluded (comparable with the
                   DDP baselines' clock)
  params.pt        the final flat parameter vector (true consensus distance across peers)
  buffers.pt       the model's final buffers by name (models with BatchNorm and the like)
                   (both written atomically, as the checkpoint is)
SIGTERM or SIGINT finishes the current step, ends the gossip as an interrupted run (the
exchanges under way are settled at both ends within one ``gossip.round_timeout``, the
neighbours told), checkpoints and leaves the swarm cleanly.

The end of a run, on every path: training -> ``gossip.final_rounds`` (not when stopped) ->
``finish()`` (the FINAL notices; no exchange after it) -> checkpoint -> close.

Under torchrun with more than one rank, the job is one site (peer/runtime/site.py): ranks all-reduce
gradients densely, only rank 0 gossips, and ranks other than 0 write into ``run_dir/rank<N>/``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from gossipgrad.peer.config import PeerConfig
from gossipgrad.peer.flat import persistent_buffers
from gossipgrad.peer.records import PeerStatus, PeerSummary, write_record
from gossipgrad.peer.runtime import checkpoint
from gossipgrad.peer.runtime.joining import JoinError, find_swarm
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from gossipgrad.peer.runtime.site import SiteContext, SiteOptimizer, close_site, init_site
from gossipgrad.peer.tasks import build_task
from gossipgrad.peer.tasks.schedule import make_scheduler
from gossipgrad.peer.tasks.training import LocalStep, TrainClock, make_optimizer, task_context

log = logging.getLogger(__name__)

STATUS_EVERY_S = 0.5


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as torch parses it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Daemon:
    """One peer training a task. ``run()`` returns the summary dict."""

    def __init__(self, cfg: PeerConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.peer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop_requested = threading.Event()
        self.status: dict[str, Any] = {}
        self.stopped = False  # the stop decided (a site's ranks decide it together)
        self.batches_drawn = 0  # of the task's batch order: where a resumed peer goes on
        self._resume_rng: dict[str, Any] | None = None  # restored when training starts
        self._last_status = 0.0  # when status.json was last rewritten (monotonic seconds)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, _frame) -> None:
            log.info("signal %d: finishing the step, then checkpoint and leave", signum)
            self.stop_requested.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _save_checkpoint(self, gopt: GossipOptimizer) -> bool:
        # Written from the live tensors, the state held still meanwhile: no copy of it.
        with gopt.checkpoint_state() as state:
            bad = checkpoint.nonfinite(state)
            if bad:
                # Never overwrite the last good checkpoint with a diverged state (parameters,
                # optimizer moments, the algorithm's anchor or residual): a restart would
                # resume it and crash again, or train on with a poisoned optimizer.
                log.error(
                    "state not finite at %s: checkpoint not written (the last one stays)",
                    ", ".join(bad[:4]),
                )
                return False
            state["data"] = {"batches": self.batches_drawn}
            state["rng"] = checkpoint.rng_state()
            try:
                checkpoint.save_atomic(self.run_dir / "checkpoint.pt", state)
                return True
            except OSError as err:
                log.error("checkpoint failed, training goes on: %s", err)
                return False

    def _write_status(self, **fields: Any) -> None:
        self.status.update(fields, time=time.time())
        try:
            write_record(self.run_dir / "status.json", PeerStatus.model_validate(self.status))
        except OSError as err:
            log.debug("status.json not written: %s", err)

    def run(self) -> dict[str, Any]:
        """Build the task and the optimizer, join the swarm, train, write the summary."""
        t = self.cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        site = SiteContext.from_env()
        device, shard_index, num_shards = self._placement(site)
        task = build_task(t.task, task_context(t, shard_index, num_shards, device))
        model = task.model.to(device)
        optimizer = make_optimizer(model.parameters(), t)
        self._install_signal_handlers()
        chosen = self.cfg.gossip.chosen_defaults()
        log.info(
            "gossip %s; unset keys take its recommended values: %s",
            self.cfg.gossip.algorithm,
            ", ".join(f"{k}={v!r}" for k, v in chosen.items()) or "none",
        )
        # A peer with a bootstrap list settles its reachability in _start, in its own order
        # (before the wait for expected_peers, or at the join): not in the constructor.
        if site is None:
            gopt = GossipOptimizer(model, optimizer, self.cfg, check_reachability=False)
        else:
            gopt = SiteOptimizer(
                model, optimizer, self.cfg, site, verify=t.verify_site, check_reachability=False
            )
        self._write_status(
            id=gopt.peer.id,
            address=gopt.peer.address,
            metrics_port=gopt.peer.metrics_port,
            pid=os.getpid(),
            state="starting",
            step=0,
            steps=t.steps,
            algorithm=self.cfg.gossip.algorithm,
            algorithm_defaults=chosen,
        )
        t_start = time.monotonic()
        summary: dict[str, Any] = {}
        failed = False
        try:
            self._start(gopt, site, device)
            scheduler = self._fast_forward(gopt, optimizer)
            summary = self._train(task, model, gopt, scheduler, LocalStep(t, device))
            if site is not None:
                summary["site"] = {
                    "rank": site.rank,
                    "world_size": site.world_size,
                    "rounds_verified": gopt.rounds_verified,
                }
        except FloatingPointError:
            failed = True
            raise
        finally:
            if gopt.local_step > 0 and not failed:
                self._save_checkpoint(gopt)
            gopt.close()
            if site is not None:
                close_site()
        summary["wall_seconds"] = time.monotonic() - t_start
        summary["cpu_seconds"] = time.process_time()
        try:
            write_record(self.run_dir / "summary.json", PeerSummary.model_validate(summary))
        except OSError as err:  # disk full or read-only: the run itself succeeded
            log.error("summary.json not written: %s", err)
        self._write_status(state="done")
        return summary

    def _fast_forward(self, gopt, optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """The LR schedule from the step training starts from; records the state it starts
        from (resumed, joined or fresh) in status.json as evidence."""
        scheduler = make_scheduler(optimizer, self.cfg.train, start_step=gopt.local_step)
        self._write_status(
            start_step=gopt.local_step,
            start_params=checkpoint.params_digest(gopt.flat.data),
            start_lr=optimizer.param_groups[0]["lr"],
            start_schedule_step=scheduler.last_epoch,
        )
        return scheduler

    def _placement(self, site: SiteContext | None) -> tuple[torch.device, int, int]:
        """(device, shard index, number of shards) of this process; under torchrun also
        starts the site's process group and moves ``run_dir`` to this rank's."""
        t = self.cfg.train
        device = resolve_device(t.device)
        if site is None:
            return device, t.shard_index, t.num_shards
        device = site.device(device)
        init_site(device)
        shard_index, num_shards = site.shard(t.shard_index, t.num_shards)
        self.run_dir = site.run_dir(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return device, shard_index, num_shards

    def _start(self, gopt: GossipOptimizer, site: SiteContext | None, device: torch.device) -> None:
        """Resume from the checkpoint, wait for the expected peers, join a running swarm.

        A fresh peer (no checkpoint) with a bootstrap list must find the swarm within
        ``peer.start_timeout`` (counted with the wait for ``expected_peers``), then takes the
        state of a donor if one is ``join_after_steps`` in, retrying busy or failing donors
        for up to ``start_timeout`` more. Either failing raises JoinError (a one-line error
        and a non-zero exit of the daemon), rather than training alone from scratch.
        """
        cfg, peer = self.cfg, gopt.peer
        resumed = False
        checkpoint.remove_stale_temps(self.run_dir)
        if cfg.checkpoint.resume:
            state = checkpoint.load(self.run_dir / "checkpoint.pt", map_location=device)
            if state is not None:
                gopt.load_state_dict(state)
                resumed = True
                self.batches_drawn = int(state.get("data", {}).get("batches", gopt.local_step))
                self._resume_rng = state.get("rng")
                log.info("resumed from checkpoint at step %d", gopt.local_step)
                self._write_status(step=gopt.local_step)  # not 0 while it finds the swarm
        started = time.monotonic()
        bootstrap = peer.membership is not None and peer.membership.bootstrap
        checked = False
        if bootstrap and cfg.peer.expected_peers > 1 and not resumed:
            # Reachability (and a relay) before the wait: a peer nobody can dial is present to
            # another such peer only once it is called through its relay, so two of them
            # waiting for each other would wait out start_timeout.
            find_swarm(
                peer.membership, cfg.peer.start_timeout, started=started, stop=self.stop_requested
            )
            if not self.stop_requested.is_set():
                self._check_reachable(peer)
                checked = True
        # A peer resuming from its checkpoint rejoins a swarm that already trains: waiting
        # for expected_peers would leave its neighbours waiting for it (up to start_timeout,
        # forever short of a peer that stays down).
        if cfg.peer.expected_peers > 1 and not resumed:
            ok = gopt.wait_for_peers(
                cfg.peer.expected_peers, cfg.peer.start_timeout, stop=self.stop_requested
            )
            if not ok and not self.stop_requested.is_set():
                log.warning(
                    "only %d of %d peers after %.0fs; training anyway",
                    len(peer.membership.present_ids()),
                    cfg.peer.expected_peers,
                    cfg.peer.start_timeout,
                )
        # A late joiner starts from the swarm's state instead of from scratch; so does a peer
        # whose checkpoint the swarm has left join_after_steps or more behind (resumed, it
        # would lag the others to the end and train its last steps alone).
        if self.stop_requested.is_set():  # a SIGTERM while waiting: leave without a state
            log.info("asked to stop before training: leaving")
        elif not bootstrap:
            self._check_reachable(peer)  # the first peer: nobody to ask, "unknown"
        elif self._joined(gopt, resumed, started, checked):
            self._write_status(joined_at_step=gopt.local_step)
        if site is not None:
            gopt.sync_site()  # all ranks take the leader's state (resumed or joined)

    def _check_reachable(self, peer: Peer) -> None:
        """Have a bootstrap peer dial this one back; the outcome goes to status.json. If it
        could not, the peer is called through a relay (``peer.relay = "auto"``); with none,
        raises NotReachable (a one-line error, a non-zero exit) if ``peer.require_reachable``
        is set: nobody could push to this peer."""
        if peer.membership is None:
            return
        relay = peer.settle_reachability(
            lambda found: self._write_status(reachability=dataclasses.asdict(found), relay="")
        )
        if relay:
            self._write_status(relay=relay)

    def _joined(
        self, gopt: GossipOptimizer, resumed: bool, started: float, checked: bool = False
    ) -> bool:
        """Find the swarm (JoinError if no bootstrap answers within ``peer.start_timeout``:
        a resumed peer too, which would otherwise train its remaining steps alone and report
        success), then take a donor's state: a fresh peer always (JoinError if no donor
        serves), a resumed one only when the swarm has left it ``join_after_steps`` behind
        (it keeps its checkpoint when no donor is that far ahead or none serves)."""
        membership = gopt.peer.membership
        find_swarm(
            membership, self.cfg.peer.start_timeout, started=started, stop=self.stop_requested
        )
        if self.stop_requested.is_set():
            return False
        if not checked:  # (checked: before the wait for expected_peers)
            self._check_reachable(gopt.peer)
        if not resumed:
            return gopt.join_from_swarm()
        try:
            return gopt.join_from_swarm(min_step=gopt.local_step + self.cfg.peer.join_after_steps)
        except JoinError as err:
            log.warning("resuming from the checkpoint: %s", err)
            return False

    def _train(
        self, task, model, gopt: GossipOptimizer, scheduler, local: LocalStep
    ) -> dict[str, Any]:
        """The training steps, the final gossip rounds, ``finish()``; returns the summary."""
        batches = task.batches(start=self.batches_drawn)
        if self._resume_rng is not None:  # as late as can be: the draws of training go on
            checkpoint.set_rng_state(self._resume_rng)
        self._last_status = 0.0
        self._write_status(state="training")
        clock = TrainClock()
        loss_value, evals = self._train_steps(task, model, gopt, scheduler, local, batches, clock)
        # Rounds first, then finish: its FINAL notice promises the neighbours that no
        # exchange follows, and the exchanges it leaves open are decided at both ends.
        before_rounds = self._final_rounds(task, model, gopt, clock)
        gopt.finish(interrupted=self._stopping(gopt))
        final_seconds = clock.seconds()
        final = task.evaluate(model)
        gopt.metrics.set_eval(final)
        stats = gopt.last_round
        traffic = self._traffic(gopt)
        try:
            checkpoint.save_atomic(self.run_dir / "params.pt", gopt.flat.data.detach().cpu())
            buffers = {n: b.detach().cpu() for n, b in persistent_buffers(model)}
            if buffers:
                checkpoint.save_atomic(self.run_dir / "buffers.pt", buffers)
        except OSError as err:
            log.error("final parameters not written to params.pt / buffers.pt: %s", err)
        summary = {
            "id": gopt.peer.id,
            "task": self.cfg.train.task,
            "steps": gopt.local_step,
            "rounds": gopt.round,
            "stopped_early": self.stopped,
            "final": final,
            "final_seconds": final_seconds,
            "final_before_final_rounds": before_rounds,
            "metric": task.metric,
            "higher_is_better": task.higher_is_better,
            "train_loss": loss_value,
            "consensus_distance_estimate": stats.consensus_distance if stats else None,
            "evals": evals,
            "params": gopt.flat.numel,
            "gossip_blocking_seconds": gopt.blocking_seconds,
            "compute_utilization": _utilization(gopt.blocking_seconds, final_seconds),
            **traffic,
            "neighbours": gopt.metrics.bytes_by_neighbour(),
            "exchanges": gopt.metrics.exchanges_by_neighbour(),
            "anchor_checksums": gopt.anchor_checksums(),
        }
        self._write_status(
            step=gopt.local_step, loss=loss_value, final=final, **traffic, **_consensus(gopt)
        )
        return summary

    def _train_steps(
        self, task, model, gopt: GossipOptimizer, scheduler, local: LocalStep, batches, clock
    ) -> tuple[float, list[dict[str, float]]]:
        """Local steps until ``train.steps`` or a stop signal: (last loss, evaluations)."""
        t = self.cfg.train
        loss_value = math.nan
        evals: list[dict[str, float]] = []
        stop = self._stopping(gopt)
        while gopt.local_step < t.steps and not stop:
            before = gopt.local_step
            batch = next(batches)
            self.batches_drawn += 1
            loss_value = self._step(task, model, gopt, scheduler, local, batch)
            stop, finite = self._verdict(gopt, math.isfinite(loss_value))
            if not finite:
                loss_text = (
                    "not finite on another rank" if math.isfinite(loss_value) else loss_value
                )
                raise FloatingPointError(f"loss is {loss_text} at step {gopt.local_step}")
            step = gopt.local_step
            if step == before:
                continue  # an fp16 step that overflowed: skipped, the scaler backs off
            if t.eval_every and step % t.eval_every == 0:
                seconds = clock.seconds()
                with clock.paused():
                    ev = task.evaluate(model)
                gopt.metrics.set_eval(ev)
                evals.append({"step": step, "seconds": seconds, **ev})
                log.info("step %d loss %.4f %s", step, loss_value, _fmt(ev))
            if self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0:
                self._save_checkpoint(gopt)
            if self._status_due():
                self._write_status(
                    step=step,
                    loss=loss_value,
                    relay=gopt.peer.relay,
                    **self._traffic(gopt),
                    **_consensus(gopt),
                )
        return loss_value, evals

    def _step(
        self, task, model, gopt: GossipOptimizer, scheduler, local: LocalStep, batch: Any
    ) -> float:
        """One local step on ``batch``; its loss (an fp16 step whose gradients overflow is
        skipped, as torch's loss scaler does, and nothing is sent). The caller decides what a
        non-finite loss means (``_verdict``: in a site, all ranks at once)."""
        gopt.zero_grad()
        loss, ok = local.backward(task, model, batch, gopt.optimizer)
        if ok:
            gopt.step()
            scheduler.step()
        local.done()
        loss_value = float(loss.detach())
        if ok and math.isfinite(loss_value):
            gopt.metrics.record_step(loss_value, self.cfg.train.batch_size)
        return loss_value

    def _final_rounds(
        self, task, model, gopt: GossipOptimizer, clock: TrainClock
    ) -> dict[str, float] | None:
        """``gossip.final_rounds`` gossip-only rounds; the evaluation before them (or None)."""
        if not self.cfg.gossip.final_rounds or self._stopping(gopt):
            return None
        with clock.paused():
            before_rounds = task.evaluate(model)
        for _ in range(self.cfg.gossip.final_rounds):
            if self._stopping(gopt):
                break
            gopt.gossip_round()
            gopt.peer.update_progress(gopt.local_step, gopt.round)
            if self._status_due():
                self._write_status(state="final-rounds", **self._traffic(gopt), **_consensus(gopt))
        return before_rounds

    def _verdict(self, gopt: GossipOptimizer, finite: bool = True) -> tuple[bool, bool]:
        """(stop, loss finite) after a step: this process's own view, or in a site the view
        all ranks share (``SiteOptimizer.agree``, a collective: every rank calls it at the same
        points), so no rank leaves the loop while another waits in its next collective."""
        stop = self.stop_requested.is_set()
        if isinstance(gopt, SiteOptimizer):
            stop, finite = gopt.agree(stop, finite)
        self.stopped = self.stopped or stop
        return stop, finite

    def _stopping(self, gopt: GossipOptimizer) -> bool:
        """Whether to stop now (see ``_verdict``; a collective in a site)."""
        return self._verdict(gopt)[0]

    def _status_due(self) -> bool:
        """True at most every ``STATUS_EVERY_S`` seconds (status.json is rewritten then)."""
        now = time.monotonic()
        if now - self._last_status > STATUS_EVERY_S:
            self._last_status = now
            return True
        return False

    @staticmethod
    def _traffic(gopt: GossipOptimizer) -> dict[str, int]:
        """Bytes this peer put on the wire so far, by kind, plus the dense equivalent."""
        return gopt.metrics.traffic_totals()


def _consensus(gopt: GossipOptimizer) -> dict[str, float | str | bool]:
    """The last round's consensus-distance estimate, staleness bound, (exact-diloco) anchor
    checksum and (diloco) overlap for status.json (empty before one)."""
    stats = gopt.last_round
    if stats is None:
        return {}
    out: dict[str, float | str | bool] = {}
    if stats.max_staleness is not None:
        out["max_staleness"] = stats.max_staleness
    if math.isfinite(stats.consensus_distance):
        out["consensus_distance"] = float(stats.consensus_distance)
    if stats.anchor_checksum is not None:
        out["anchor_checksum"] = stats.anchor_checksum
    if stats.overlap is not None:
        out["overlap"] = stats.overlap
    return out


def _utilization(blocking: float, seconds: float) -> float | None:
    """The share of the training seconds not spent blocked in gossip."""
    return max(0.0, 1.0 - blocking / seconds) if seconds > 0 else None


def _fmt(ev: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in ev.items())
