"""A joiner's state download is one consistent snapshot, even while the donor trains.

The donor steps SGD with momentum 1 on a constant gradient of ones (lr 1), so after k steps,
exactly (small integers in float32): momentum buffer = k, parameters = p0 - k(k+1)/2. A blob
whose tensors were written while a step ran in place (serialised outside the state lock)
breaks that law. Real gRPC: the snapshots are downloaded as a joiner does.
"""

from __future__ import annotations

import io
import threading
import time

import grpc
import pytest
import torch
from gossipgrad.peer.config import build_config
from gossipgrad.peer.network import PeerClient, TransportError, TransportOptions, protocol
from gossipgrad.peer.network.protocol import STATE_CODEC
from gossipgrad.peer.runtime.donor import SNAPSHOT_PER_REQUESTER_S
from gossipgrad.peer.runtime.optimizer import GossipOptimizer
from gossipgrad.peer.runtime.state_stream import STATE_FORMAT, StateReader
from gossipgrad.proto import gossip_pb2 as pb
from support.peers import rejected
from torch import nn

NUMEL = 1 << 21  # 8 MB: serialising takes long enough for a step to land in the middle


def fetch(client: PeerClient, request: pb.StateRequest) -> tuple[pb.StateHeader, dict]:
    """Download and read a state as a joiner does: into tensors as it arrives (a request for
    format 1), or one torch.save blob (an older joiner's request, format 0)."""
    header, got = client.download_state(
        request, sink=lambda h: StateReader(h.payload_size) if h.state_format else None
    )
    assert header.state_format == request.state_format
    if isinstance(got, StateReader):
        return header, got.state()
    return header, torch.load(io.BytesIO(bytes(got)), weights_only=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state_format", [STATE_FORMAT, 0], ids=["streamed", "blob"])
def test_state_downloaded_during_training_is_one_consistent_snapshot(state_format: int) -> None:
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
            for i in range(12):  # twelve joiners (one requester gets one snapshot per 2 s)
                request = pb.StateRequest(
                    swarm=cfg.peer.swarm, requester=f"joiner{i}", state_format=state_format
                )
                header, state = fetch(client, request)
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


def lone_donor() -> tuple[GossipOptimizer, nn.Linear]:
    """A peer alone with its state to serve (SGD with momentum: optimizer state too), and its
    model, whose steps move that state on; rounds far apart, so none runs."""
    model = nn.Linear(64, 8, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=1.0)
    cfg = build_config(
        {}, {"peer.id": "donor", "metrics.enabled": False, "gossip.local_steps": 1_000_000}
    )
    return GossipOptimizer(model, opt, cfg), model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("state_format", [STATE_FORMAT, 0], ids=["streamed", "blob"])
def test_downloads_cancelled_in_a_loop_serialize_the_state_once_per_step(
    monkeypatch: pytest.MonkeyPatch, state_format: int
) -> None:
    """Finding 3: every state request serialized the whole state under the training lock,
    so a member asking and cancelling in a loop stalled training at the rate it could ask.
    Now a snapshot is taken once per (step, round) the training loop reports, and served to
    every request until the next one; so does torch.save: the snapshot's skeleton, and for
    an older joiner's request the blob it reads."""
    saves_per_snapshot = 1 if state_format else 2
    saves: list[int] = []
    real_save = torch.save

    def counting_save(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", counting_save)
    donor, model = lone_donor()
    cfg = donor.config
    request = pb.StateRequest(swarm=cfg.peer.swarm, requester="evil", state_format=state_format)
    channel = grpc.insecure_channel(donor.peer.address)
    download = channel.unary_stream(
        protocol.method_path(protocol.STATE),
        request_serializer=pb.StateRequest.SerializeToString,
        response_deserializer=STATE_CODEC.decode,
    )
    try:
        served = 0
        while served < 20:
            call = download(request, timeout=10)
            try:
                next(call)  # the header: the state was snapshotted for this request
            except grpc.RpcError as err:
                # "donor busy": the server has not yet seen the last two cancels (a loaded
                # host); a refused request is turned away before any snapshot is taken.
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                time.sleep(0.05)
                continue
            call.cancel()
            served += 1
        assert donor.peer.snapshots.serialized == 1
        assert len(saves) == saves_per_snapshot, len(saves)
        model.weight.grad = torch.ones_like(model.weight)
        donor.step()  # a new step: the next request takes a new snapshot
        joiner = pb.StateRequest(
            swarm=cfg.peer.swarm, requester="joiner", state_format=state_format
        )
        with PeerClient(donor.peer.address) as client:
            for _ in range(3):
                header, state = fetch(client, joiner)
                assert header.step == state["local_step"] == 1
        assert donor.peer.snapshots.serialized == 2
        assert len(saves) == 2 * saves_per_snapshot, len(saves)
    finally:
        channel.close()
        donor.close()


@pytest.mark.timeout(60)
def test_a_member_asking_for_the_state_every_step_gets_one_snapshot_per_interval() -> None:
    """A member asking for the state after every step of the donor took a new snapshot under
    the training lock each time (one per step). Now a requester gets a new snapshot at most
    once per SNAPSHOT_PER_REQUESTER_S: the others are refused ("donor busy", counted as
    rate_limited) while another joiner is still served a fresh one."""
    donor, model = lone_donor()
    cfg = donor.config
    evil = pb.StateRequest(swarm=cfg.peer.swarm, requester="evil", state_format=STATE_FORMAT)
    refused = served = 0
    try:
        with PeerClient(donor.peer.address, TransportOptions(retries=0)) as client:
            t0 = time.monotonic()
            for _ in range(20):
                model.weight.grad = torch.ones_like(model.weight)
                donor.step()  # a new step: the kept snapshot is stale
                try:
                    fetch(client, evil)
                    served += 1
                except TransportError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                    assert err.reason == "rate_limited"
                    refused += 1
            took = time.monotonic() - t0
            header, _ = fetch(client, pb.StateRequest(
                swarm=cfg.peer.swarm, requester="joiner", state_format=STATE_FORMAT
            ))  # fmt: skip
        snapshots = donor.peer.snapshots.serialized
    finally:
        donor.close()
    print(f"20 steps in {took:.2f} s: evil served {served}, refused {refused}; "
          f"{snapshots} snapshots in all")  # fmt: skip
    assert header.step == 20  # the other joiner gets the state as of now
    assert served <= 1 + took / SNAPSHOT_PER_REQUESTER_S, served
    assert refused == 20 - served
    assert snapshots == served + 1
    assert rejected(donor.peer, "rate_limited") >= refused
