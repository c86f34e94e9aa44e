"""Hierarchical training: dense all-reduce inside a site, compressed gossip across sites.

A *site* is one ``torchrun`` job (one machine with N GPUs, or a small cluster). Inside it,
torch.distributed (NCCL on GPUs, gloo on CPU) averages gradients densely over the fast local
fabric; across sites only the site leader (global rank 0 of the job) runs a ``Peer`` and
gossips compressed updates over gRPC, so the site counts as one peer in the mixing weights
and puts on the wire exactly what a one-process peer would. Every local step:

1. All ranks: backward on their own shard, then all-reduce (average) the flat gradient.
2. ef-gradient only: the leader exchanges the averaged gradient with its neighbours
   (peer/algorithms/ef_gradient.py) and broadcasts the result, so every rank steps with it.
3. All ranks: the local optimizer step (same gradient, same parameters, same result).
4. When a gossip round (diloco: a phase's outer round) is due: the leader runs it, then
   broadcasts the merged parameters, so all ranks of a site hold identical parameters after
   every round.

Tensors stay on the ranks' devices: the all-reduce and broadcasts work on the flat
parameter/gradient buffers in place, with no host copies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gossipgrad.peer.config import PeerConfig
from gossipgrad.peer.flat import FlatParameters, tensor_checksum
from gossipgrad.peer.metrics import PeerMetrics
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from torch import nn

log = logging.getLogger(__name__)


class SiteLeaderFailed(RuntimeError):
    """Raised on a site's other ranks when the leader's gossip work raised (the leader
    raises its own exception)."""


@dataclass(frozen=True)
class SiteContext:
    """Where this process sits inside its site (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SiteContext | None:
        """The site of a process launched by torchrun with more than one rank, else None."""
        env = dict(os.environ) if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return cls(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        )

    def shard(self, site_index: int, num_sites: int) -> tuple[int, int]:
        """(index, count) of this rank's data shard: each site's shard split over its ranks."""
        return site_index * self.world_size + self.rank, num_sites * self.world_size

    def device(self, base: torch.device) -> torch.device:
        """The rank's device: its own GPU (cuda:LOCAL_RANK) when the config asks for cuda."""
        if base.type == "cuda":
            dev = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(dev)
            return dev
        return base

    def run_dir(self, run_dir: Path) -> Path:
        """The leader writes the site's files; other ranks write under rank<N>/."""
        return run_dir if self.leader else run_dir / f"rank{self.rank}"


def init_site(device: torch.device) -> None:
    """Join the site's process group (torchrun's env://): NCCL on GPUs, gloo on CPU."""
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        atexit.register(_let_collective_threads_settle)


#: How long a process that used the site's group gives its collective threads at exit.
EXIT_SETTLE_S = 0.05


def _let_collective_threads_settle() -> None:
    """At interpreter exit, before finalization: release the GIL for a moment.

    gloo's worker thread drops its reference to a finished collective (and so to the Python
    tensors it used) just after the caller's ``wait`` returns, and needs the GIL to do so. A
    process that exits right after a collective (a rank that catches SiteLeaderFailed and
    returns) would otherwise finalize while that thread waits for the GIL; the thread is then
    unwound through C++ and the process aborts ("terminate called without an active
    exception", exit status -6) instead of exiting with its own status.
    """
    time.sleep(EXIT_SETTLE_S)


def close_site() -> None:
    """Leave the site's process group (end of a run)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class _FollowerPeer:
    """What a non-leader rank shows where a leader has its Peer: no network, no membership."""

    def __init__(self, site_id: str, rank: int) -> None:
        self.id = f"{site_id or 'site'}-rank{rank}"
        self.address = ""
        self.metrics_port = 0
        self.membership = None
        #: Only the leader talks to the swarm, through a relay or not.
        self.relay = ""

    def update_progress(self, step: int, round_: int) -> None:
        pass


class SiteOptimizer:
    """GossipOptimizer for one rank of a multi-process site (see the module docstring).

    Every rank of the site constructs one, with the same model and optimizer type; the
    process group must be initialized (``init_site``). The interface is GossipOptimizer's,
    so the daemon's loop runs unchanged on every rank.

    Args:
        model, optimizer, config: as for GossipOptimizer.
        site: this process's place in the site.
        verify: after every round, all-gather a checksum of the parameters and raise if the
            ranks disagree (costs one tiny collective; for tests and debugging).
        registry: Prometheus registry of the leader's metrics.
        check_reachability: as for GossipOptimizer (the leader's peer).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: PeerConfig,
        site: SiteContext,
        *,
        verify: bool = False,
        registry=None,
        check_reachability: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise ValueError("SiteOptimizer needs torch.distributed initialized (init_site)")
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.site = site
        self.verify = verify
        self.gopt: GossipOptimizer | None = None
        error: Exception | None = None
        if site.leader:
            try:  # e.g. its port is taken: the other ranks must not wait for it
                self.gopt = GossipOptimizer(
                    model,
                    optimizer,
                    config,
                    registry=registry,
                    check_reachability=check_reachability,
                )
            except Exception as err:
                error = err
        share_outcome(error, False, "starting its peer", next(model.parameters()).device)
        if self.gopt is not None:
            self.flat = self.gopt.flat
            self.peer = self.gopt.peer
            self.metrics = self.gopt.metrics
        else:
            self.flat = FlatParameters(model, keep_initial=False)  # a follower never gossips
            self.peer = _FollowerPeer(config.peer.id, site.rank)
            self.metrics = PeerMetrics()
        self._local_step = 0
        self._rounds = 0
        self.rounds_verified = 0
        self._grad_buf = torch.zeros_like(self.flat.data)
        # Everyone starts from the leader's parameters.
        dist.broadcast(self.flat.data, src=0)

    # ------------------------------------------------------------------ properties

    @property
    def local_step(self) -> int:
        # The leader's GossipOptimizer owns the count (a join or resume sets it there).
        return self.gopt.local_step if self.gopt is not None else self._local_step

    @local_step.setter
    def local_step(self, value: int) -> None:
        self._local_step = value
        if self.gopt is not None:
            self.gopt.local_step = value

    @property
    def round(self) -> int:
        return self.gopt.round if self.gopt is not None else self._rounds

    @property
    def blocking_seconds(self) -> float:
        """The leader's seconds blocked in gossip (0 on the other ranks)."""
        return self.gopt.blocking_seconds if self.gopt is not None else 0.0

    @property
    def last_round(self):
        return self.gopt.last_round if self.gopt is not None else None

    @property
    def last_exchange(self):
        return self.gopt.last_exchange if self.gopt is not None else None

    def anchor_checksums(self) -> dict[int, str]:
        """The leader's anchor checksum after each phase (empty on the other ranks)."""
        return self.gopt.anchor_checksums() if self.gopt is not None else {}

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    # ------------------------------------------------------------------ the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _average_gradients(self) -> None:
        g = self._grad_buf
        g.copy_(self.flat.grad())
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        g.div_(self.site.world_size)
        self.flat.set_grad(g)

    def step(self, closure=None):
        """All-reduce gradients in the site, exchange across sites, step, gossip, broadcast."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._average_gradients()
        if self.config.gossip.algorithm == "ef-gradient":
            self._on_leader("the gradient exchange", self._exchange_gradients)
            dist.broadcast(self._grad_buf, src=0)
            self.flat.set_grad(self._grad_buf)
        lock = self.gopt.state_lock if self.gopt is not None else _NO_LOCK
        with lock:
            out = self.optimizer.step()
            self.local_step = self.local_step + 1
        # The leader runs the round when the algorithm says one is due, and says so.
        if self._on_leader("a gossip round", lambda: self.gopt.after_local_step() is not None):
            self._take_leaders_parameters()
        self.peer.update_progress(self.local_step, self.round)
        return loss if loss is not None else out

    def _exchange_gradients(self) -> None:
        self.gopt.exchange_gradients()
        self._grad_buf.copy_(self.flat.grad())

    def _on_leader(self, what: str, work: Callable[[], object]) -> bool:
        """Run ``work`` on the leader, then tell every rank its truth value, or that it
        failed (one flag broadcast): the other ranks raise :class:`SiteLeaderFailed` at once
        instead of blocking in their next collective for as long as the leader's process
        lives."""
        error: Exception | None = None
        result = False
        if self.gopt is not None:
            try:
                result = bool(work())
            except Exception as err:
                error = err
        return share_outcome(error, result, what, self.flat.device)

    def agree(self, stop: bool, finite: bool) -> tuple[bool, bool]:
        """Collective, once per local step: (stop, loss finite) for the whole site.

        Each rank reports its own view (a signal reaches the ranks at different moments; a
        shard's loss can turn non-finite on one rank first); the site stops when any rank
        was asked to, and fails when any rank's loss is not finite. One all-reduce of two
        flags hands every rank that one decision, so no rank leaves the loop while another
        waits for it in the next collective (NCCL would hang until its timeout).
        """
        flags = torch.tensor(
            [int(stop), int(not finite)], dtype=torch.int32, device=self.flat.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), not bool(flags[1].item())

    def gossip_round(self) -> None:
        """One gossip-only round across sites: the leader gossips, every rank takes x."""
        self._on_leader("a gossip round", lambda: self.gopt.gossip_round())
        self._take_leaders_parameters()

    def finish(self, interrupted: bool = False) -> None:
        """Training is over: the leader applies what is in flight and ends its exchanges
        (GossipOptimizer.finish), every rank takes x."""
        self._on_leader("the end of the run", lambda: self.gopt.finish(interrupted))
        self._take_leaders_parameters()

    def _take_leaders_parameters(self) -> None:
        with self.gopt.state_lock if self.gopt is not None else _NO_LOCK:
            dist.broadcast(self.flat.data, src=0)
        self._rounds += 1
        if self.verify:
            self.check_identical()

    def check_identical(self) -> None:
        """Raise if any rank's parameters differ from the leader's (bit for bit)."""
        mine = torch.tensor(
            [tensor_checksum(self.flat.data) & 0x7FFFFFFFFFFFFFFF], device=self.flat.device
        )
        every = [torch.zeros_like(mine) for _ in range(self.site.world_size)]
        dist.all_gather(every, mine)
        values = {int(t.item()) for t in every}
        if len(values) != 1:
            raise RuntimeError(f"site ranks diverged after round {self._rounds}: {values}")
        self.rounds_verified += 1

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        if self.gopt is not None:
            return self.gopt.state_dict()
        return self._follower_state(torch.Tensor.clone)

    @contextlib.contextmanager
    def checkpoint_state(self) -> Iterator[dict[str, Any]]:
        """The leader's ``GossipOptimizer.checkpoint_state`` (the live state, held still);
        a follower's state is changed by its training thread alone: taken as it is."""
        if self.gopt is not None:
            with self.gopt.checkpoint_state() as state:
                yield state
        else:
            yield self._follower_state(torch.Tensor.detach)

    def _follower_state(self, take: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        return {
            "params": take(self.flat.data.detach()),
            "optimizer": self.optimizer.state_dict(),
            "local_step": self.local_step,
            "round": self._rounds,
            "fingerprint": self.flat.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.gopt is not None:
            self.gopt.load_state_dict(state)
            self._local_step = self.gopt.local_step
            self._rounds = self.gopt.round
            return
        if state.get("fingerprint") != self.flat.fingerprint:
            raise ValueError("state is for another model")
        with torch.no_grad():
            self.flat.data.copy_(state["params"].to(self.flat.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self._local_step = int(state["local_step"])
        self._rounds = int(state["round"])

    def sync_site(self) -> None:
        """Collective: every rank takes the leader's state (after a resume or a join)."""
        box = [self.state_dict() if self.site.leader else None]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        if not self.site.leader:
            self.load_state_dict(box[0])

    def _object_device(self) -> torch.device | None:
        return self.flat.device if self.flat.device.type == "cuda" else None

    def wait_for_peers(
        self, count: int, timeout: float, stop: threading.Event | None = None
    ) -> bool:
        """Leader: wait for `count` sites (or until ``stop`` is set); other ranks have
        nothing to wait for."""
        if self.gopt is None:
            return True
        return self.gopt.wait_for_peers(count, timeout, stop)

    def join_from_swarm(
        self,
        timeout: float | None = None,
        patience: float | None = None,
        min_step: int | None = None,
    ) -> bool:
        """Leader: download state from the swarm, as ``GossipOptimizer.join_from_swarm``
        (call ``sync_site`` afterwards on all ranks)."""
        if self.gopt is None:
            return False
        return self.gopt.join_from_swarm(timeout, patience, min_step)

    def close(self) -> None:
        if self.gopt is not None:
            self.gopt.close()

    def __enter__(self) -> SiteOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def share_outcome(error: Exception | None, result: bool, what: str, device: torch.device) -> bool:
    """Collective after leader-only work: every rank gets the leader's ``result``, or, if it
    raised, the message (the leader re-raises ``error``, the others raise SiteLeaderFailed)."""
    flag = torch.tensor([2 if error is not None else int(result)], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    if flag.item() != 2:
        return bool(flag.item())
    box = [f"{type(error).__name__}: {error}" if error is not None else None]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    if error is not None:
        raise error
    raise SiteLeaderFailed(f"the site leader failed in {what}: {box[0]}")


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NO_LOCK = _NoLock()
