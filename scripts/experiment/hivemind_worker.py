"""One rank of the hivemind baseline: ``python -m gossipgrad.experiment.hivemind_worker``.

Runs in its own virtual environment (``.venv-hivemind``, ``scripts/setup.sh --hivemind``):
the hivemind library (Ryabinin et al., "Moshpit SGD", NeurIPS 2021; learning-at-home/hivemind)
pins its own protobuf and p2p daemon. Trains the experiment's task on this rank's shard (the
same shard, seed, batch size, optimizer, schedule and step count as peer ``rank`` of the swarm
and as the DDP ranks) under ``hivemind.Optimizer`` in its plain synchronous mode: gradients are
accumulated towards a global ``target_batch_size`` of world x batch size, then averaged by an
all-reduce among the peers (``use_local_updates=False``) before the wrapped optimizer steps, so
one hivemind epoch plays the part of one DDP step: ranks train until ``steps`` epochs, and the
learning-rate schedule follows the epoch. hivemind decides when an epoch is complete from the
progress its peers publish in its DHT, so on a fast link a rank may contribute more than one
batch to an epoch: ``local_batches`` and ``samples`` say what the run really used (more than
DDP's budget), ``grad_averaging_rounds`` how many epochs averaged with other ranks. hivemind's
defaults otherwise: no gradient compression, parameters and optimizer state averaged every
epoch in the background.

Bytes: hivemind counts none. Each rank's hivemind traffic leaves through one p2p daemon
(``p2pd``, a child process of the DHT); its TCP sockets' kernel counters (``ss -ti``:
``bytes_acked`` sent, ``bytes_received``) are sampled every ``SAMPLE_EVERY_S`` and at the end,
keeping each connection's largest reading. That is everything hivemind put on the wire above
TCP (gradients, state averaging, DHT and progress metadata, libp2p's encryption and framing);
a connection closed between two samples loses what it carried since the last one. Without
``ss`` the bytes are ``None`` (unknown). In netns mode the runner counts link bytes as well.

Rendezvous: rank 0 starts its DHT on ``--host`` port 0 and publishes its visible multiaddrs in
``dht.json`` in ``--out``; the others bootstrap from them. File barriers before the first and
after the last step keep every rank in the swarm while any rank trains. Each rank leads a
process group that hivemind's processes join, and ends it when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import logging
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hivemind
import torch
from gossipgrad.experiment.ddp_worker import WaitTimer, utilization
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.tasks import build_task
from gossipgrad.peer.tasks.schedule import lr_factor
from gossipgrad.peer.tasks.training import (
    TrainClock,
    make_optimizer,
    task_context,
    write_json_atomic,
)
from hivemind.optim.grad_averager import GradientAverager

log = logging.getLogger(__name__)

STATUS_EVERY_S = 0.5
SAMPLE_EVERY_S = 1.0
RENDEZVOUS_TIMEOUT_S = 120.0
RUN_ID = "gossipgrad-baseline"
# The DHT and optimizer stay referenced after train() returns: their __del__ would run
# hivemind's slow shutdown before the result is written (end_children() ends them instead).
_KEEP_ALIVE: list[Any] = []


def descendants(root: int, comm: str | None = None) -> list[int]:
    """Pids of the processes below ``root`` (with command name ``comm``, if given), from
    /proc."""
    parent: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split at the last ')'.
        head, _, rest = stat.rpartition(")")
        pid = int(entry.name)
        names[pid] = head.split("(", 1)[1]
        parent[pid] = int(rest.split()[1])
    out = []
    for pid, name in names.items():
        p = pid
        while p in parent and p not in (0, 1, root):
            p = parent[p]
        if p == root and pid != root and comm in (None, name):
            out.append(pid)
    return out


_SOCKET = re.compile(r"^\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)\s+users:.*pid=(\d+),")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


class SocketCounter:
    """Bytes on the p2p daemon's TCP connections, from the kernel's per-socket counters."""

    def __init__(self) -> None:
        self.available = subprocess.run(["ss", "-V"], capture_output=True).returncode == 0
        self.pids: set[int] = set()
        self.conns: dict[tuple[str, str], tuple[int, int]] = {}
        self.lock = threading.Lock()

    def sample(self) -> None:
        """Read ``ss -tinpH`` once; keep each p2pd connection's largest counters."""
        if not self.available:
            return
        if not self.pids:
            self.pids = set(descendants(os.getpid(), "p2pd"))
        text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
        current: tuple[str, str] | None = None
        with self.lock:
            for line in text.splitlines():
                m = _SOCKET.match(line)
                if m:
                    current = (m[1], m[2]) if int(m[3]) in self.pids else None
                    continue
                if current is None or not line[:1].isspace():
                    current = None
                    continue
                got = dict(_COUNTER.findall(line))
                sent, recv = int(got.get("bytes_acked", 0)), int(got.get("bytes_received", 0))
                old = self.conns.get(current, (0, 0))
                self.conns[current] = (max(old[0], sent), max(old[1], recv))
                current = None

    def totals(self) -> tuple[int | None, int | None]:
        """(sent, received) so far; (None, None) when the counters cannot be read."""
        if not self.available:
            return None, None
        with self.lock:
            return sum(s for s, _ in self.conns.values()), sum(r for _, r in self.conns.values())


