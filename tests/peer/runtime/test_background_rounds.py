"""gossip.background_rounds: choco's and diloco's rounds run beside training, the training
thread waits only for the round before the next one, both ends still mix the same exchanges,
and diloco's progress made while its round runs lands in exactly one pseudo-gradient."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from gossipgrad.peer.algorithms.diloco import DiLoCo
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


def test_background_rounds_fit_choco_and_diloco_only() -> None:
    on = {"gossip.background_rounds": "true"}
    assert build_config({}, {"gossip.algorithm": "diloco", **on}).gossip.background_rounds
    with pytest.raises(ConfigError, match="background_rounds"):
        build_config({}, {"gossip.algorithm": "ef-gradient", **on})
    with pytest.raises(ConfigError, match="overlap"):
        build_config({}, {"gossip.algorithm": "diloco", "gossip.overlap": "true", **on})


@pytest.mark.parametrize("background", [False, True, "slow to keep θ"])
def test_diloco_counts_every_step_once_with_its_round_in_the_background(
    background: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two diloco peers, exact codecs, outer lr 1, SGD steps of a fixed size per peer
    (lr x g_i): every step's progress lands in exactly one pseudo-gradient, so after N steps
    each and finish() both anchors (and parameters) are a0 - N lr (g_0 + g_1) / 2, whether
    the phase ends run in the training thread or beside the next phase's steps. With them in
    the background, p0's phase end returns while p1 has not stepped and p0 trains on; the
    round's thread keeps θ at the phase's end, and the next optimizer step waits for it
    (a round's thread slow to take it: the step would otherwise land in it)."""
    if background == "slow to keep θ":
        keep = DiLoCo._keep_phase_end

        def slow_keep(self: DiLoCo) -> torch.Tensor:
            time.sleep(0.3)
            return keep(self)

        monkeypatch.setattr(DiLoCo, "_keep_phase_end", slow_keep)
    lr, steps = 0.05, 9  # H = 2: four whole phases and a partial one, settled by finish()
    a, b = start_optimizers(
        2,
        algorithm="diloco",
        lr=lr,
        local_steps=2,
        codec="none",
        anchor_codec="none",
        copy_dtype="float32",
        outer_lr=1.0,
        outer_momentum=0.0,
        background_rounds=bool(background),
        max_staleness=0,
    )
    try:
        a0 = a.flat.data.clone()
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(a.flat.numel, generator=gen) for _ in range(2)]

        def fixed_step(o, g: torch.Tensor) -> None:
            o.flat.set_grad(g)
            o.step()

        other = threading.Thread(target=lambda: [fixed_step(b, grads[1]) for _ in range(steps)])
        if background:
            fixed_step(a, grads[0])
            fixed_step(a, grads[0])  # phase 0 ends
            phase_end = a.flat.data.clone()
            fixed_step(a, grads[0])  # p1 has not stepped: the round waits, training does not
            assert a.local_step == 3 and a._background.running
            assert torch.equal(a.algorithm._phase_end, phase_end)  # θ_r, not after step 3
        other.start()
        while a.local_step < steps:
            fixed_step(a, grads[0])
        other.join(timeout=60)
        finishing = threading.Thread(target=b.finish)
        finishing.start()
        a.finish()
        finishing.join(timeout=60)
        expected = a0 - steps * lr * (grads[0] + grads[1]) / 2
        for o in (a, b):
            assert torch.allclose(o.algorithm.anchor, expected, atol=1e-5), o.peer.id
            assert torch.equal(o.flat.data, o.algorithm.anchor)
    finally:
        for o in (a, b):
            o.close()
