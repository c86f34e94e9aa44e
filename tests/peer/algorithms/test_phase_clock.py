"""Phase lengths: every H steps, or QSR's H = max(H_base, floor((α/η)²)) as the lr decays.

Laws: without QSR a phase ends at every multiple of H; with it a phase is never shorter than
H_base, a smaller learning rate never gives a shorter phase, a rising one keeps H_base, and a
clock restored from its state ends the same phases. Real exact-diloco peers on 127.0.0.1 under
a decaying learning rate end their phases at the steps the rule gives, with identical anchors.
"""

from __future__ import annotations

import pytest
import torch
from gossipgrad.peer.algorithms.phase_clock import UNTIL_THE_END, PhaseClock, qsr_local_steps
from gossipgrad.peer.config import build_config
from hypothesis import given, settings
from hypothesis import strategies as st
from support.optimizers import start_optimizers
from support.threads import on_threads

pytestmark = pytest.mark.timeout(120)


def phase_ends(clock: PhaseClock, lrs: list[float]) -> list[int]:
    """The steps (1-based) that end a phase when step s runs at ``lrs[s - 1]``."""
    ends = []
    for step, lr in enumerate(lrs, start=1):
        if clock.due(step):
            ends.append(step)
            clock.ended(step, lr)
    return ends


@settings(max_examples=60, deadline=None)
@given(base=st.integers(1, 40), steps=st.integers(1, 300))
def test_without_qsr_every_multiple_of_h_ends_a_phase(base: int, steps: int) -> None:
    ends = phase_ends(PhaseClock(base), [0.1] * steps)
    assert ends == list(range(base, steps + 1, base))


@settings(max_examples=100, deadline=None)
@given(
    base=st.integers(1, 50),
    alpha=st.floats(1e-4, 1.0),
    lr_a=st.floats(1e-6, 1.0),
    lr_b=st.floats(1e-6, 1.0),
)
def test_qsr_length_is_at_least_h_and_grows_as_lr_falls(base, alpha, lr_a, lr_b) -> None:
    low, high = sorted((lr_a, lr_b))
    assert qsr_local_steps(base, alpha, high) >= base
    assert qsr_local_steps(base, alpha, low) >= qsr_local_steps(base, alpha, high)


def test_qsr_follows_the_rule_and_keeps_h_while_the_lr_rises() -> None:
    assert qsr_local_steps(10, 0.03, 0.003) == 100  # (0.03 / 0.003)² = 100
    assert qsr_local_steps(10, 0.03, 0.03) == 10  # (α/η)² = 1 < H_base
    assert qsr_local_steps(10, 0.03, 0.0) == UNTIL_THE_END
    clock = PhaseClock(10, qsr_alpha=0.03)
    assert clock.ended(10, 0.001) == 10  # the first phase end: nothing to compare with
    assert clock.ended(20, 0.002) == 10  # rising: a warm-up
    assert clock.ended(30, 0.003) == 10
    assert clock.ended(40, 0.003) == 100  # level or falling: the rule
    assert clock.end == 140 and not clock.due(139) and clock.due(140)
    assert clock.ended(140, 0.0015) == 400


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(1, 399))
def test_a_restored_clock_ends_the_same_phases(cut: int) -> None:
    # A cosine-like decay after a 40-step warm-up; a peer restarted (or a joiner) at step
    # ``cut`` with the clock's state ends the same phases as one that ran through.
    lrs = [0.01 * (s + 1) / 40 if s < 40 else 0.01 * (1 - (s - 40) / 400) for s in range(400)]
    whole = phase_ends(PhaseClock(5, qsr_alpha=0.03), lrs)
    first = PhaseClock(5, qsr_alpha=0.03)
    before = phase_ends(first, lrs[:cut])
    restored = PhaseClock(5, qsr_alpha=0.03)
    restored.load_state_dict(first.state_dict())
    after = [s for s in range(cut + 1, 401) if restored.due(s) and restored.ended(s, lrs[s - 1])]
    assert before + after == whole


def test_qsr_is_exact_dilocos_alone() -> None:
    assert build_config({}, {"gossip.algorithm": "exact-diloco", "gossip.qsr_alpha": 0.1})
    for algorithm in ("choco", "diloco", "ef-gradient"):
        with pytest.raises(ValueError, match="qsr_alpha"):
            build_config({}, {"gossip.algorithm": algorithm, "gossip.qsr_alpha": 0.1})


def test_real_peers_end_qsr_phases_together_with_identical_anchors() -> None:
    # 3 peers, H_base = 2, α = 0.2, a learning rate falling from 0.2 that each peer reads
    # from its own optimizer.
    n = 3
    opts = start_optimizers(
        n, algorithm="exact-diloco", topology="ring", codec="int8", local_steps=2, qsr_alpha=0.2
    )
    try:
        gen = torch.Generator().manual_seed(4)
        numel = opts[0].flat.numel
        lrs = [0.2, 0.2, 0.2, 0.2] + [0.1] * 4 + [0.05] * 20
        expected = phase_ends(PhaseClock(2, qsr_alpha=0.2), lrs)
        # H_base twice (the first end; then (0.2/0.2)² = 1 < 2), then (0.2/0.1)² = 4 and
        # (0.2/0.05)² = 16 steps.
        assert expected == [2, 4, 6, 10, 26]
        ends: list[int] = []
        for step, lr in enumerate(lrs, start=1):
            targets = [o.flat.data + 0.05 * torch.randn(numel, generator=gen) for o in opts]

            def work(o, target, lr=lr):
                for group in o.param_groups:
                    group["lr"] = lr
                with o.state_lock:
                    o.flat.data.copy_(target)
                    o.local_step += 1
                o.after_local_step()

            rounds = [o.round for o in opts]
            on_threads(work, zip(opts, targets, strict=True))
            if opts[0].round > rounds[0]:
                ends.append(step)
            assert len({o.round for o in opts}) == 1
            assert all(torch.equal(o.algorithm.anchor, opts[0].algorithm.anchor) for o in opts)
        assert ends == expected
        saved = opts[1].algorithm.state_dict()["clock"]
        assert saved == opts[0].algorithm.clock.state_dict() and saved["length"] == 16
    finally:
        for o in opts:
            o.close()