class RoundCounter(logging.Handler):
    """Counts hivemind's "Averaged gradients with N peers" records (its verbose log)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.grad_rounds = 0
        self.state_rounds = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Averaged gradients with"):
            self.grad_rounds += 1
        elif msg.startswith("Averaged parameters with"):
            self.state_rounds += 1


def group_members(zombies: bool = False) -> list[int]:
    """Pids of the other processes in this rank's process group (from /proc), not counting
    zombies unless ``zombies``."""
    me, group = os.getpid(), os.getpgrp()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        # Fields after the command name: state, ppid, pgrp, ...
        if int(fields[2]) == group and (zombies or fields[0] != "Z"):
            out.append(int(entry.name))
    return out


PR_SET_CHILD_SUBREAPER = 36
#: Seconds a rank's teardown waits for the last of its group to be reapable (see end_children).
ZOMBIE_WAIT_S = 10.0


def adopt_orphans() -> None:
    """Make this rank the subreaper of its descendants (Linux): a p2p daemon whose DHT process
    dies first is reparented to the rank, which reaps it, instead of to init, which may leave
    it a zombie for as long as it likes (a container's init may never reap it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap() -> None:
    """Collect every child that has ended (and, as subreaper, every adopted orphan)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def end_children(grace: float = 3.0, kill_wait: float = 60.0) -> None:
    """SIGTERM, then SIGKILL, the rest of this rank's process group: hivemind's DHT and
    averager processes and their p2p daemons, which would outlive the rank otherwise; then
    reap them, so none is left even as a zombie. By group, not by parent, so that a daemon
    whose parent died first is not missed. ``grace`` bounds the wait after SIGTERM;
    ``kill_wait`` the one after SIGKILL, which no process can refuse but a loaded host can
    take seconds to carry out (a rank that exits first leaves the dying to the orphan reaper)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        for pid in group_members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while group_members() and time.monotonic() < deadline:
            reap()
            time.sleep(0.05)
        if not group_members():
            break
    # Then until every one is reaped: a process whose main thread has ended shows as a zombie
    # while its other threads are still ending, and only then can it be reaped (one left to
    # end after the rank had exited was adopted, a zombie, by whoever adopts orphans).
    deadline = time.monotonic() + ZOMBIE_WAIT_S
    while group_members(zombies=True) and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)


