"""What gossip costs at the model sizes people train: memory, a round's CPU, the training
thread's stall, start and state, per model size and algorithm.

Each peer is its own process (``--peers``, a ring over 127.0.0.1) training a stack of square
linear layers of the size asked for, with the user's optimizer (SGD) and gradients in place.
A step's compute is an emulated accelerator: ``--accelerator-ms`` of waiting with the CPU free,
as a site's host waits on its GPU, then the optimizer step; the gradients are set once and
left, so the host's CPU does only what a site's host does. Every figure is a ratio against a
baseline measured in the same process and run:

* state/model: the gossip state (resident memory after the rounds, less the same process's
  memory with the model, its gradients and its optimizer before gossip started), in model
  bytes; peak/model the same at the high-water mark (start-up and rounds' transients).
* round CPU/copy: the process's CPU time per round (every thread: encode, pushes, the
  server's decode, mixing, checksums, heartbeats) less that of the same steps without gossip
  (the mean of a run of them before the rounds and one after, every peer at once both
  times: the host's drift between the two does not count as gossip's), over the time of one
  ``copy_`` of the model (the median of one timed after each of those
  steps: the contention for cores and memory bandwidth the rounds met).
* stall/phase: the training thread's time blocked in gossip per round, over a phase's compute
  (``local_steps`` x ``--accelerator-ms``); utilization: the wall time of the same steps
  without gossip (that mean) over their wall time with it (1: gossip costs the training
  nothing).
* start: building and starting the GossipOptimizer; state: ``state_dict()`` and saving it to
  memory with ``torch.save``, over a ``torch.save`` of the same state alone; checkpoint: the
  daemon's atomic save of the state to disk (temporary file, fsync, rename), written from
  the live tensors held still (``checkpoint_state``), over the same ``torch.save`` to
  memory, and the resident memory its peak added, in model bytes (the peers take these one
  at a time, after the rounds).

Then, per size, a state download and the dense resync after it (``--join``, choco, AdamW: a
state of 3 models): a donor past the rounds whose edges open from the shared initial model
serves its state to a fresh joiner (``join_from_swarm``); whether it arrived bit-identical,
the download's time over a ``torch.save`` of the same state to memory, and the resident
memory each end's peak added, in model bytes; then the rounds until the new edge's first
exchange each way, a dense resync, is mixed: their time and peak over the edge's state.

    python scripts/bench_scale.py --sizes 1M,10M,100M --algorithms choco,diloco
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from gossipgrad.experiment.bench.sizes import parse_size
from torch import nn

WIDTH = 1024


def model_size(text: str) -> int:
    """``parse_size``, at least ``WIDTH`` parameters (argparse.ArgumentTypeError)."""
    shown = text.strip().upper()
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a model size: {shown!r} (e.g. 10M)") from None
    if value < WIDTH:
        raise argparse.ArgumentTypeError(f"model size {shown!r} is below {WIDTH} parameters")
    return value


def build_model(numel: int) -> nn.Module:
    """Square linear layers, ``numel`` parameters in all (to within one layer's rounding)."""
    width = min(WIDTH, int(numel**0.5))
    layers = max(1, round(numel / width**2))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def memory_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


#: The copy clock copies at most this many float32 values (128 MiB, far beyond any cache, so
#: a copy is bound by memory bandwidth and its time is linear in its size) and scales the time
#: to the model: two model-sized buffers per peer would cost 300M-parameter peers 2.4 GB each.
CLOCK_NUMEL = 1 << 25


class CopyClock:
    """Times one ``copy_`` of a model-sized tensor into another, between the steps the rounds
    run beside, so that the copy a round is measured against meets the same contention for
    cores and memory bandwidth as the round (peers on a shared host; one copy timed before
    the rounds, on a host the other peers had left quiet, once made every round look 2-3x as
    costly as it was). Above ``CLOCK_NUMEL`` values it copies that many and scales the time by
    the model's size. Both buffers are allocated before the memory baseline is read."""

    def __init__(self, numel: int) -> None:
        self.source = torch.randn(min(numel, CLOCK_NUMEL))
        self.target = torch.empty_like(self.source)
        self.target.copy_(self.source)  # page faults out of the way
        self.scale = numel / self.source.numel()
        self.wall: list[float] = []
        self.cpu = 0.0  # the training thread's CPU in the copies timed

    def time_one(self) -> None:
        c0, t0 = time.thread_time(), time.perf_counter()
        self.target.copy_(self.source)
        self.wall.append(time.perf_counter() - t0)
        self.cpu += time.thread_time() - c0

    def seconds(self) -> float:
        """The median copy of the whole model: the contention a typical round met."""
        return statistics.median(self.wall) * self.scale


def peer_main(rank: int, args: dict, addresses, barrier, state_turn, results) -> None:
    """One peer: baseline, then gossip, then state; puts a dict of figures on ``results``."""
    try:
        results.put(_peer(rank, args, addresses, barrier, state_turn))
    except BaseException as err:  # reported by the parent, which then stops
        results.put({"rank": rank, "error": f"{err!r}\n{traceback.format_exc()}"})


def _peer(rank: int, a: dict, addresses, barrier, state_turn) -> dict:
    from gossipgrad.peer.algorithms.footprint import gossip_state_bytes
    from gossipgrad.peer.config import build_config
    from gossipgrad.peer.runtime.optimizer import GossipOptimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every peer builds the same initial model
    model = build_model(a["numel"])
    params = list(model.parameters())
    # The objective: peer i pulls its parameters towards a target of its own, a shared one
    # plus 10 % of its own noise, f_i = ||θ − t_i||² / 2; the gradient θ − t_i is one pass,
    # as cheap as a gradient can be (the step's compute is the emulated accelerator's wait).
    shared, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(100 + rank)
    targets = [
        torch.randn(p.shape, generator=shared).add_(torch.randn(p.shape, generator=own), alpha=0.1)
        for p in params
    ]
    for p in params:
        p.grad = torch.empty_like(p)

    def set_gradients() -> None:
        with torch.no_grad():
            for p, t in zip(params, targets, strict=True):
                torch.sub(p, t, out=p.grad)

    def loss() -> float:
        with torch.no_grad():
            return (
                sum(float(torch.dist(p, t)) ** 2 for p, t in zip(params, targets, strict=True)) / 2
            )

    optimizer = torch.optim.SGD(params, lr=a["lr"])
    numel = sum(p.numel() for p in params)
    model_bytes = 4 * numel
    copies = CopyClock(numel)
    wait = a["accelerator_ms"] / 1000
    steps = a["rounds"] * a["local_steps"]

    def plain_steps() -> tuple[float, float]:
        """The same steps without gossip: the CPU and wall time training itself takes."""
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            time.sleep(wait)
            set_gradients()
            optimizer.step()
        return time.process_time() - cpu0, time.perf_counter() - t0

    # Every peer starts gossip from the same model, so the parameters are put back after.
    initial = [p.detach().clone() for p in params]
    cpu_before, wall_before = plain_steps()
    with torch.no_grad():
        for p, p0 in zip(params, initial, strict=True):
            p.copy_(p0)
    del initial
    initial_loss = loss()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the steps above freed is not baseline
    baseline_kib = memory_kib("VmRSS")
    reset_peak()

    overrides = {
        "peer.id": f"p{rank}",
        "peer.listen": "127.0.0.1:0",
        "peer.bootstrap": [] if rank == 0 else [addresses.get(timeout=120)],
        "metrics.enabled": False,
        "gossip.algorithm": a["algorithm"],
        "gossip.topology": "ring",
        "gossip.local_steps": a["local_steps"],
        **a["set"],
    }
    t0 = time.perf_counter()
    gopt = GossipOptimizer(model, optimizer, build_config({}, overrides))
    start_s = time.perf_counter() - t0
    if rank == 0:
        for _ in range(a["peers"] - 1):
            addresses.put(gopt.peer.address)
    if not gopt.wait_for_peers(a["peers"], 120):
        raise RuntimeError("peers did not find each other in 120 s")
    barrier.wait(timeout=120)
    for _ in range(a["local_steps"]):  # the first round opens the edges: not measured
        set_gradients()
        gopt.step()
    barrier.wait(timeout=120)
    stall0 = gopt.blocking_seconds
    round0 = gopt.round
    cpu0, t0 = time.process_time(), time.perf_counter()
    mixed, recorded = 0, gopt.last_round
    for _ in range(steps):
        time.sleep(wait)
        set_gradients()
        gopt.step()
        copies.time_one()
        # A round counts once its stats are recorded: at its step, or with background_rounds
        # when the next round is handed over (the round counter moves in between).
        if gopt.last_round is not recorded:
            recorded = gopt.last_round
            mixed += bool(recorded is not None and recorded.mixed)
    copy_s = copies.seconds()
    wall = time.perf_counter() - t0 - sum(copies.wall)
    cpu_gossip = time.process_time() - cpu0 - copies.cpu
    rounds = max(gopt.round - round0, 1)
    stall_s = gopt.blocking_seconds - stall0
    # The state kept between rounds: read once the last exchanges are mixed and no push or
    # decode is in flight (read during one, it varied by a tenth of a model).
    gopt.finish()
    gc.collect()
    state_kib = memory_kib("VmRSS") - baseline_kib
    peak_kib = memory_kib("VmHWM") - baseline_kib
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed_kib = memory_kib("VmRSS") - baseline_kib
    degree = min(2, a["peers"] - 1)  # a ring
    formula = gossip_state_bytes(gopt.config.gossip, degree, model_bytes) / model_bytes
    final_loss = loss()
    # The steps without gossip again, every peer at once as before the rounds: the baseline
    # is the mean of the two, so the host's drift between them does not count as gossip's.
    barrier.wait(timeout=120)
    cpu_after, wall_after = plain_steps()
    cpu_plain, wall_plain = (cpu_before + cpu_after) / 2, (wall_before + wall_after) / 2
    figures = {
        "rank": rank,
        "numel": numel,
        "model_bytes": model_bytes,
        "copy_s": copy_s,
        "formula_over_model": formula,
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "rounds_mixed": mixed,
        "state_over_model": state_kib * 1024 / model_bytes,
        "trimmed_over_model": trimmed_kib * 1024 / model_bytes,
        "peak_over_model": peak_kib * 1024 / model_bytes,
        "round_cpu_s": (cpu_gossip - cpu_plain) / rounds,
        "round_cpu_over_copy": (cpu_gossip - cpu_plain) / rounds / copy_s,
        "stall_per_round_s": stall_s / rounds,
        "stall_over_phase": stall_s / rounds / max(wait * a["local_steps"], 1e-9),
        "utilization": wall_plain / wall,
        "rounds": rounds,
        "start_s": start_s,
    }
    # What only the rounds needed goes, and the peers measure their state one at a time: a
    # state_dict() and its torch.save to memory are some five models at their peak, which
    # two 300M-parameter peers at once would not fit in 24 GB.
    targets.clear()
    del copies
    gc.collect()
    with state_turn:
        figures.update(state_figures(gopt, model_bytes))
        gopt.close()
    return figures


def state_figures(gopt, model_bytes: int) -> dict:
    """``state_dict()``, and a checkpoint as the daemon writes it (from the live state,
    ``checkpoint_state``), each against a ``torch.save`` of the same state to memory, and
    the resident memory the checkpoint's peak added."""
    from gossipgrad.peer.runtime import checkpoint

    t0 = time.perf_counter()
    state = gopt.state_dict()
    state_dict_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.save(state, io.BytesIO())
    save_s = time.perf_counter() - t0
    del state  # the daemon's checkpoint takes no copy: measured without this one
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before_kib = memory_kib("VmRSS")
    reset_peak()
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        with gopt.checkpoint_state() as live:
            checkpoint.save_atomic(Path(run_dir) / "checkpoint.pt", live)
        checkpoint_s = time.perf_counter() - t0
        checkpoint_kib = memory_kib("VmHWM") - before_kib
    return {
        "state_dict_s": state_dict_s,
        "state_over_save": (state_dict_s + save_s) / save_s,
        "checkpoint_over_save": checkpoint_s / save_s,
        "checkpoint_memory_over_model": checkpoint_kib * 1024 / model_bytes,
    }


def run_case(args: argparse.Namespace, numel: int, algorithm: str) -> list[dict]:
    """One swarm of ``args.peers`` processes; their figures, or SystemExit on a failure."""
    from gossipgrad.peer.config.recommended import recommended

    ctx = mp.get_context("spawn")
    addresses, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(args.peers)
    state_turn = ctx.Lock()
    settings = {
        "numel": numel,
        "algorithm": algorithm,
        "peers": args.peers,
        "rounds": args.rounds,
        "local_steps": args.local_steps.get(algorithm, recommended(algorithm, "local_steps")),
        "accelerator_ms": args.accelerator_ms,
        "lr": 0.2,
        "set": args.set,
    }
    procs = [
        ctx.Process(
            target=peer_main,
            args=(r, settings, addresses, barrier, state_turn, results),
            daemon=True,
        )
        for r in range(args.peers)
    ]
    return run_processes(procs, results, args.timeout)


def run_processes(procs: list, results, timeout: float) -> list[dict]:
    """Start ``procs``, one result each from ``results``, sorted by rank; SystemExit if any
    peer failed (its traceback), the stragglers killed after 30 s."""
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            out.append(results.get(timeout=timeout))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [r for r in out if "error" in r]
    if failed:
        raise SystemExit(f"bench_scale: peer {failed[0]['rank']} failed:\n{failed[0]['error']}")
    return sorted(out, key=lambda r: r["rank"])


# ------------------------------------------------------------------ state download and resync


def join_main(rank: int, args: dict, to_joiner, to_donor, results) -> None:
    """A donor (rank 0) or a joiner (rank 1) of the state download case."""
    try:
        results.put(_join(rank, args, to_joiner, to_donor))
    except BaseException as err:  # reported by the parent, which then stops
        results.put({"rank": rank, "error": f"{err!r}\n{traceback.format_exc()}"})


def state_digest(state: object) -> str:
    """SHA-256 over a nested state's tensors' bytes and plain values, in walk order."""
    import hashlib

    h = hashlib.sha256()

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)
        else:
            h.update(repr(obj).encode())

    walk(state)
    return h.hexdigest()


