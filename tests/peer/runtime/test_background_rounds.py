"""gossip.background_rounds: choco's round runs beside training, the training thread waits
only for the round before the next one, and both ends still mix the same exchanges."""

from __future__ import annotations

import threading

import pytest
import torch
from gossipgrad.peer.config import ConfigError, build_config
from gossipgrad.peer.runtime.background import BackgroundRound
from support.optimizers import start_optimizers

pytestmark = pytest.mark.timeout(120)


def step(o, target: torch.Tensor) -> None:
    o.flat.set_grad(o.flat.data - target)
    o.step()


def test_training_goes_on_while_a_round_waits_for_its_neighbour() -> None:
    """p0's round (H = 2) waits for p1, which has not stepped: p0's step 2 hands the round
    over and returns, and p0 takes step 3 meanwhile. Once p1 catches up, both ends mix the
    same exchanges, and the rounds come back to the training thread in order."""
    a, b = start_optimizers(
        2, algorithm="choco", lr=0.5, local_steps=2, background_rounds=True, max_staleness=0
    )
    try:
        gen = torch.Generator().manual_seed(0)
        targets = [torch.randn(a.flat.numel, generator=gen) for _ in range(2)]
        step(a, targets[0])
        step(a, targets[0])  # round 0 due: handed over, it waits for b
        step(a, targets[0])  # not due: the training thread is not held by the round
        assert a.local_step == 3 and a._background.running and a.last_round is None
        other = threading.Thread(target=lambda: [step(b, targets[1]) for _ in range(4)])
        other.start()
        step(a, targets[0])  # round 1 due: round 0 is waited for first, then recorded
        assert a.last_round is not None and a.last_round.round == 0
        assert a.last_round.mixed == ["p1"]
        other.join(timeout=60)
        finishing = threading.Thread(target=b.finish)
        finishing.start()
        a.finish()  # waits for round 1, then the last exchanges
        finishing.join(timeout=60)
        assert a.last_round.round == 1 and b.last_round.round == 1
        assert a.algorithm.edge("p1").mixed == b.algorithm.edge("p0").mixed == 2
    finally:
        for o in (a, b):
            o.close()


def test_an_error_in_a_background_round_is_raised_at_the_next_wait() -> None:
    bg: BackgroundRound[int] = BackgroundRound()
    bg.start(lambda: 7)
    with pytest.raises(RuntimeError, match="wait"):
        bg.start(lambda: 8)  # one at a time
    assert bg.wait() == 7 and bg.wait() is None

    def fails() -> int:
        raise ZeroDivisionError("in the round")

    bg.start(fails)
    with pytest.raises(ZeroDivisionError, match="in the round"):
        bg.wait()
    assert bg.wait() is None


def test_background_rounds_are_choco_only() -> None:
    with pytest.raises(ConfigError, match="background_rounds"):
        build_config({}, {"gossip.algorithm": "diloco", "gossip.background_rounds": "true"})