def wait_for(paths: list[Path], what: str, timeout: float = RENDEZVOUS_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_dht(rank: int, host: str, listen: str, out: Path) -> hivemind.DHT:
    """Rank 0 starts the DHT and publishes its multiaddrs; the others bootstrap from them."""
    maddrs = [f"/ip4/{host if rank == 0 else listen}/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=maddrs, start=True)
        visible = [str(a) for a in dht.get_visible_maddrs()]
        write_json_atomic(out / "dht.json", {"maddrs": visible})
        return dht
    wait_for([out / "dht.json"], "rank 0's DHT address")
    peers = json.loads((out / "dht.json").read_text())["maddrs"]
    return hivemind.DHT(host_maddrs=maddrs, initial_peers=peers, start=True)


def make_hivemind_optimizer(
    dht: hivemind.DHT, model: torch.nn.Module, cfg: TrainSection, args: argparse.Namespace
) -> hivemind.Optimizer:
    """hivemind's Optimizer around the task's optimizer: one global step per
    ``world x batch_size`` samples, gradients averaged (no local updates)."""
    mm = args.matchmaking_time
    # Loopback-sized: a group is complete once every rank joined, and a join request waits for
    # the leader's answer less than the matchmaking window (hivemind: a longer wait can
    # deadlock matchmaking). hivemind.Optimizer forwards ``averager_opts`` to its state
    # averager only; the gradient averager takes them through its factory.
    matchmaking = {"target_group_size": args.world, "request_timeout": mm / 2}
    return hivemind.Optimizer(
        dht=dht,
        run_id=RUN_ID,
        target_batch_size=args.world * cfg.batch_size,
        batch_size_per_step=cfg.batch_size,
        optimizer=make_optimizer(model.parameters(), cfg),
        use_local_updates=False,
        matchmaking_time=mm,
        averaging_timeout=args.averaging_timeout,
        verbose=True,
        averager_opts=matchmaking,
        grad_averager_factory=functools.partial(GradientAverager, **matchmaking),
        # Progress is re-read often enough to follow steps of a few milliseconds.
        tracker_opts={"min_refresh_period": 0.05, "max_refresh_period": 0.5,
                      "default_refresh_period": 0.1},
    )  # fmt: skip


@contextlib.contextmanager
def sampling(wire: SocketCounter) -> Iterator[None]:
    """Sample ``wire`` every ``SAMPLE_EVERY_S`` in a thread while the block runs."""
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(SAMPLE_EVERY_S):
            wire.sample()

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def train_loop(
    opt: hivemind.Optimizer, task: Any, cfg: TrainSection, wire: SocketCounter, rank: int,
    out: Path,
) -> dict[str, Any]:  # fmt: skip
    """Local batches until hivemind's epoch reaches ``cfg.steps``; evaluations off the clock
    each time an epoch passes a multiple of ``eval_every``; the status file every
    ``STATUS_EVERY_S``. Returns history, evals, last loss, batches, training seconds and those
    spent in ``opt.step()``."""
    model, batches = task.model, task.batches()
    history: list[dict[str, Any]] = []
    evals: list[dict[str, float]] = []
    status_path = out / f"rank{rank}.status.json"
    clock = TrainClock()
    last = 0.0
    loss_value = math.nan
    batch = 0
    waits = WaitTimer()  # opt.step(): matchmaking, averaging, then the (small) update
    while (epoch := opt.local_epoch) < cfg.steps:
        # The schedule follows hivemind's epochs (global optimizer steps), as DDP's its steps.
        for group in opt.opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(epoch, cfg)
        opt.zero_grad()
        loss = task.loss(model, next(batches))
        loss.backward()
        with waits.waiting():
            opt.step()
        batch += 1
        loss_value = float(loss.detach())
        seconds = clock.seconds()
        sent, _ = wire.totals()
        history.append({"step": opt.local_epoch, "batch": batch, "loss": loss_value,
                        "sent_bytes": sent, "seconds": seconds})  # fmt: skip
        done = opt.local_epoch
        if cfg.eval_every and done // cfg.eval_every > epoch // cfg.eval_every and done < cfg.steps:
            with clock.paused():
                evals.append({"step": done, "seconds": seconds, **task.evaluate(model)})
        now = time.monotonic()
        if now - last > STATUS_EVERY_S:
            last = now
            status = {"id": f"rank{rank}", "state": "training", "step": done,
                      "steps": cfg.steps, "loss": loss_value, "sent_bytes": sent or 0}  # fmt: skip
            write_json_atomic(status_path, status)
    return {"history": history, "evals": evals, "loss": loss_value, "batches": batch,
            "wall": clock.seconds(), "waiting": waits.seconds}  # fmt: skip


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train this rank; returns its result (hivemind's processes still running)."""
    cfg = TrainSection.model_validate(json.loads(Path(args.train_json).read_text()))
    torch.set_num_threads(1)
    out = Path(args.out)
    rounds = RoundCounter()
    logging.getLogger("hivemind").addHandler(rounds)
    dht = start_dht(args.rank, args.host, args.listen or args.host, out)
    task = build_task(cfg.task, task_context(cfg, args.rank, args.world))
    opt = make_hivemind_optimizer(dht, task.model, cfg, args)
    _KEEP_ALIVE.extend((dht, opt))
    wire = SocketCounter()
    write_json_atomic(out / f"rank{args.rank}.ready", {})
    wait_for([out / f"rank{r}.ready" for r in range(args.world)], "every rank's optimizer")
    with sampling(wire):
        loop = train_loop(opt, task, cfg, wire, args.rank, out)
        write_json_atomic(out / f"rank{args.rank}.trained", {})
        wait_for([out / f"rank{r}.trained" for r in range(args.world)], "every rank to finish")
    wire.sample()
    return rank_result(args, cfg, task, opt, wire, rounds, loop)


def rank_result(
    args: argparse.Namespace, cfg: TrainSection, task: Any, opt: hivemind.Optimizer,
    wire: SocketCounter, rounds: RoundCounter, loop: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The rank's ``rank<r>.json``: final metrics, p2p bytes, averaging rounds, history."""
    sent, received = wire.totals()
    params = sum(p.numel() for p in task.model.parameters())
    batch = loop["batches"]
    return {
        "id": f"rank{args.rank}",
        "baseline": "hivemind",
        "steps": opt.local_epoch,
        "params": params,
        "final": task.evaluate(task.model),
        "final_seconds": loop["wall"],
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "train_loss": loop["loss"],
        "wall_seconds": loop["wall"],
        "communication_seconds": loop["waiting"],
        "compute_utilization": utilization(loop["waiting"], loop["wall"]),
        "evals": loop["evals"],
        "sent_bytes": sent,
        "received_bytes": received,
        "bytes_counted": "p2pd TCP payload (ss bytes_acked/bytes_received)"
        if wire.available
        else None,
        "p2p_connections": len(wire.conns),
        "local_batches": batch,
        "samples": batch * cfg.batch_size,
        "grad_averaging_rounds": rounds.grad_rounds,
        "state_averaging_rounds": rounds.state_rounds,
        "target_batch_size": args.world * cfg.batch_size,
        "dense_bytes": int(2 * (args.world - 1) / args.world * 4 * params * cfg.steps),
        "history": loop["history"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="One rank of the hivemind baseline (runner-started).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--host", required=True, help="address of rank 0's DHT")
    p.add_argument("--listen", default=None, help="this rank's listen address (default: --host)")
    p.add_argument("--out", required=True, help="directory shared by the ranks")
    p.add_argument("--train-json", required=True, help="the [train] section as JSON")
    p.add_argument("--matchmaking-time", type=float, default=0.5,
                   help="seconds to assemble an averaging group")  # fmt: skip
    p.add_argument("--averaging-timeout", type=float, default=10.0)
    return p


def main(argv: list[str] | None = None) -> None:
    """Run one rank. It leads a process group of its own, which hivemind's processes join;
    the group ends with the rank, on SIGTERM from the runner as well as after training."""
    args = build_parser().parse_args(argv)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    rank_pid = os.getpid()
    adopt_orphans()

    def terminated(signum: int, frame: Any) -> None:
        if os.getpid() == rank_pid:  # forked hivemind processes inherit this handler
            end_children()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log.info("rank %d: pid %d, process group %d", args.rank, rank_pid, os.getpgrp())
    result = train(args)
    # The result first: the runner counts a rank done once it exists, whatever the teardown.
    write_json_atomic(Path(args.out) / f"rank{args.rank}.json", result)
    log.info("rank %d done: %s", args.rank, result["final"])
    # Every rank is past the last step, so nobody needs this one's share of the swarm any
    # more: end hivemind's processes outright rather than through its own shutdown, which
    # can take seconds and race its background threads. A SIGTERM from the runner meanwhile
    # must not cut this short (the rank killed half-way would leave its processes to whoever
    # adopts orphans): the teardown is bounded by end_children's own deadlines.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started = time.monotonic()
    end_children()
    log.info("rank %d ended its processes in %.1f s", args.rank, time.monotonic() - started)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