def _settled_kib() -> int:
    """Resident memory once freed memory is back with the system; the peak starts here."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset_peak()
    return memory_kib("VmRSS")


def _join(rank: int, a: dict, to_joiner, to_donor) -> dict:
    """Rank 0 trains alone past the rounds whose edges open from the shared initial model,
    then serves its state; rank 1 joins, downloading it (``join_from_swarm``); then both run
    rounds, whose first exchange each way is a dense resync of a new edge. Each reports the
    resident memory the download and the resync added at their peak, and their times."""
    from gossipgrad.peer.algorithms.choco import INIT_ROUNDS
    from gossipgrad.peer.algorithms.footprint import gossip_state_bytes
    from gossipgrad.peer.config import build_config
    from gossipgrad.peer.runtime.optimizer import GossipOptimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(a["numel"])
    params = list(model.parameters())
    for p in params:  # a constant gradient: the steps' compute is not what is measured
        p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    numel = sum(p.numel() for p in params)
    model_bytes = 4 * numel
    overrides = {
        "peer.id": f"p{rank}",
        "peer.listen": "127.0.0.1:0",
        "peer.bootstrap": [] if rank == 0 else [to_joiner.get(timeout=600)],
        "peer.join_after_steps": 1,
        "metrics.enabled": False,
        "gossip.algorithm": a["algorithm"],
        "gossip.topology": "ring",
        "gossip.local_steps": 1,
        **a["set"],
    }
    out: dict = {"rank": rank, "numel": numel, "model_bytes": model_bytes}
    gopt = GossipOptimizer(model, optimizer, build_config({}, overrides))
    try:
        if rank == 0:
            # Past the first rounds, a new edge opens with a dense copy (RESYNC), not INIT.
            while gopt.round < INIT_ROUNDS:
                gopt.step()
            state = gopt.state_dict(for_joiner=True)
            out["state_bytes"] = sum(t.numel() * t.element_size() for t in _tensors(state))
            t0 = time.perf_counter()
            torch.save(state, io.BytesIO())
            out["save_s"] = time.perf_counter() - t0
            out["digest"] = state_digest(state)
            del state
            before = _settled_kib()
            to_joiner.put(gopt.peer.address)
            to_donor.get(timeout=a["timeout"])  # the joiner has the state
            out["download_peak_kib"] = memory_kib("VmHWM") - before
        else:
            if not gopt.wait_for_peers(2, 120):
                raise RuntimeError("the joiner did not find the donor in 120 s")
            before = _settled_kib()
            t0 = time.perf_counter()
            if not gopt.join_from_swarm(min_step=1):
                raise RuntimeError("no donor to join from")
            out["download_s"] = time.perf_counter() - t0
            out["download_peak_kib"] = memory_kib("VmHWM") - before
            out["digest"] = state_digest(gopt.state_dict(for_joiner=True))
            to_donor.put("joined")
        # The resync: each side's first exchange on the new edge is a dense copy of x.
        before = _settled_kib()
        t0 = time.perf_counter()
        rounds = 0
        while rounds < 20 and not (gopt.last_round is not None and gopt.last_round.mixed):
            gopt.step()
            rounds += 1
        out["resync_s"] = time.perf_counter() - t0
        out["resync_mixed"] = bool(gopt.last_round is not None and gopt.last_round.mixed)
        out["resync_peak_kib"] = memory_kib("VmHWM") - before
        out["resyncs"] = sum(
            s.value for s in gopt.metrics.resyncs.collect()[0].samples if s.name.endswith("total")
        )
        out["edge_state_bytes"] = gossip_state_bytes(gopt.config.gossip, 1, model_bytes)
        gopt.finish()
    finally:
        gopt.close()
    return out


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def run_join_case(args: argparse.Namespace, numel: int, algorithm: str) -> dict:
    """The state download and resync case (:func:`_join`): the donor's and the joiner's
    figures, in model bytes and seconds, or SystemExit on a failure."""
    ctx = mp.get_context("spawn")
    to_joiner, to_donor, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    settings = {"numel": numel, "algorithm": algorithm, "set": args.set, "timeout": args.timeout}
    procs = [
        ctx.Process(target=join_main, args=(r, settings, to_joiner, to_donor, results), daemon=True)
        for r in range(2)
    ]
    donor, joiner = run_processes(procs, results, args.timeout)
    m = donor["model_bytes"]
    return {
        "size": numel,
        "algorithm": algorithm,
        "model_bytes": m,
        "state_over_model": donor["state_bytes"] / m,
        "identical": donor["digest"] == joiner["digest"],
        "download_s": joiner["download_s"],
        "save_s": donor["save_s"],
        "download_over_save": joiner["download_s"] / donor["save_s"],
        "donor_peak_over_model": donor["download_peak_kib"] * 1024 / m,
        "joiner_peak_over_model": joiner["download_peak_kib"] * 1024 / m,
        "resync_s": max(donor["resync_s"], joiner["resync_s"]),
        "resyncs": min(donor["resyncs"], joiner["resyncs"]),
        "resync_mixed": donor["resync_mixed"] and joiner["resync_mixed"],
        "edge_state_over_model": donor["edge_state_bytes"] / m,
        "resync_peak_over_model": max(donor["resync_peak_kib"], joiner["resync_peak_kib"])
        * 1024
        / m,
    }


JOIN_COLUMNS = [
    ("size", "params", "{:,}"),
    ("algorithm", "algorithm", "{}"),
    ("state_over_model", "state/model", "{:.2f}"),
    ("identical", "identical", "{}"),
    ("download_s", "download s", "{:.2f}"),
    ("save_s", "torch.save s", "{:.2f}"),
    ("download_over_save", "download/save", "{:.2f}"),
    ("donor_peak_over_model", "donor peak/model", "{:.2f}"),
    ("joiner_peak_over_model", "joiner peak/model", "{:.2f}"),
    ("resyncs", "resyncs", "{:.0f}"),
    ("resync_s", "resync s", "{:.2f}"),
    ("edge_state_over_model", "edge state/model", "{:.2f}"),
    ("resync_peak_over_model", "resync peak/model", "{:.2f}"),
]


def summarise(numel: int, algorithm: str, peers: list[dict]) -> dict:
    """The swarm's figures: memory at its worst peer, times at the median peer."""

    def median(key: str) -> float:
        return statistics.median(p[key] for p in peers)

    return {
        "size": numel,
        "algorithm": algorithm,
        "model_mb": peers[0]["model_bytes"] / 1e6,
        "formula_over_model": peers[0]["formula_over_model"],
        "state_over_model": max(p["state_over_model"] for p in peers),
        "peak_over_model": max(p["peak_over_model"] for p in peers),
        "trimmed_over_model": max(p["trimmed_over_model"] for p in peers),
        "copy_ms": 1000 * median("copy_s"),
        "round_cpu_over_copy": median("round_cpu_over_copy"),
        "stall_over_phase": median("stall_over_phase"),
        "utilization": median("utilization"),
        "start_s": median("start_s"),
        "state_dict_s": median("state_dict_s"),
        "state_over_save": median("state_over_save"),
        "checkpoint_over_save": median("checkpoint_over_save"),
        "checkpoint_memory_over_model": max(p["checkpoint_memory_over_model"] for p in peers),
    }


