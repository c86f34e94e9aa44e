"""Data-parallel baselines in the same run: DDP dense all-reduce and DDP + PowerSGD (gloo),
all-reduce DiLoCo with fp32 or int8 pseudo-gradients (gloo), and hivemind's collaborative
optimizer.

Each baseline starts ``n`` rank processes (``gossipgrad.experiment.ddp_worker``, or
``gossipgrad.experiment.hivemind_worker`` in the ``.venv-hivemind`` environment) where the
swarm's peers ran -- as plain processes on 127.0.0.1, inside the same shaped namespaces in
netns mode -- on the same task, seed, shards, batch size, optimizer and step count, and
collects what they measured into one summary per baseline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossipgrad.experiment.analysis import mean_of_all
from gossipgrad.experiment.diloco import OuterSettings
from gossipgrad.experiment.launch import reap
from gossipgrad.peer.config import TrainSection

log = logging.getLogger(__name__)

HOOKS = {"ddp": "dense", "powersgd": "powersgd"}
DILOCO = {"diloco": "fp32", "diloco-int8": "int8"}
"""DiLoCo baselines and the dtype their pseudo-gradients travel as."""
BASELINES = (*HOOKS, *DILOCO, "hivemind")
HIVEMIND_VENV = Path(__file__).resolve().parents[2] / ".venv-hivemind"
"""hivemind pins its own protobuf and p2p daemon, so it lives in a venv of its own."""


def hivemind_python() -> str:
    """The interpreter of the hivemind venv (``$GOSSIPGRAD_HIVEMIND_PYTHON`` overrides it).

    Raises:
        SpecError: when it is missing, naming the setup command.
    """
    from gossipgrad.experiment.spec import SpecError

    python = os.environ.get("GOSSIPGRAD_HIVEMIND_PYTHON") or str(HIVEMIND_VENV / "bin" / "python")
    if not os.access(python, os.X_OK):
        raise SpecError(
            f"baselines.run: 'hivemind' needs its own environment, and {python} does not "
            "exist; create it with: scripts/setup.sh --hivemind"
        )
    return python


def refusal(name: str, mode: str, relayed: bool) -> str | None:
    """Why baseline ``name`` cannot run over the swarm's links in this run (None: it can).

    A comparison over unequal links is refused, never printed: in netns mode a rank runs in
    its site's namespace and crosses the same shaped links as the peer (tc or TUN links), and
    in local mode without ``[network]`` both run on plain loopback. With relays (local mode,
    shaped ``[network]``) only the swarm's connections are relayed: gloo's ranks dial each
    other on ports they publish at run time, hivemind's p2p daemons on addresses from its
    DHT. In ssh mode the swarm crosses the inventory's real links and a rank would run on
    this host's loopback."""
    if mode == "ssh":
        return (
            "refused: the swarm runs across the inventory's hosts, this baseline would run "
            "on this host's loopback"
        )
    if mode == "local" and relayed:
        conns = "hivemind's p2p connections" if name == "hivemind" else "gloo's connections"
        return (
            f"refused: the swarm's links are relays, and {conns} (ports picked at run time) "
            "cannot go through them; compare in netns mode"
        )
    return None


@dataclass
class RankPlacement:
    """Where ranks run: argv prefix per rank, rank 0's address, and gloo's interface."""

    prefix: Callable[[int], list[str]] = field(default=lambda i: [])
    host: str = "127.0.0.1"
    ifname: str = "lo"
    python: str = sys.executable


def rank_command(
    name: str,
    rank: int,
    world: int,
    out: Path,
    place: RankPlacement,
    powersgd_rank: int = 2,
    powersgd_start: int = 10,
    diloco: OuterSettings | None = None,
) -> list[str]:
    """argv of one rank of baseline ``name`` (one of ``BASELINES``); ``diloco`` holds the
    outer loop of the DiLoCo kinds (its dtype is the kind's)."""
    if name == "hivemind":
        worker = "gossipgrad.experiment.hivemind_worker"
        cmd = [*place.prefix(rank), hivemind_python(), "-m", worker]
        cmd += ["--rank", str(rank), "--world", str(world), "--host", place.host]
        # Loopback in local mode; in netns mode each rank listens in its own namespace.
        listen = place.host if place.host.startswith("127.") else "0.0.0.0"
        cmd += ["--listen", listen, "--out", str(out), "--train-json", str(out / "train.json")]
        return cmd
    cmd = [*place.prefix(rank), place.python, "-m", "gossipgrad.experiment.ddp_worker"]
    cmd += ["--rank", str(rank), "--world", str(world), "--host", place.host]
    cmd += ["--out", str(out), "--train-json", str(out / "train.json")]
    if name in DILOCO:
        outer = diloco or OuterSettings()
        cmd += ["--algorithm", "diloco", "--pseudo-gradient-dtype", DILOCO[name]]
        cmd += ["--local-steps", str(outer.local_steps), "--outer-lr", repr(outer.outer_lr)]
        cmd += ["--outer-momentum", repr(outer.outer_momentum)]
        return cmd
    cmd += ["--hook", HOOKS[name]]
    if name == "powersgd":
        cmd += ["--psgd-rank", str(powersgd_rank), "--psgd-start", str(powersgd_start)]
    return cmd


