"""The gossip state at a real model size follows peer/algorithms/footprint.py's formula.

Two peer processes on 127.0.0.1 (scripts/bench_scale.py's swarm: square linear layers, SGD,
a quadratic objective per peer) train a 24M-parameter model and a 4M one. A process's
resident memory holds, besides the gossip state, a fixed part (threads, gRPC, allocator,
codec tables) that does not grow with the model; so the test compares the growth between
the two sizes, per byte of model, with the formula's: within 10 % for choco; within 15 % for
diloco, whose compressed messages held between rounds (its own pseudo-gradient, the
neighbours' until they are applied, an anchor update until acknowledged, and their receive
buffers: a tenth of a model or so at top-20 %) grow with the model too. The rounds' transients
(peak) stay within the formula plus what footprint.py documents for a round: 2 models of the
difference and its magnitudes, and for diloco's top-20 % codec 2 more of index coding. And the
training converges while gossip runs: every peer's loss falls to under half, and every
measured round mixed with the neighbour. A checkpoint of the state adds under half a model.
"""

from __future__ import annotations

import argparse

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("scripts_on_path")]

SMALL, LARGE = 4_000_000, 24_000_000


def swarm(numel: int, algorithm: str, overrides: dict[str, str]) -> list[dict]:
    import bench_scale

    args = argparse.Namespace(
        peers=2,
        rounds=4,
        local_steps={"choco": 1, "diloco": 5},
        accelerator_ms=20.0,
        set=overrides,
        timeout=300.0,
    )
    return bench_scale.run_case(args, numel, algorithm)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overrides", "formula", "tolerance", "transient"),
    [
        ("choco", {}, 2.0, 0.10, 2.5),
        ("diloco", {}, 3.0, 0.15, 4.5),
        ("diloco", {"gossip.background_rounds": "true"}, 4.0, 0.15, 4.5),
    ],
    ids=["choco", "diloco", "diloco-background"],
)
def test_gossip_state_grows_with_the_model_as_the_formula_says(
    algorithm: str, overrides: dict[str, str], formula: float, tolerance: float, transient: float
) -> None:
    """choco on a ring of 2 (one edge, float32 copies): 2 models; diloco (anchor, residual,
    one edge of float16 anchor copies, no momentum): 1 + 1 + 1 = 3 models, and with its phase
    ends in the background the parameters at the phase's end: 4."""
    small, large = swarm(SMALL, algorithm, overrides), swarm(LARGE, algorithm, overrides)
    for peer in small + large:
        assert peer["formula_over_model"] == pytest.approx(formula)
        assert peer["final_loss"] < peer["initial_loss"] / 2, peer
        assert peer["rounds_mixed"] >= peer["rounds"] - 1, peer
    for s, big in zip(small, large, strict=True):
        grown = big["trimmed_over_model"] * big["model_bytes"]
        grown -= s["trimmed_over_model"] * s["model_bytes"]
        per_model_byte = grown / (big["model_bytes"] - s["model_bytes"])
        assert per_model_byte == pytest.approx(formula, rel=tolerance), (s, big)
        assert big["peak_over_model"] <= formula + transient, big
        # A checkpoint streams to its file: no serialized copy of the state (formula + 1
        # models and more) beside it while it is written.
        assert big["checkpoint_memory_over_model"] < 0.5, big
