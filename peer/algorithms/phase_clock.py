"""When a DiLoCo phase ends: every H inner steps, or H growing as the learning rate decays.

With ``gossip.qsr_alpha = α > 0`` the phase that starts after a phase end at learning rate η
lasts (Quadratic Synchronization Rule: Gu, Lyu, Arora, Zhang, Huang, ICLR 2024,
arXiv 2310.14423)

    H = max(H_base, floor((α / η)²))

inner steps, H_base being ``gossip.local_steps``: phases are short while the learning rate is
large and the replicas move apart quickly, and long once it has decayed and a phase moves them
little, so a run's bytes go where they buy the most. While the learning rate rises (a
warm-up: η above the one at the phase end before), H stays H_base, as it would otherwise be
longest where η is smallest, at the very start. η is the learning rate of the optimizer's
first parameter group at the phase end: every peer of a swarm running the same schedule reads
the same value at the same step, so phase ends stay aligned without a message; a joiner and a
restarted peer take the clock's state with the rest of the algorithm's.
"""

from __future__ import annotations

import math

#: A phase length that no run reaches: what a learning rate of 0 gives (the run's end, then
#: ``finish()``, closes that phase).
UNTIL_THE_END = 1 << 62


def qsr_local_steps(base: int, alpha: float, lr: float) -> int:
    """max(base, floor((alpha / lr)²)), capped at ``UNTIL_THE_END`` (lr <= 0 included)."""
    if lr <= 0:
        return UNTIL_THE_END
    ratio = alpha / lr
    if ratio * ratio >= UNTIL_THE_END:
        return UNTIL_THE_END
    return max(base, math.floor(ratio * ratio))


class PhaseClock:
    """The steps at which phases end.

    Args:
        local_steps: H_base, the inner steps of a phase (all of them without QSR).
        qsr_alpha: α of the rule above; 0 keeps every phase at ``local_steps``.
    """

    def __init__(self, local_steps: int, qsr_alpha: float = 0.0) -> None:
        if local_steps < 1:
            raise ValueError(f"local_steps={local_steps} must be at least 1")
        if qsr_alpha < 0:
            raise ValueError(f"qsr_alpha={qsr_alpha} must be >= 0")
        self.base = local_steps
        self.alpha = qsr_alpha
        self.end = local_steps  # the step that ends the current phase (QSR)
        self.length = local_steps  # the current phase's inner steps
        self._last_lr: float | None = None  # the learning rate at the phase end before

    def due(self, step: int) -> bool:
        """Whether inner step ``step`` (1-based) ends a phase. Without QSR every multiple of
        H does, so a peer restarted mid-phase ends its phases with the swarm's."""
        if self.alpha == 0:
            return step % self.base == 0
        return step >= self.end

    def ended(self, step: int, lr: float) -> int:
        """A phase ended after ``step`` with learning rate ``lr``: set the next one's end and
        return its length."""
        if self.alpha > 0:
            rising = self._last_lr is None or lr > self._last_lr
            self.length = self.base if rising else qsr_local_steps(self.base, self.alpha, lr)
            self.end = min(step + self.length, UNTIL_THE_END)
            self._last_lr = lr
        return self.length

    def state_dict(self) -> dict:
        return {"end": self.end, "length": self.length, "last_lr": self._last_lr}

    def load_state_dict(self, state: dict | None) -> None:
        """Take a checkpoint's or a donor's clock (None, a state saved without one: the clock
        stays as built, and with QSR the next step ends a phase)."""
        if not state:
            return
        self.end, self.length = int(state["end"]), int(state["length"])
        last = state.get("last_lr")
        self._last_lr = None if last is None else float(last)