class BaselineRun:
    """The rank processes of one baseline; ``start()``, poll ``statuses()``, ``collect()``."""

    def __init__(
        self,
        name: str,
        world: int,
        train: TrainSection,
        out: Path,
        place: RankPlacement,
        powersgd_rank: int = 2,
        powersgd_start: int = 10,
        diloco: OuterSettings | None = None,
    ) -> None:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; valid: {', '.join(BASELINES)}")
        self.name, self.world, self.train, self.out, self.place = name, world, train, out, place
        self.psgd = (powersgd_rank, powersgd_start)
        self.diloco = diloco or OuterSettings()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []
        self.t0 = 0.0

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for pattern in ("*.json", "*.ready", "*.trained"):  # the hivemind ranks' barriers too
            for stale in self.out.glob(pattern):
                stale.unlink()
        # Ranks train one process each like the peers: one thread, deterministic per seed.
        (self.out / "train.json").write_text(
            self.train.model_copy(update={"threads": 1}).model_dump_json()
        )
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": self.place.ifname,
        }
        self.t0 = time.monotonic()
        with open(self.out / "commands.sh", "w") as script:
            for r in range(self.world):
                cmd = rank_command(
                    self.name, r, self.world, self.out, self.place, *self.psgd, self.diloco
                )
                script.write(" ".join(cmd) + " &\n")
                log_file = open(self.out / f"rank{r}.log", "w")  # noqa: SIM115 - closed in stop()
                self.logs.append(log_file)
                self.procs.append(
                    subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
                )

    def _finished(self, r: int) -> bool:
        return (self.out / f"rank{r}.json").exists()

    def running(self) -> bool:
        """False once every rank wrote its result (or exited): the phase is over even if a
        rank is still tearing down its process group."""
        return any(p.poll() is None and not self._finished(r) for r, p in enumerate(self.procs))

    def failed(self) -> list[int]:
        """Ranks that exited without writing their result."""
        return [
            r
            for r, p in enumerate(self.procs)
            if not self._finished(r) and p.poll() not in (None, 0)
        ]

    def statuses(self) -> list[dict[str, Any]]:
        out = []
        for r in range(self.world):
            try:
                out.append(json.loads((self.out / f"rank{r}.status.json").read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                out.append({"id": f"rank{r}", "state": "starting"})
        return out

    def stop(self, timeout: float = 10.0, teardown: float = 90.0) -> None:
        """SIGTERM, then SIGKILL, every rank still running; close the logs.

        A rank that wrote its result first gets ``teardown`` seconds to exit on its own: it
        may be ending processes of its own (a hivemind rank's DHT and averagers: a SIGTERM is
        ignored then, and the rank's own deadlines, 73 s, bound it), and a rank killed
        meanwhile would leave them to whoever adopts orphans."""
        deadline = time.monotonic() + teardown
        for r, p in enumerate(self.procs):
            if self._finished(r):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        reap(self.procs, timeout)
        for f in self.logs:
            f.close()
        self.logs.clear()

    def collect(self) -> dict[str, Any]:
        """Per-rank results and the baseline's headline figures (the first finished rank's
        evaluations, ``final`` and periodic ``evals``: DDP keeps every rank's model
        identical, DiLoCo's ranks evaluate the same anchor)."""
        ranks = []
        for r in range(self.world):
            try:
                ranks.append(json.loads((self.out / f"rank{r}.json").read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                ranks.append(None)
        done = [x for x in ranks if x]
        result: dict[str, Any] = {
            "name": self.name,
            "ok": len(done) == self.world and not self.failed(),
            "ranks": ranks,
            "elapsed_seconds": time.monotonic() - self.t0,
        }
        if self.name == "powersgd":
            result["powersgd_rank"], result["powersgd_start_iter"] = self.psgd
        if self.name in DILOCO:
            d = self.diloco
            result.update(local_steps=d.local_steps, outer_lr=d.outer_lr,
                          outer_momentum=d.outer_momentum,
                          pseudo_gradient_dtype=DILOCO[self.name])  # fmt: skip
            if done:
                result["outer_steps"] = done[0].get("outer_steps")
        if self.name == "hivemind" and done:
            # hivemind's epochs are global steps; these say what they cost each rank.
            for key in ("local_batches", "samples", "grad_averaging_rounds"):
                result[key] = [x.get(key) for x in done]
            result["bytes_counted"] = done[0].get("bytes_counted")
        if done:
            first = done[0]
            result.update(
                final=first["final"],
                final_seconds=first.get("final_seconds"),
                evals=first.get("evals", []),
                metric=first["metric"],
                higher_is_better=first.get("higher_is_better"),
                steps=first["steps"],
                params=first["params"],
                wall_seconds=max(x["wall_seconds"] for x in done),
                mean_sent_bytes=_mean([x["sent_bytes"] for x in done]),
                mean_received_bytes=_mean([x["received_bytes"] for x in done]),
                dense_bytes_per_rank=first["dense_bytes"],
                compute_utilization=mean_of_all([x.get("compute_utilization") for x in done]),
            )
            wire = [x.get("wire_sent_bytes") for x in done]
            if self.name != "hivemind":  # hivemind's own counts are its sent_bytes
                result["mean_wire_sent_bytes"] = None if None in wire else _mean(wire)
        if not result["ok"]:
            log.error("baseline %s failed; see %s", self.name, self.out / "rank0.log")
        return result


def _mean(values: list[float | None]) -> float:
    """Mean over the ranks; NaN when a rank could not count its bytes (hivemind without
    ``ss``): unknown, not zero."""
    if any(v is None for v in values):
        return float("nan")
    return sum(values) / len(values)  # type: ignore[arg-type]
