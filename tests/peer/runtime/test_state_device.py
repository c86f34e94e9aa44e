"""The gossip state off the accelerator (``gossip.state_device``, issue 39): the algorithm
works on a host copy of the parameters that takes them before each round and gives them back
after, and a run gives the same bits as with the state beside the model.

On a CPU-only machine ``host`` is forced (the copy is then pointless, but the mechanism is
the same: another tensor the parameters cross to and from); the CUDA test checks that no
model-sized gossip buffer stays on the device."""

from __future__ import annotations

import pytest
import torch
from gossipgrad.peer.config import build_config
from support.optimizers import small_model, start_optimizers, train_concurrently
from torch import nn

pytestmark = pytest.mark.timeout(180)


def loss_of(i: int, model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    """Each peer fits its own constant (peers disagree, so gossip has something to do)."""
    device = next(model.parameters()).device
    x = torch.randn(16, 12, generator=gen).to(device)
    return (model(x) - float(i)).pow(2).mean()


def trained(algorithm: str, state_device: str, model_fn=small_model) -> list[torch.Tensor]:
    """Two peers, 12 steps each, rounds every 2 steps; their parameters at the end."""
    opts = start_optimizers(
        2,
        algorithm=algorithm,
        lr=0.05,
        model_fn=model_fn,
        state_device=state_device,
        max_staleness=1,
        local_steps=2,
    )
    try:
        on_host = [o.gossip_flat is not o.flat for o in opts]
        assert on_host == [state_device == "host"] * 2
        if state_device == "host":  # the algorithm's parameters are a copy, not the model's
            assert all(o.peer.flat is o.gossip_flat for o in opts)
            assert all(o.gossip_flat.data.data_ptr() != o.flat.data.data_ptr() for o in opts)
        train_concurrently(opts, loss_of, 12)
        return [o.flat.data.detach().cpu().clone() for o in opts]
    finally:
        for o in opts:
            o.close()


@pytest.mark.parametrize("algorithm", ["choco", "diloco", "exact-diloco"])
def test_state_on_the_host_gives_the_bits_of_state_beside_the_model(algorithm: str) -> None:
    """Each round's result reaches the model and each step's reaches the round: the final
    parameters equal, bit for bit, those of the same run with the state beside the model
    (these runs are deterministic: rounds wait for their exchange)."""
    beside = trained(algorithm, "model")
    host = trained(algorithm, "host")
    assert all(torch.equal(a, b) for a, b in zip(beside, host, strict=True))


def test_state_device_host_is_refused_where_rounds_leave_the_training_thread() -> None:
    for overrides in (
        {"gossip.algorithm": "ef-gradient"},
        {"gossip.algorithm": "choco", "gossip.background_rounds": True},
    ):
        with pytest.raises(ValueError, match="state_device = host"):
            build_config({}, {"gossip.state_device": "host", **overrides})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["choco", "diloco"])
def test_no_model_sized_gossip_buffer_stays_on_the_device(algorithm: str) -> None:
    """With the model on CUDA and the default ``auto``, the algorithm's state is in host
    memory, the device holds what plain training holds (model, gradients, optimizer) and no
    model more, and the run gives the bits of the same run with the state beside the model."""

    def on_cuda() -> nn.Module:
        return small_model().cuda()

    beside = trained(algorithm, "model", on_cuda)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opts = start_optimizers(2, algorithm=algorithm, lr=0.05, model_fn=on_cuda, local_steps=2)
    try:
        assert all(o.gossip_flat.data.device.type == "cpu" for o in opts)
        assert all(o.gossip_flat.data.is_pinned() for o in opts)
        model_bytes = opts[0].flat.nbytes
        train_concurrently(opts, loss_of, 12)
        torch.cuda.synchronize()
        state = opts[0].algorithm.state_dict()
        tensors = [t for t in _tensors(state)]
        assert tensors and all(t.device.type == "cpu" for t in tensors)
        # model + gradients + SGD (no momentum) for two peers; a gossip copy would add one
        # model per peer at least
        added = torch.cuda.memory_allocated() - before
        assert added < 2 * 2 * model_bytes + 0.5 * model_bytes, (added, model_bytes)
    finally:
        for o in opts:
            o.close()
    host = trained(algorithm, "auto", on_cuda)
    assert all(torch.equal(a, b) for a, b in zip(beside, host, strict=True))


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)
