"""One rank of a data-parallel baseline: ``python -m gossipgrad.experiment.ddp_worker``.

Trains the experiment's task over gloo on this rank's shard (the same shard, seed, batch size,
optimizer, schedule and step count as peer ``rank`` of the swarm), in one of three ways:

- ``--algorithm ddp --hook dense``: torch DDP, dense gradient all-reduce every step;
- ``--algorithm ddp --hook powersgd``: DDP with PyTorch's PowerSGD communication hook (Vogels
  et al., NeurIPS 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization");
- ``--algorithm diloco``: all-reduce DiLoCo (``gossipgrad.experiment.diloco``): H local steps,
  then an outer Nesterov step on the averaged pseudo-gradient, sent as fp32 or int8.

Bytes are counted at the one place every collective goes through: ``torch.distributed``'s
``all_reduce`` (both DDP hooks and fp32 DiLoCo), ``all_to_all_single`` and ``all_gather``
(int8 DiLoCo), wrapped to add, per call, what that collective moves per rank for the tensor it
is handed (``COLLECTIVES``; ring all-reduce: 2 (n-1)/n x payload bytes sent and as many
received). Not counted: DDP's initial parameter broadcast (the swarm starts from the same seed
without one) and gloo's own framing. As a check on that model, each rank also reports what the
kernel counted on its gloo TCP connections over the training loop (``wire_sent_bytes``, from
``ss``; ``gossipgrad.experiment.socket_bytes``).

Every ``eval_every`` steps each rank evaluates the global model (DDP keeps the ranks' models
identical; DiLoCo's is the anchor; evaluating on all ranks keeps them in step) into ``evals``.
Their ``seconds``, the history's and ``wall_seconds`` are training time with evaluation time
left out, the same clock as the swarm's peers (``gossipgrad.peer.tasks.training.TrainClock``).
At the end each rank saves its parameters as ``rank<r>.params.pt``.

Rendezvous is race-free: rank 0 opens a TCPStore on port 0 and publishes the bound port in a
file; the other ranks read it and connect.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gossipgrad.experiment.diloco import PSEUDO_GRADIENT_DTYPES, OuterOptimizer, OuterSettings
from gossipgrad.experiment.socket_bytes import ConnectionBytes
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.tasks import build_task
from gossipgrad.peer.tasks.schedule import make_scheduler
from gossipgrad.peer.tasks.training import (
    LocalStep,
    TrainClock,
    make_optimizer,
    task_context,
    write_json_atomic,
)

log = logging.getLogger(__name__)

STATUS_EVERY_S = 0.5
RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Collective:
    """How one counted collective's per-rank traffic follows from the tensor it is handed."""

    arg: int
    """Position of the payload tensor among the call's arguments."""
    keyword: str
    """Its keyword name."""
    factor: Callable[[int], float]
    """Bytes each rank sends (and receives) per payload byte, for n ranks."""


# Ring all-reduce sends (and receives) 2 (n-1)/n x its tensor; all_to_all_single with equal
# splits keeps 1/n of its input and sends the rest; all_gather sends the rank's own tensor to
# the n-1 others (a ring forwards n-1 such tensors: the same bytes).
COLLECTIVES = {
    "all_reduce": Collective(0, "tensor", lambda n: 2 * (n - 1) / n),
    "all_to_all_single": Collective(1, "input", lambda n: (n - 1) / n),
    "all_gather": Collective(1, "tensor", lambda n: float(n - 1)),
}


