"""A joiner's state download is one consistent snapshot, even while the donor trains.

The donor steps SGD with momentum 1 on a constant gradient of ones (lr 1), so after k steps,
exactly (small integers in float32): momentum buffer = k, parameters = p0 - k(k+1)/2. A blob
whose tensors were written while a step ran in place (serialised outside the state lock)
breaks that law. Real gRPC: the snapshots are downloaded as a joiner does.
"""

from __future__ import annotations

import io
import threading

import grpc
import pytest
import torch
from gossipgrad.peer.config import build_config
from gossipgrad.peer.network import PeerClient, protocol
from gossipgrad.peer.network.protocol import STATE_CODEC
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from gossipgrad.proto import gossip_pb2 as pb
from torch import nn

NUMEL = 1 << 21  # 8 MB: serialising takes long enough for a step to land in the middle


@pytest.mark.timeout(120)
def test_state_downloaded_during_training_is_one_consistent_snapshot() -> None:
    torch.manual_seed(0)
    model = nn.Linear(NUMEL // 8, 8, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=1.0)
    cfg = build_config(
        {},
        {
            "peer.id": "donor",
            "metrics.enabled": False,
            "gossip.local_steps": 1_000_000,  # no rounds: nothing else touches the state
        },
    )
    donor = GossipOptimizer(model, opt, cfg)
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set() and donor.local_step < 3000:
            model.weight.grad = torch.ones_like(model.weight)
            donor.step()

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        steps: list[int] = []
        with PeerClient(donor.peer.address) as client:
            for _ in range(12):
                header, blob = client.download_state(
                    pb.StateRequest(swarm=cfg.peer.swarm, requester="joiner")
                )
                state = torch.load(io.BytesIO(bytes(blob)), weights_only=False)
                k = state["local_step"]
                params = state["params"]
                assert header.step == k
                assert torch.all(params == -k * (k + 1) / 2), (k, params.min().item())
                momentum = state["optimizer"]["state"]
                if k == 0:  # downloaded before the first step: no momentum yet
                    assert not momentum
                    continue
                steps.append(k)
                buf = next(iter(momentum.values()))["momentum_buffer"]
                assert torch.all(buf == k), (k, buf.min().item(), buf.max().item())
        assert len(set(steps)) > 1, f"the donor did not train meanwhile: {steps}"
    finally:
        stop.set()
        trainer.join(60)
        donor.close()


@pytest.mark.timeout(60)
def test_downloads_cancelled_in_a_loop_serialize_the_state_once_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding 3: every state request serialized the whole state under the training lock,
    so a member asking and cancelling in a loop stalled training at the rate it could ask.
    Now a snapshot is taken once per (step, round) the training loop reports, and served to
    every request until the next one."""
    saves: list[int] = []
    real_save = torch.save

    def counting_save(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", counting_save)
    model = nn.Linear(64, 8, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=1.0)
    cfg = build_config(
        {}, {"peer.id": "donor", "metrics.enabled": False, "gossip.local_steps": 1_000_000}
    )
    donor = GossipOptimizer(model, opt, cfg)
    request = pb.StateRequest(swarm=cfg.peer.swarm, requester="evil")
    channel = grpc.insecure_channel(donor.peer.address)
    download = channel.unary_stream(
        protocol.method_path(protocol.STATE),
        request_serializer=pb.StateRequest.SerializeToString,
        response_deserializer=STATE_CODEC.decode,
    )
    try:
        for _ in range(20):
            call = download(request, timeout=10)
            next(call)  # the header: the state was serialized for this request
            call.cancel()
        assert len(saves) == 1, len(saves)
        model.weight.grad = torch.ones_like(model.weight)
        donor.step()  # a new step: the next request takes a new snapshot
        with PeerClient(donor.peer.address) as client:
            for _ in range(3):
                header, blob = client.download_state(request)
                state = torch.load(io.BytesIO(bytes(blob)), weights_only=False)
                assert header.step == state["local_step"] == 1
        assert len(saves) == 2, len(saves)
    finally:
        channel.close()
        donor.close()