COLUMNS = [
    ("size", "params", "{:,}"),
    ("algorithm", "algorithm", "{}"),
    ("model_mb", "model MB", "{:.0f}"),
    ("formula_over_model", "formula", "{:.2f}"),
    ("state_over_model", "state/model", "{:.2f}"),
    ("peak_over_model", "peak/model", "{:.2f}"),
    ("trimmed_over_model", "trimmed/model", "{:.2f}"),
    ("copy_ms", "copy ms", "{:.1f}"),
    ("round_cpu_over_copy", "round CPU/copy", "{:.1f}"),
    ("stall_over_phase", "stall/phase", "{:.3f}"),
    ("utilization", "utilization", "{:.3f}"),
    ("start_s", "start s", "{:.2f}"),
    ("state_dict_s", "state_dict s", "{:.2f}"),
    ("state_over_save", "state/save", "{:.2f}"),
    ("checkpoint_over_save", "checkpoint/save", "{:.2f}"),
    ("checkpoint_memory_over_model", "checkpoint mem/model", "{:.2f}"),
]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]] = COLUMNS) -> None:
    print("| " + " | ".join(title for _, title, _ in columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in columns) + " |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1M,10M,100M", help="model sizes, e.g. 1M,10M,100M")
    p.add_argument(
        "--algorithms",
        default="choco,diloco",
        help='comma-separated algorithms ("": the state download case only)',
    )
    p.add_argument("--peers", type=int, default=3, help="peer processes on a ring (default 3)")
    p.add_argument("--rounds", type=int, default=6, help="gossip rounds per case (default 6)")
    p.add_argument(
        "--local-steps",
        default="",
        help="steps per round per algorithm, e.g. choco=1,diloco=10 (default: each "
        "algorithm's recommended gossip.local_steps)",
    )
    p.add_argument(
        "--accelerator-ms",
        type=float,
        default=200.0,
        help="emulated compute per step, with the CPU free (default 200)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every peer (repeatable), e.g. gossip.codec=int8",
    )
    p.add_argument(
        "--join",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a state download and the resync after it, per size (default on)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    args = p.parse_args(argv)
    args.sizes = [model_size(s) for s in args.sizes.split(",") if s.strip()]
    args.algorithms = [s.strip() for s in args.algorithms.split(",") if s.strip()]
    try:
        args.local_steps = {
            k: int(v) for k, v in (kv.split("=") for kv in args.local_steps.split(",") if kv)
        }
        args.set = dict(_override(kv) for kv in args.set)
    except ValueError as err:
        p.error(str(err))
    if args.peers < 2:
        p.error("--peers must be at least 2")
    return args


def _override(kv: str) -> tuple[str, object]:
    key, sep, value = kv.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {kv!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for numel in args.sizes:
        for algorithm in args.algorithms:
            print(
                f"bench_scale: {numel:,} parameters, {algorithm} ...", file=sys.stderr, flush=True
            )
            rows.append(summarise(numel, algorithm, run_case(args, numel, algorithm)))
    joins = []
    for numel in args.sizes if args.join else []:
        print(f"bench_scale: {numel:,} parameters, state download ...", file=sys.stderr, flush=True)
        joins.append(run_join_case(args, numel, "choco"))
    if rows:
        print_table(rows)
    if joins:
        print("\n" if rows else "", end="")
        print_table(joins, JOIN_COLUMNS)
    if args.json:
        args.json.write_text(json.dumps({"cases": rows, "joins": joins}, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