class WireCounter:
    """Counts a rank's collective traffic from the tensors actually handed to
    ``torch.distributed`` (their nbytes, so an int8 tensor counts one byte a value):
    sent = received = factor x payload (``COLLECTIVES``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.sent = 0.0
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.payload = dict.fromkeys(COLLECTIVES, 0)

    def wrap(self, name: str, fn: Any) -> Any:
        """``fn``, the collective ``name``, counting each call."""
        how = COLLECTIVES[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[how.arg] if len(args) > how.arg else kwargs[how.keyword]
            nbytes = tensor.numel() * tensor.element_size()
            self.payload[name] += nbytes
            self.calls[name] += 1
            self.sent += how.factor(self.world) * nbytes
            return fn(*args, **kwargs)

        return counted

    def install(self) -> None:
        """Wrap the collectives in ``torch.distributed``, where both DDP hooks and
        ``gossipgrad.experiment.diloco`` look them up at call time."""
        for name in COLLECTIVES:
            setattr(dist, name, self.wrap(name, getattr(dist, name)))

    def summary(self) -> dict[str, dict[str, int]]:
        """Calls and payload bytes per collective."""
        return {n: {"calls": self.calls[n], "payload_bytes": self.payload[n]} for n in COLLECTIVES}


class WaitTimer:
    """Seconds the training thread spent waiting on communication, for the rank's compute
    utilization (1 - these / training seconds, as the swarm's peers count theirs)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """DDP comm ``hook``, waited for where it is called (at the end of backward, the
        model being one bucket: ``--bucket-mb``), so the wait is timed; DDP would wait for
        its future at the same point."""

        # Unannotated: DDP refuses a hook whose annotations are not GradBucket and Future,
        # and under ``from __future__ import annotations`` they would be strings.
        def timed(state, bucket):
            with self.waiting():
                fut = hook(state, bucket)
                fut.wait()
            return fut

        return timed


def utilization(waiting: float, seconds: float) -> float | None:
    """The share of ``seconds`` of training not spent waiting on communication."""
    return max(0.0, 1.0 - waiting / seconds) if seconds > 0 else None


def rendezvous(rank: int, world: int, host: str, port_file: Path) -> dist.Store:
    """Rank 0 binds a TCPStore on port 0 and writes the port to ``port_file``; others wait
    for the file and connect."""
    timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)  # fmt: skip
        write_json_atomic(port_file, {"host": host, "port": store.port})
        return store
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its store port in {port_file}")
        time.sleep(0.05)
    port = json.loads(port_file.read_text())["port"]
    return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)


def ddp_model(
    module: torch.nn.Module, args: argparse.Namespace, seed: int, waits: WaitTimer
) -> torch.nn.Module:
    """``module`` under DDP with the dense all-reduce or the PowerSGD hook (timed by
    ``waits``)."""
    model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=args.bucket_mb)
    if args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.psgd_rank,
            start_powerSGD_iter=args.psgd_start,
            random_seed=seed,
        )
        model.register_comm_hook(state, waits.hook(psgd.powerSGD_hook))
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, waits.hook(default_hooks.allreduce_hook))
    return model


def outer_settings(args: argparse.Namespace) -> OuterSettings:
    return OuterSettings(
        local_steps=args.local_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        pseudo_gradient_dtype=args.pseudo_gradient_dtype,
    )


def baseline_name(args: argparse.Namespace) -> str:
    """The baseline this rank belongs to, as the runner names it."""
    if args.algorithm == "diloco":
        return "diloco" if args.pseudo_gradient_dtype == "fp32" else "diloco-int8"
    return "ddp" if args.hook == "dense" else "powersgd"


@dataclass
class RankRun:
    """One rank's training state once the process group is up."""

    args: argparse.Namespace
    cfg: TrainSection
    out: Path
    store: dist.Store
    counter: WireCounter
    task: Any
    model: torch.nn.Module
    """What steps: the DDP wrapper, or (DiLoCo) the module itself."""
    module: torch.nn.Module
    """The task's model, the one evaluated and saved."""
    outer: OuterOptimizer | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    waits: WaitTimer


@dataclass
class LoopResult:
    """What the training loop measured."""

    history: list[dict[str, float]]
    evals: list[dict[str, float]]
    loss: float
    wall_seconds: float


def setup_rank(args: argparse.Namespace) -> RankRun:
    """Join the gloo group, count its collectives, and build task, model and optimizers."""
    cfg = TrainSection.model_validate(json.loads(Path(args.train_json).read_text()))
    torch.set_num_threads(1)
    out = Path(args.out)
    store = rendezvous(args.rank, args.world, args.host, out / "store.json")
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    counter = WireCounter(args.world)
    counter.install()
    task = build_task(cfg.task, task_context(cfg, args.rank, args.world))
    outer: OuterOptimizer | None = None
    waits = WaitTimer()
    if args.algorithm == "diloco":
        # No broadcast: every rank builds the same seeded model, as the swarm's peers do.
        model = module = task.model
        outer = OuterOptimizer(list(module.parameters()), outer_settings(args), args.world)
    else:
        model = ddp_model(task.model, args, cfg.seed, waits)
        module = model.module
    optimizer = make_optimizer(model.parameters(), cfg)
    scheduler = make_scheduler(optimizer, cfg)
    return RankRun(args, cfg, out, store, counter, task, model, module, outer, optimizer,
                   scheduler, waits)  # fmt: skip


def train_loop(run: RankRun) -> LoopResult:
    """``cfg.steps`` steps (with DiLoCo's outer syncs), evaluations every ``eval_every``
    steps off the clock, and the rank's status file every ``STATUS_EVERY_S``."""
    cfg, counter = run.cfg, run.counter
    batches = run.task.batches()
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    status_path = run.out / f"rank{run.args.rank}.status.json"
    clock = TrainClock()
    last = 0.0
    loss_value = math.nan
    local = LocalStep(cfg, torch.device("cpu"))  # the peers' precision and clipping
    step = 0
    while step < cfg.steps:
        run.optimizer.zero_grad(set_to_none=True)
        loss, ok = local.backward(run.task, run.model, next(batches), run.optimizer)
        if ok:  # every rank sees the same all-reduced gradients, so all skip alike
            run.optimizer.step()
            run.scheduler.step()
        local.done()
        if not ok:
            continue
        step += 1
        if run.outer is not None and run.outer.phase_ends(step, cfg.steps):
            with run.waits.waiting():
                run.outer.sync()
        loss_value = float(loss.detach())
        seconds = clock.seconds()
        history.append({"step": step, "loss": loss_value, "sent_bytes": counter.sent,
                        "seconds": seconds})  # fmt: skip
        # The last step's evaluation is ``final`` (at ``final_seconds``), as in the daemon.
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            with clock.paused():
                scores = evaluate(run.task, run.module, run.outer)
            evals.append({"step": step, "seconds": seconds, **scores})
        now = time.monotonic()
        if now - last > STATUS_EVERY_S or step == cfg.steps:
            last = now
            write_json_atomic(status_path, {"id": f"rank{run.args.rank}", "state": "training",
                                            "step": step, "steps": cfg.steps,
                                            "loss": loss_value,
                                            "sent_bytes": int(counter.sent)})  # fmt: skip
    return LoopResult(history, evals, loss_value, clock.seconds())


