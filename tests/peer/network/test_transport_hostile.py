"""Hostile bytes on every RPC get a specific status and a counted reason, never INTERNAL.

A raw gRPC client (identity serializers, so nothing is checked on our side) sends a seeded set
of random, garbled, truncated and extended messages to each method of a real server on
127.0.0.1. For every call:

* the status is never INTERNAL or UNKNOWN (which is what gRPC answers when its own request
  deserializer raises);
* a request that does not parse as the method's message ends INVALID_ARGUMENT with reason
  ``malformed`` in trailing metadata, and ``on_reject`` saw exactly that reason once;
* a request that parses reaches the handler, whose verdict is the answer (and ``on_reject``
  saw nothing: handler refusals are the handler's to count).
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from gossipgrad.peer.network import GossipServer, TransportOptions, UpdateRejected
from gossipgrad.peer.network.errors import REASON_METADATA_KEY
from gossipgrad.peer.network.framing import data_prefix
from gossipgrad.peer.security import TransportSecurity
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SWARM = "s"
METHOD = "/gossipgrad.v1.Gossip/"
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}


class SwarmCheck:
    """A handler that answers callers of swarm ``s`` and refuses everyone else."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def _check(self, swarm: str) -> None:
        with self.lock:
            self.calls += 1
        if swarm != SWARM:
            raise UpdateRejected(grpc.StatusCode.PERMISSION_DENIED, "unknown_swarm", swarm)

    def handle_update(self, header, payload, context_peer):
        self._check(header.swarm)
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def handle_heartbeat(self, request):
        self._check(request.swarm)
        return pb.HeartbeatReply(responder=pb.PeerInfo(id="server"))

    def handle_state_request(self, request):
        self._check(request.swarm)
        return pb.StateHeader(sender="server"), b"state" * 100


@pytest.fixture(scope="module")
def target():
    rejects: list[str] = []
    handler = SwarmCheck()
    opts = TransportOptions(peer_rate=0, max_streams_per_peer=0, chunk_size=64)
    server = GossipServer(
        handler, options=opts, on_reject=lambda reason, peer: rejects.append(reason)
    )
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, handler, rejects, channel
    finally:
        channel.close()
        server.stop(grace=0.5)


def _valid_requests() -> dict[str, bytes]:
    me = pb.PeerInfo(id="c", address="127.0.0.1:9", step=3, incarnation=77, metrics_address="x")
    beat = pb.HeartbeatRequest(swarm=SWARM, sender=me, known=[me, me], view_digest=2**63 + 5)
    state = pb.StateRequest(swarm=SWARM, requester="c")
    update = pb.WholeUpdate(
        header=pb.UpdateHeader(swarm=SWARM, sender="c", seq=4, payload_size=10), data=b"0" * 10
    )
    return {
        "Heartbeat": beat.SerializeToString(),
        "DownloadState": state.SerializeToString(),
        "PushWholeUpdate": update.SerializeToString(),
    }


#: Hand-written bytes that are no valid message of any kind: truncated varints and lengths,
#: a length past the end, an end-group tag, an invalid wire type, invalid UTF-8 in a string.
NASTY = [
    b"\xff",
    b"\xff\xff\xff",
    b"\x08\x80",
    b"\x0a\x05gos",
    b"\x12\x80\x80\x80\x80\x10",
    b"\x0c",
    b"\x0f\x00",
    b"\x0a\x02\xff\xfe",
    b"\x12\x04\x0a\x02\xc3\x28",
    b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01\x00",
]


def _garbled(valid: bytes, rng: random.Random) -> bytes:
    """One mutation of ``valid``: truncated, bit-flipped, extended, spliced or random."""
    op = rng.randrange(5)
    b = bytearray(valid)
    if op == 0:
        return bytes(b[: rng.randrange(len(b))])
    if op == 1:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op == 2:
        return bytes(b) + rng.randbytes(rng.randint(1, 16))
    if op == 3:
        cut = rng.randrange(len(b))
        return bytes(b[:cut]) + rng.randbytes(rng.randint(1, 8)) + bytes(b[cut:])
    return rng.randbytes(rng.randint(1, 64))


