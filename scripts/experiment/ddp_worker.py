"""One rank of a data-parallel baseline: ``python -m gossipgrad.experiment.ddp_worker``.

Trains the experiment's task with torch DDP over gloo on this rank's shard (the same shard,
seed, batch size, optimizer and step count as peer ``rank`` of the swarm), either with dense
all-reduce or with PyTorch's PowerSGD communication hook (Vogels et al., NeurIPS 2019,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization").

Bytes on the wire are counted honestly at the one place every gradient collective goes
through: ``torch.distributed.all_reduce`` (both DDP hooks call it), wrapped to add, per call,
the bytes a ring all-reduce moves per rank: 2 (n-1)/n x payload bytes sent and as many
received. Not counted: DDP's initial parameter broadcast (the swarm starts from the same seed
without one) and gloo's own framing.

Every ``eval_every`` steps each rank evaluates its model (DDP keeps the ranks' models
identical; evaluating on all of them keeps them in step) into ``evals``. Their ``seconds``, the
history's and ``wall_seconds`` are training time with evaluation time left out, the same clock
as the swarm's peers (``gossipgrad.peer.daemon.TrainClock``).

Rendezvous is race-free: rank 0 opens a TCPStore on port 0 and publishes the bound port in a
file; the other ranks read it and connect.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gossipgrad.peer.config import TrainSection
from gossipgrad.peer.schedule import make_scheduler
from gossipgrad.peer.tasks import build_task
from gossipgrad.peer.training import TrainClock, make_optimizer, task_context, write_json_atomic

log = logging.getLogger(__name__)

STATUS_EVERY_S = 0.5
RENDEZVOUS_TIMEOUT_S = 120.0


class WireCounter:
    """Counts ring all-reduce traffic per rank: 2 (n-1)/n x payload bytes each way."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.sent = 0.0
        self.calls = 0
        self.payload = 0

    def wrap(self, fn: Any) -> Any:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            self.payload += nbytes
            self.sent += 2 * (self.world - 1) / self.world * nbytes
            self.calls += 1
            return fn(tensor, *args, **kwargs)

        return counted


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


def train(args: argparse.Namespace) -> dict[str, Any]:
    cfg = TrainSection.model_validate(json.loads(Path(args.train_json).read_text()))
    torch.set_num_threads(1)
    out = Path(args.out)
    store = rendezvous(args.rank, args.world, args.host, out / "store.json")
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    counter = WireCounter(args.world)
    dist.all_reduce = counter.wrap(dist.all_reduce)  # both DDP hooks call it by this name
    task = build_task(cfg.task, task_context(cfg, args.rank, args.world))
    model = torch.nn.parallel.DistributedDataParallel(task.model, bucket_cap_mb=args.bucket_mb)
    if args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.psgd_rank,
            start_powerSGD_iter=args.psgd_start,
            random_seed=cfg.seed,
        )
        model.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = make_optimizer(model.parameters(), cfg)
    scheduler = make_scheduler(optimizer, cfg)
    params = sum(p.numel() for p in model.parameters())
    batches = task.batches()
    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    status_path = out / f"rank{args.rank}.status.json"
    clock = TrainClock()
    last = 0.0
    loss_value = math.nan
    for step in range(1, cfg.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_value = float(loss.detach())
        seconds = clock.seconds()
        history.append({"step": step, "loss": loss_value, "sent_bytes": counter.sent,
                        "seconds": seconds})  # fmt: skip
        # The last step's evaluation is ``final`` (at ``final_seconds``), as in the daemon.
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            with clock.paused():
                evals.append({"step": step, "seconds": seconds, **task.evaluate(model.module)})
        now = time.monotonic()
        if now - last > STATUS_EVERY_S or step == cfg.steps:
            last = now
            write_json_atomic(status_path, {"id": f"rank{args.rank}", "state": "training",
                                            "step": step, "steps": cfg.steps,
                                            "loss": loss_value,
                                            "sent_bytes": int(counter.sent)})  # fmt: skip
    wall = clock.seconds()
    dist.barrier()
    final = task.evaluate(model.module)
    dist.destroy_process_group()
    return {
        "id": f"rank{args.rank}",
        "baseline": args.hook,
        "steps": cfg.steps,
        "params": params,
        "final": final,
        "final_seconds": wall,
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "train_loss": loss_value,
        "wall_seconds": wall,
        "evals": evals,
        # Ring all-reduce is symmetric: each rank receives what it sends.
        "sent_bytes": int(counter.sent),
        "received_bytes": int(counter.sent),
        "allreduce_payload_bytes": counter.payload,
        "allreduce_calls": counter.calls,
        "dense_bytes": int(2 * (args.world - 1) / args.world * 4 * params * cfg.steps),
        "history": history,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="One rank of a DDP baseline (started by the runner).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--host", required=True, help="address of rank 0's store")
    p.add_argument("--out", required=True, help="directory shared by the ranks")
    p.add_argument("--train-json", required=True, help="the [train] section as JSON")
    p.add_argument("--hook", choices=["dense", "powersgd"], default="dense")
    p.add_argument("--psgd-rank", type=int, default=2)
    p.add_argument("--psgd-start", type=int, default=10)
    # PowerSGD over gloo needs the whole model in one bucket.
    p.add_argument("--bucket-mb", type=float, default=1024.0)
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
