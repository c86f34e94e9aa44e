"""Error feedback: nothing the compressor drops is lost, and the state checkpoints."""

from __future__ import annotations

import pytest
import torch
from gossipgrad.compression import ErrorFeedback, TopK, from_spec
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)

EF_SPECS = [
    "topk:0.1+int8",
    "topk:0.05",
    "randomk:0.2+fp16",
    "sign",
    "int4:sr",
    "qsgd:2",
    "int2",
    "int2:sr:block=16",
    "topk:0.1+int2",
    "chunktopk:0.1:block=16",
    "chunktopk:0.05:block=64+int2",
]


@pytest.mark.parametrize("spec", EF_SPECS)
@given(
    steps=st.integers(1, 6),
    n=st.integers(1, 400),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=25, deadline=None, derandomize=True)
def test_sent_plus_residual_equals_fed(spec: str, steps: int, n: int, seed: int) -> None:
    codec = from_spec(spec)
    ef = ErrorFeedback(codec)
    g = torch.Generator().manual_seed(seed)
    fed = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        grad = torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-3, 3, (1,), generator=g))
        fed += grad.double()
        data = ef.compress("w", grad, seed=step)
        sent += codec.decode(data).double()
    total = sent + ef.residual("w").double()
    tol = 1e-5 * float(fed.abs().max() + sent.abs().max()) + 1e-12
    assert float((total - fed).abs().max()) <= tol


def test_residual_carries_what_topk_dropped() -> None:
    ef = ErrorFeedback(TopK(0.25))
    g = torch.tensor([4.0, 3.0, 2.0, 1.0])
    first = from_spec("topk:0.25").decode(ef.compress("p", g))
    assert first.tolist() == [4.0, 0.0, 0.0, 0.0]
    assert ef.residual("p").tolist() == [0.0, 3.0, 2.0, 1.0]
    second = from_spec("topk:0.25").decode(ef.compress("p", torch.zeros(4)))
    assert second.tolist() == [0.0, 3.0, 0.0, 0.0]  # sent later, not lost


def test_half_precision_gradients_keep_float32_residual() -> None:
    ef = ErrorFeedback(from_spec("topk:0.5+int8"))
    ef.compress("h", torch.tensor([1e-4, 2.0, 3.0, 1e-5], dtype=torch.bfloat16))
    assert ef.residual("h").dtype == torch.float32


def test_state_dict_round_trip_and_validation() -> None:
    codec = from_spec("topk:0.1+int8")
    ef = ErrorFeedback(codec)
    for i in range(3):
        ef.compress("a", torch.randn(100, generator=torch.Generator().manual_seed(i)), seed=i)
        ef.compress("b", torch.randn(7, 3, generator=torch.Generator().manual_seed(9 + i)))
    sd = ef.state_dict()
    restored = ErrorFeedback(from_spec("topk:0.1+int8"))
    restored.load_state_dict(sd)
    assert restored.names() == ["a", "b"]
    grad = torch.randn(100, generator=torch.Generator().manual_seed(5))
    assert restored.compress("a", grad, seed=7) == ef.compress("a", grad, seed=7)
    assert torch.equal(restored.residual("a"), ef.residual("a"))
    sd["residuals"]["a"].add_(1.0)  # state_dict holds copies
    assert not torch.equal(sd["residuals"]["a"], ef.residual("a"))
    with pytest.raises(ValueError, match="saved with codec"):
        ErrorFeedback(from_spec("int8")).load_state_dict(sd)
    with pytest.raises(ValueError, match="residuals"):
        restored.load_state_dict({"codec": "topk:0.1+int8", "residuals": {"a": [1.0]}})


def test_mismatched_gradient_and_non_finite_leave_state_alone() -> None:
    ef = ErrorFeedback(from_spec("topk:0.5"))
    ef.compress("w", torch.ones(4))
    before = ef.residual("w").clone()
    with pytest.raises(ValueError, match="does not match"):
        ef.compress("w", torch.ones(5))
    with pytest.raises(ValueError, match="NaN"):
        ef.compress("w", torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    assert torch.equal(ef.residual("w"), before)
    ef.reset("w")
    with pytest.raises(KeyError):
        ef.residual("w")


@pytest.mark.parametrize("spec", ["topk:0.2+int2", "topk:0.01+int8", "sign", "int8"])
def test_the_residual_norm_is_the_norm_of_the_residual(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``residual_norm`` (read off the slices ``compress_difference`` adds, for a sparse
    codec) is ||residual|| after every way the residual changes: a difference, a gradient,
    bytes put back, a state loaded, a reset."""
    monkeypatch.setattr("gossipgrad.compression.error_feedback.CHUNK", 1000)
    gen = torch.Generator().manual_seed(5)
    ef = ErrorFeedback(from_spec(spec))

    def norm() -> float:
        return float(torch.linalg.vector_norm(ef.residual("v")))

    assert ef.residual_norm("v") == 0.0
    a, b = torch.randn(4321, generator=gen), torch.randn(4321, generator=gen)
    data = b""
    for seed in (1, 2, 3):
        data = ef.compress_difference("v", a, b, seed=seed)
        assert ef.residual_norm("v") == pytest.approx(norm(), rel=1e-4)
        a.add_(torch.randn(4321, generator=gen), alpha=0.3)
    ef.put_back("v", data)
    assert ef.residual_norm("v") == pytest.approx(norm(), rel=1e-4)
    ef.compress("v", torch.randn(4321, generator=gen), seed=4)
    assert ef.residual_norm("v") == pytest.approx(norm(), rel=1e-4)
    state = ef.state_dict()
    ef.compress_difference("v", a, b, seed=5)
    ef.load_state_dict(state)
    assert ef.residual_norm("v") == pytest.approx(norm(), rel=1e-4)
    ef.reset()
    assert ef.residual_norm("v") == 0.0
