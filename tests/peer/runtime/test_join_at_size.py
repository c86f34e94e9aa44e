"""A joiner's state download and the dense resync after it, at 24M parameters, in real
processes (scripts/bench_scale.py's join case: a donor with AdamW past the rounds whose edges
open from the shared initial model, a fresh joiner that downloads its state, then rounds).

The state arrives bit-identical, and neither end holds it twice: the donor sends from one
snapshot of the state's S bytes (its tensors copied under the training lock, serialized as
they are sent), the joiner reads the chunks into the tensors it loads. Before, the donor
held a clone of the parameters beside a torch.save blob of the state (S + M) and the joiner
the blob, grown as it arrived, beside the state loaded from it (3 S at its peak).
"""

from __future__ import annotations

import argparse

import pytest

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("scripts_on_path")]

NUMEL = 24_000_000

#: What a process adds beside the state while a download runs, whatever the model's size:
#: gRPC's buffers and threads, the skeleton (measured: 17 MB at the joiner, 5 MB at the donor).
FIXED_BYTES = 32 << 20


@pytest.mark.slow
def test_a_joiner_downloads_the_state_bit_identical_and_in_bounded_memory() -> None:
    import bench_scale

    args = argparse.Namespace(set={}, timeout=300.0)
    got = bench_scale.run_join_case(args, NUMEL, "choco")
    m = got["model_bytes"]
    s = got["state_over_model"]  # parameters and AdamW's two moments: 3 models
    assert s == pytest.approx(3.0, abs=0.01), got
    assert got["identical"], got  # parameters, moments, steps and counters, bit for bit
    # The state once at each end, plus a tenth of a model and a fixed part.
    bound = s + 0.1 + FIXED_BYTES / m
    assert got["donor_peak_over_model"] <= bound, got
    assert got["joiner_peak_over_model"] <= bound, got
    # Then each side's first exchange on the new edge is a dense copy of its parameters: it
    # arrived bit for bit (the edge verifies the copy's checksum before the round mixes it).
    # On top of the new edge's state (2 M) each process holds at most the payload it sends
    # (M), the receive buffer of the one it gets as it grows (1.5 M), decoded straight into
    # the mirror (tests/peer/algorithms/test_resync_at_size.py), and the round's difference
    # buffer (M). Before, the decoded copy beside the mirror added a model (6.1 M measured).
    assert got["resyncs"] >= 1 and got["resync_mixed"], got
    bound = got["edge_state_over_model"] + 1 + 1.5 + 1 + FIXED_BYTES / m
    assert got["resync_peak_over_model"] <= bound, got
