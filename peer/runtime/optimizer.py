"""GossipOptimizer: bring your own training loop, gossip happens in the background.

Wrap a model and any ``torch.optim`` optimizer; call ``step()`` as usual. What happens around
the optimizer step is the algorithm's (peer/algorithms/): with the default ``choco``, every
``gossip.local_steps`` steps a CHOCO-SGD round runs (compressed differences go out to the
neighbours on background threads, and the model takes a consensus step towards them); with
``ef-gradient``, every step first replaces the gradients by the neighbourhood's average of
error-feedback-compressed gradients; with ``diloco``, every ``gossip.local_steps`` steps ends a
phase: the pseudo-gradient is exchanged and an outer optimizer moves the model. The daemon's
task mode is built on this class, so both share one code path.

LR schedulers take the wrapped optimizer (``gopt.optimizer``). Gradient accumulation needs
nothing special: gossip happens in ``step()``, never in ``backward()``.

Example::

    model = MyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = load_config(Path("site.toml"))
    with GossipOptimizer(model, opt, cfg) as gopt:
        for x, y in loader:
            gopt.zero_grad()
            loss_fn(model(x), y).backward()
            gopt.step()
        gopt.finish()   # the last exchanges, mixed at both ends; the neighbours told
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch
from gossipgrad.peer.algorithms import GossipAlgorithm, RoundStats
from gossipgrad.peer.config import PeerConfig
from gossipgrad.peer.flat import FlatParameters, FloatBuffers, persistent_buffers
from gossipgrad.peer.network.malloc import trim_malloc
from gossipgrad.peer.runtime.background import BackgroundRound
from gossipgrad.peer.runtime.checkpoint import params_digest
from gossipgrad.peer.runtime.joining import find_swarm
from gossipgrad.peer.runtime.node import Peer
from gossipgrad.peer.runtime.state_stream import StateWriter, host_copy, on_host
from torch import nn

log = logging.getLogger(__name__)

#: The heap is trimmed after every round (``trim_malloc``) for parameters of at least this
#: many bytes, whose rounds free model-sized temporaries and take tens of ms or more; for
#: smaller ones at most once per TRIM_EVERY_S: their rounds of a few ms free little, and a
#: trim costs a peer 0.2-0.7 ms.
TRIM_EACH_ROUND_BYTES = 8 << 20
TRIM_EVERY_S = 1.0


class GossipOptimizer:
    """A torch optimizer wrapper that makes one peer of a gossip swarm.

    Args:
        model: the model; its trainable parameters are re-homed into one flat buffer (they
            become views, so keep using the model as before).
        optimizer: any torch.optim optimizer over the model's parameters.
        config: the peer config ([peer], [gossip], [membership], [metrics], [transport]).
        registry: Prometheus registry for the metrics (None: a fresh one per peer).
        start: join the swarm at once (else call ``start()``).
        check_reachability: with a bootstrap list, ``start()`` finds the swarm and has a
            member dial this peer back, and a relay call it if none can (``start``); False
            leaves that to the caller (the daemon, which waits for ``expected_peers`` in
            between).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: PeerConfig,
        *,
        registry=None,
        start: bool = True,
        check_reachability: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.flat = FlatParameters(model)
        # The parameters the algorithm works on: the model's own, or a host copy of them
        # that takes them before each round and gives them back after (gossip.state_device).
        self.gossip_flat = self.flat.host_twin() if _state_on_host(config, self.flat) else self.flat
        self.buffers = FloatBuffers(model)
        self.local_step = 0
        self.last_round: RoundStats | None = None
        self.blocking_seconds = 0.0  # training-thread time spent blocked in gossip
        self.finished = False  # finish() ran: the gossip of this run is over
        self._background: BackgroundRound[RoundStats | None] | None = (
            BackgroundRound() if config.gossip.background_rounds else None
        )
        # The training thread's optimizer steps vs. the algorithm's reads and writes of the
        # parameters vs. state downloads.
        self.state_lock = threading.RLock()
        self.peer = Peer(
            config,
            self.gossip_flat,
            state_source=self._state_snapshot,
            registry=registry,
            state_lock=self.state_lock,
            buffers=self.buffers,
        )
        if start:
            self.start(check_reachability)

    @property
    def metrics(self):
        return self.peer.metrics

    @property
    def algorithm(self) -> GossipAlgorithm:
        if self.peer.algorithm is None:
            raise ValueError("the peer has not started: call start() first")
        return self.peer.algorithm

    @property
    def round(self) -> int:
        return self.peer.algorithm.round if self.peer.algorithm is not None else 0

    @property
    def last_exchange(self):
        """ef-gradient / diloco: the stats of the last compressed exchange (else None)."""
        return getattr(self.peer.algorithm, "last_exchange", None)

    def anchor_checksums(self) -> dict[int, str]:
        """exact-diloco: the anchor's checksum after each phase (empty for the others)."""
        return self.algorithm.anchor_checksums()

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (to read or set the learning rate)."""
        return self.optimizer.param_groups

    def start(self, check_reachability: bool = True) -> None:
        """Join the swarm: serve gRPC, start membership (idempotent).

        With a bootstrap list (and ``check_reachability``), also find the swarm (JoinError
        if no bootstrap peer answers within ``peer.start_timeout``) and settle how this
        peer is called before returning: a member dials it back, and one nobody can dial
        is called through a relay (``Peer.settle_reachability``: NotReachable if no member
        takes it and ``peer.require_reachable``). Until then its heartbeats say it is still
        checking, and no other peer counts it or mixes with it. Without that, a library
        peer behind NAT trained alone."""
        bootstrap = bool(self.config.peer.bootstrap)
        self.peer.start(checking=bootstrap)
        membership = self.peer.membership
        if check_reachability and bootstrap and membership.me.checking:
            try:
                find_swarm(membership, self.config.peer.start_timeout)
                self.peer.settle_reachability()
            except BaseException:
                self.peer.close()  # a constructor that raises leaves no server behind
                raise

    def wait_for_peers(
        self, count: int, timeout: float, stop: threading.Event | None = None
    ) -> bool:
        """Block until `count` peers (self included) are known, the timeout passes or
        ``stop`` is set."""
        return self.peer.membership.wait_for(count, timeout, stop)

    # ------------------------------------------------------------------ optimizer interface

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One local optimizer step, with the gossip the algorithm asks for around it (a
        closure, if given, is evaluated first, so gradients exist before the exchange)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.exchange_gradients()
        with self.state_lock:
            out = self.optimizer.step()
            self.local_step += 1
        self.after_local_step()
        return loss if loss is not None else out

    def exchange_gradients(self) -> None:
        """What the algorithm does with the gradients before the step (ef-gradient: replace
        ``.grad`` by the neighbourhood's compressed average; others: nothing)."""
        with self._blocking():
            self.algorithm.before_step()

    @contextlib.contextmanager
    def _blocking(self) -> Iterator[None]:
        """Count the wall time the training thread spends here as blocked by gossip
        (``gossipgrad_gossip_blocking_seconds_total``; compute utilization is the rest)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            self.blocking_seconds += seconds
            self.metrics.record_blocking(seconds)

    def after_local_step(self) -> RoundStats | None:
        """What the algorithm does after step ``local_step`` (a round, when one is due).

        With ``gossip.background_rounds`` a due round is handed to a thread of its own and
        training goes on; the training thread waits only for the round before it (returned
        here, its stats, when it finished), so one round overlaps the next phase's compute.
        """
        step = self.local_step
        self.algorithm.observe_learning_rate(float(self.optimizer.param_groups[0]["lr"]))
        if self._background is not None:
            stats = None
            if self.algorithm.round_due(step):
                stats = self._wait_for_round()
                with self._blocking():
                    self.algorithm.hand_over(step)
                self._background.start(lambda: self.algorithm.after_step(step))
        else:
            with self._blocking(), self._parameters_to_gossip(self.algorithm.round_due(step)):
                stats = self.algorithm.after_step(step)
            self._record(stats)
        self.peer.update_progress(self.local_step, self.round)
        return stats

    @contextlib.contextmanager
    def _parameters_to_gossip(self, moved: bool = True) -> Iterator[None]:
        """With the gossip state on the host (``gossip_flat`` a host copy): the parameters
        go to the host copy before the algorithm runs (``moved``: only when it touches them)
        and come back after it, so the round works on the parameters as trained and training
        goes on from the round's result, as with no copy."""
        if self.gossip_flat is self.flat or not moved:
            yield
            return
        with torch.no_grad(), self.state_lock:
            self.gossip_flat.data.copy_(self.flat.data)
        try:
            yield
        finally:
            with torch.no_grad(), self.state_lock:
                self.flat.data.copy_(self.gossip_flat.data)

    def _wait_for_round(self) -> RoundStats | None:
        """Wait for the round running in the background, if any, and record it."""
        if self._background is None:
            return None
        with self._blocking():
            stats = self._background.wait()
        self._record(stats)
        return stats

    def _record(self, stats: RoundStats | None) -> None:
        if stats is not None:
            self.last_round = stats
            self._average_buffers(stats)
            # The round's temporaries, back to the system.
            trim_malloc(0.0 if self.gossip_flat.nbytes >= TRIM_EACH_ROUND_BYTES else TRIM_EVERY_S)

    def _average_buffers(self, stats: RoundStats) -> None:
        if self.peer.buffer_average is not None:
            self.peer.buffer_average.after_round(stats.round)

    def gossip_round(self) -> RoundStats:
        """One gossip-only round now (``gossip.final_rounds``)."""
        self._wait_for_round()
        with self._blocking(), self._parameters_to_gossip():
            self.last_round = self.algorithm.consensus_round()
        self._average_buffers(self.last_round)
        self.peer.update_progress(self.local_step, self.round)
        return self.last_round

    def finish(self, interrupted: bool = False) -> None:
        """Training is over: apply what is still in flight (diloco's last exchange), mix the
        exchanges still open at both ends, and tell the neighbours (a FINAL notice), after
        which no exchange is opened or taken. Call it after any ``gossip_round``: rounds after
        it exchange nothing. ``interrupted``: the run was cut short; settle only what is under
        way, within one ``round_timeout`` (``close`` does this when ``finish`` was not
        called). Once only."""
        if self.finished:
            return
        self.finished = True
        self._wait_for_round()
        with self._blocking(), self._parameters_to_gossip():
            self.algorithm.finish(interrupted)

    # ------------------------------------------------------------------ state

    def state_dict(self, for_joiner: bool = False) -> dict:
        """Everything needed to resume: parameters, optimizer state, counters, the algorithm's
        state (``for_joiner``: without what is this peer's own, see GossipAlgorithm). On the
        training thread (``for_joiner`` False) a round in the background ends first, so the
        state is not taken half way through it."""
        if not for_joiner:
            self._wait_for_round()
        with self.state_lock:
            return self._state(for_joiner, lambda t: t.detach().clone())

    @contextlib.contextmanager
    def checkpoint_state(self) -> Iterator[dict]:
        """:meth:`state_dict` for the block's duration, its tensors the live ones instead of
        copies: what a checkpoint writes, without the state's size again in memory while it
        is written (3 models more for a diloco peer: parameters, anchor, residual). A round
        in the background ends first and the state lock is held to the block's end, so
        nothing changes the state meanwhile (a neighbour's update waits to be mixed, a joiner
        to be served). On the training thread; keep none of its tensors after the block."""
        self._wait_for_round()
        with self.state_lock:
            yield self._state(False, torch.Tensor.detach, copy_algorithm=False)

    def _state(
        self,
        for_joiner: bool,
        copy: Callable[[torch.Tensor], torch.Tensor],
        copy_algorithm: bool = True,
    ) -> dict:
        """:meth:`state_dict` under the lock, with parameters and buffers taken by ``copy``
        (the optimizer's tensors are its own: the caller copies them if it needs to) and the
        algorithm's copied unless ``copy_algorithm`` is False."""
        return {
            "params": copy(self.flat.data),
            "buffers": {n: copy(b) for n, b in persistent_buffers(self.model)},
            "optimizer": self.optimizer.state_dict(),
            "local_step": self._joiners_step() if for_joiner else self.local_step,
            "round": self.round,
            "fingerprint": self.flat.fingerprint,
            "algorithm": self.config.gossip.algorithm,
            "gossip": self.algorithm.state_dict(for_joiner, copy=copy_algorithm),
        }

    def _joiners_step(self) -> int:
        """The step a joiner starts from. With phases (diloco, exact-diloco) a state taken
        after step s and before s's phase end (which waits for every member's message, the
        joiner's too) says s − 1: the joiner's next step is s, it ends that phase with the
        swarm and its message is among the phase's, instead of ending its phases one behind
        the swarm's for the rest of the run. Its parameters and optimizer state are step s's:
        it trains one step more than it counts. Otherwise the step taken."""
        return self.local_step - int(self.algorithm.phase_end_pending(self.local_step))

    def load_state_dict(self, state: dict) -> None:
        self._wait_for_round()  # a round handed over before is over before the state changes
        if state.get("fingerprint") != self.flat.fingerprint:
            raise ValueError(
                f"state is for another model (fingerprint {state.get('fingerprint')!r}, "
                f"this model {self.flat.fingerprint!r})"
            )
        algorithm = state.get("algorithm", self.config.gossip.algorithm)
        if algorithm != self.config.gossip.algorithm:
            raise ValueError(
                f"state was saved by algorithm {algorithm!r}, this peer runs "
                f"{self.config.gossip.algorithm!r}"
            )
        with self.state_lock, torch.no_grad():
            self.flat.data.copy_(state["params"].to(self.flat.data.device))
            if self.gossip_flat is not self.flat:
                self.gossip_flat.data.copy_(self.flat.data)
            buffers = dict(persistent_buffers(self.model))
            for name, value in state.get("buffers", {}).items():
                if name in buffers:
                    buffers[name].copy_(value.to(buffers[name].device))
            self.optimizer.load_state_dict(state["optimizer"])
            self.local_step = int(state["local_step"])
            gossip = state.get("gossip", {"round": state.get("round", 0)})
            self.algorithm.load_state_dict(_to_device(gossip, self.gossip_flat.data.device))

    def _state_snapshot(self) -> tuple[int, int, StateWriter]:
        """The state a joining peer downloads: every tensor copied once, under the lock, into
        host memory, and sent from that copy. The copy is what keeps the download consistent
        (never torn): training goes on while the state is sent, which may take minutes, and
        holding the lock for as long would stall it. Serialized as it is sent, not before."""
        with self.state_lock:
            state = self._state(True, host_copy)
            state["optimizer"] = host_copy(state["optimizer"])  # its own tensors, live
            state["gossip"] = on_host(state["gossip"])  # the algorithm's copies already
        # Evidence for the joiner's side (its status.json start_params): what was sent.
        log.info(
            "serving state at step %d (round %d), params %s",
            state["local_step"], state["round"], params_digest(state["params"]),
        )  # fmt: skip
        return state["local_step"], state["round"], StateWriter(state)

    def join_from_swarm(
        self,
        timeout: float | None = None,
        patience: float | None = None,
        min_step: int | None = None,
    ) -> bool:
        """Download model and optimizer state from a live donor, if one is at least
        ``min_step`` steps in (default ``peer.join_after_steps``; peers started together skip
        this: False).

        Args:
            timeout: deadline of one download (default ``transport.state_timeout``).
            patience: seconds to keep retrying busy or failing donors (default
                ``peer.start_timeout``).
            min_step: the least step a donor must be at (a restarted peer: its checkpoint's
                step plus ``peer.join_after_steps``).

        Raises:
            JoinError: donors were there but none sent its state in time.
        """
        if min_step is None:
            min_step = self.config.peer.join_after_steps
        got = self.peer.download_state(
            timeout=timeout,
            min_step=max(1, min_step),
            patience=self.config.peer.start_timeout if patience is None else patience,
        )
        if got is None:
            return False
        _, state = got
        if not isinstance(state, dict):  # a torch.save blob, from an older donor
            state = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
        self.load_state_dict(state)
        log.info("joined at step %d (round %d) from the swarm", self.local_step, self.round)
        return True

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Leave the swarm cleanly (also on ``with`` exit): a run that did not ``finish``
        (an exception, KeyboardInterrupt, a signal) finishes as interrupted first, so the
        neighbours are told and no exchange is left mixed at one end only."""
        try:
            self._wait_for_round()
            if not self.finished and self.peer.algorithm is not None:
                self.finish(interrupted=True)
        finally:
            self.peer.close()

    def __enter__(self) -> GossipOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_device(state, device: torch.device):
    """Tensors of a nested state moved to ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    return state


def _state_on_host(config: PeerConfig, flat: FlatParameters) -> bool:
    """Whether the gossip state goes to host memory (``gossip.state_device``), logged when
    it does."""
    g = config.gossip
    if g.state_device == "model":
        return False
    if g.state_device == "auto" and (
        flat.device.type == "cpu" or g.background_rounds or g.algorithm == "ef-gradient"
    ):
        return False
    log.info(
        "gossip state in host memory (gossip.state_device = %s; the model is on %s): "
        "the parameters cross to it before each round and back after",
        g.state_device,
        flat.device,
    )
    return True