def _cases(method: str, n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    valid = _valid_requests()[method]
    return NASTY + [_garbled(valid, rng) for _ in range(n)]


def _parses(message_cls, raw: bytes) -> Message | None:
    """``raw`` as a request the handler sees: parsed, and for a whole update its header (with
    the payload it declares); None if the server must refuse it as malformed."""
    try:
        parsed = message_cls.FromString(raw)
    except DecodeError:
        return None
    if message_cls is pb.WholeUpdate:
        consistent = parsed.HasField("header") and parsed.header.payload_size == len(parsed.data)
        return parsed.header if consistent else None
    return parsed


def _reason(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ()).get(REASON_METADATA_KEY, "")


def _call(channel: grpc.Channel, method: str, raw: bytes) -> grpc.RpcError | None:
    """One raw call; the error it ended with, or None if it succeeded."""
    try:
        if method in ("Heartbeat", "PushWholeUpdate"):
            channel.unary_unary(METHOD + method)(raw, timeout=10)
        else:
            list(channel.unary_stream(METHOD + method)(raw, timeout=10))
    except grpc.RpcError as err:
        return err
    return None


@pytest.mark.parametrize(
    ("method", "message_cls"),
    [
        ("Heartbeat", pb.HeartbeatRequest),
        ("DownloadState", pb.StateRequest),
        ("PushWholeUpdate", pb.WholeUpdate),
    ],
)
def test_unary_requests_that_do_not_parse_are_invalid_argument_and_counted(
    target, method, message_cls
) -> None:
    _, handler, rejects, channel = target
    tally = {"malformed": 0, "handler": 0}
    for i, raw in enumerate(_cases(method, 300, seed=7)):
        before_rejects, before_calls = len(rejects), handler.calls
        err = _call(channel, method, raw)
        code = grpc.StatusCode.OK if err is None else err.code()
        assert code not in NEVER, (i, raw, code, err and err.details())
        parsed = _parses(message_cls, raw)
        if parsed is None:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (i, raw, code)
            assert _reason(err) == "malformed"
            assert rejects[before_rejects:] == ["malformed"], (i, raw)
            assert handler.calls == before_calls, "an unparsable request reached the handler"
            tally["malformed"] += 1
        else:
            ours = parsed.swarm == SWARM
            assert code == (grpc.StatusCode.OK if ours else grpc.StatusCode.PERMISSION_DENIED)
            assert len(rejects) == before_rejects
            assert handler.calls == before_calls + 1
            tally["handler"] += 1
    # Both branches were exercised, so the assertions above were not vacuous.
    assert tally["malformed"] >= 100 and tally["handler"] >= 20, tally


def _push_cases(seed: int, n: int) -> list[list[bytes]]:
    """Raw chunk streams: garbage headers, garbage chunks after a good header, and worse."""
    rng = random.Random(seed)
    head = pb.UpdateChunk(header=pb.UpdateHeader(swarm=SWARM, sender="c", payload_size=10))
    good = head.SerializeToString()
    data = data_prefix(10) + b"0123456789"
    streams = [[raw] for raw in NASTY] + [[good, raw] for raw in NASTY]
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            streams.append([_garbled(good, rng), data])
        elif kind == 1:
            streams.append([good, _garbled(data, rng)])
        else:
            streams.append([good, data[:5], _garbled(data[5:], rng)])
    return streams


def test_garbled_push_streams_get_a_specific_status_and_a_counted_reason(target) -> None:
    _, handler, rejects, channel = target
    push = channel.stream_unary(METHOD + "PushUpdate")
    seen: dict[grpc.StatusCode, int] = {}
    for i, stream in enumerate(_push_cases(seed=11, n=300)):
        before, calls = len(rejects), handler.calls
        try:
            push(iter(stream), timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            assert code not in NEVER, (i, stream, code, err.details())
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                reason = _reason(err)
                assert reason in ("malformed", "too_large"), (i, stream, reason)
                assert rejects[before:] == [reason], (i, stream)
                assert handler.calls == calls, "a refused stream reached the handler"
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (i, stream, code)
                assert handler.calls == calls + 1 and len(rejects) == before
        seen[code] = seen.get(code, 0) + 1
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) >= 100, seen


def test_server_still_serves_after_the_garbage(target) -> None:
    # On the very connection that carried all the garbage: gRPC leaves the HTTP/2 stream of a
    # call whose request deserializer raised open, so after ~32 of those a connection used
    # to refuse every new call (REFUSED_STREAM); parsing in the handler avoids that too.
    _, _, _, channel = target
    raw = _valid_requests()["Heartbeat"]
    reply = pb.HeartbeatReply.FromString(channel.unary_unary(METHOD + "Heartbeat")(raw, timeout=5))
    assert reply.responder.id == "server"


def test_a_caller_without_the_token_is_unauthenticated_whatever_it_sends() -> None:
    rejects: list[str] = []
    handler = SwarmCheck()
    server = GossipServer(
        handler,
        options=TransportOptions(peer_rate=0),
        on_reject=lambda reason, peer: rejects.append(reason),
        security=TransportSecurity(b"", b"", b"", token="s3cret"),
    )
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            for method in ("Heartbeat", "DownloadState", "PushWholeUpdate"):
                for raw in [*NASTY, _valid_requests()[method]]:
                    err = _call(channel, method, raw)
                    assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
            push = channel.stream_unary(METHOD + "PushUpdate")
            for stream in _push_cases(seed=3, n=10):
                with pytest.raises(grpc.RpcError) as info:
                    push(iter(stream), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(grace=0.5)
    calls = 3 * (len(NASTY) + 1) + len(_push_cases(seed=3, n=10))
    assert rejects == ["unauthenticated"] * calls
    assert handler.calls == 0