def rank_result(
    run: RankRun, loop: LoopResult, final: dict[str, float], wire: tuple[int | None, int | None]
) -> dict[str, Any]:
    """The rank's ``rank<r>.json``: final metrics, bytes by each count, history."""
    args, cfg, counter = run.args, run.cfg, run.counter
    params = sum(p.numel() for p in run.model.parameters())
    result = {
        "id": f"rank{args.rank}",
        "baseline": baseline_name(args),
        "steps": cfg.steps,
        "params": params,
        "final": final,
        "final_seconds": loop.wall_seconds,
        "metric": run.task.metric,
        "higher_is_better": run.task.higher_is_better,
        "train_loss": loop.loss,
        "wall_seconds": loop.wall_seconds,
        "communication_seconds": run.waits.seconds,
        "compute_utilization": utilization(run.waits.seconds, loop.wall_seconds),
        "evals": loop.evals,
        # Every counted collective is symmetric: each rank receives what it sends.
        "sent_bytes": int(counter.sent),
        "received_bytes": int(counter.sent),
        "allreduce_payload_bytes": counter.payload["all_reduce"],
        "allreduce_calls": counter.calls["all_reduce"],
        "collectives": counter.summary(),
        # The kernel's count on the rank's gloo connections (None without ``ss``).
        "wire_sent_bytes": wire[0],
        "wire_received_bytes": wire[1],
        "dense_bytes": int(2 * (args.world - 1) / args.world * 4 * params * cfg.steps),
        "history": loop.history,
    }
    if run.outer is not None:
        result.update(
            local_steps=args.local_steps,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            pseudo_gradient_dtype=args.pseudo_gradient_dtype,
            outer_steps=run.outer.outer_steps,
        )
    return result


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train this rank, save its parameters and return its result."""
    run = setup_rank(args)
    # After DDP's initial broadcast (not counted by WireCounter either).
    wire = ConnectionBytes(exclude_port=run.store.port)
    wire.start()
    loop = train_loop(run)
    dist.barrier()
    wire_totals = wire.totals()
    final = run.task.evaluate(run.module)
    torch.save(run.module.state_dict(), run.out / f"rank{args.rank}.params.pt")
    dist.destroy_process_group()
    return rank_result(run, loop, final, wire_totals)


def evaluate(task: Any, module: torch.nn.Module, outer: OuterOptimizer | None) -> dict[str, float]:
    """The task's evaluation of the global model: DDP's (every rank's), or DiLoCo's anchor (a
    rank's own model mid-phase is not what the ranks agreed on)."""
    if outer is None:
        return task.evaluate(module)
    with outer.anchor_loaded():
        return task.evaluate(module)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="One rank of a DDP, PowerSGD or DiLoCo baseline (started by the runner)."
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--host", required=True, help="address of rank 0's store")
    p.add_argument("--out", required=True, help="directory shared by the ranks")
    p.add_argument("--train-json", required=True, help="the [train] section as JSON")
    p.add_argument("--algorithm", choices=["ddp", "diloco"], default="ddp",
                   help="ddp: gradient all-reduce every step (--hook); diloco: all-reduce "
                   "DiLoCo")  # fmt: skip
    p.add_argument("--hook", choices=["dense", "powersgd"], default="dense")
    p.add_argument("--psgd-rank", type=int, default=2)
    p.add_argument("--psgd-start", type=int, default=10)
    # PowerSGD over gloo needs the whole model in one bucket.
    p.add_argument("--bucket-mb", type=float, default=1024.0)
    p.add_argument("--local-steps", type=int, default=1, help="diloco: inner steps H")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer SGD lr")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="diloco: outer Nesterov momentum (0: plain SGD)")  # fmt: skip
    p.add_argument("--pseudo-gradient-dtype", choices=PSEUDO_GRADIENT_DTYPES, default="fp32",
                   help="diloco: what pseudo-gradients travel as")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = train(args)
    write_json_atomic(Path(args.out) / f"rank{args.rank}.json", result)
    log.info("rank %d done: %s", args.rank, result["final"])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
