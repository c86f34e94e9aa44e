"""The gRPC transport over real servers on 127.0.0.1 port 0: limits, errors, deadlines, retries."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import socket
import threading
import time

import grpc
import pytest
from gossipgrad.peer.network import (
    GossipServer,
    PeerClient,
    TransportError,
    TransportOptions,
    UpdateRejected,
    push_wire_bytes,
)
from gossipgrad.proto import gossip_pb2 as pb
from gossipgrad.proto import gossip_pb2_grpc as pb_grpc

MiB = 1 << 20


def _bytes(n: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (fast for tens of MB)."""
    block = hashlib.sha256(seed.to_bytes(8, "little")).digest() * 2048  # 64 KiB
    reps = -(-n // len(block))
    out = bytearray(block * reps)[:n]
    for i in range(0, n, 4099):  # break the period so misplaced chunks are caught
        out[i] = (i * 31 + seed) & 0xFF
    return bytes(out)


class Recorder:
    """A handler that records what arrives and can be told to fail or stall."""

    def __init__(self, state: bytes = b"") -> None:
        self.updates: list[tuple[pb.UpdateHeader, bytes, str]] = []
        self.kept: list[memoryview] = []
        self.keep_payload = False
        self.raise_exc: Exception | None = None
        self.stall: threading.Event | None = None
        self.entered = threading.Event()
        self.state = state
        self.lock = threading.Lock()

    def handle_update(
        self, header: pb.UpdateHeader, payload: memoryview, context_peer: str
    ) -> pb.PushReply:
        self.entered.set()
        if self.stall is not None:
            self.stall.wait(20)
        if self.raise_exc is not None:
            raise self.raise_exc
        with self.lock:
            self.updates.append((header, bytes(payload), context_peer))
            if self.keep_payload:
                self.kept.append(payload)
        return pb.PushReply(status=pb.PushReply.ACCEPTED, expected_seq=header.seq + 1)

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        if self.raise_exc is not None:
            raise self.raise_exc
        return pb.HeartbeatReply(
            responder=pb.PeerInfo(id="server", address="127.0.0.1:1"),
            known=[request.sender, *request.known],
        )

    def handle_state_request(self, request: pb.StateRequest) -> tuple[pb.StateHeader, bytes]:
        if self.raise_exc is not None:
            raise self.raise_exc
        return pb.StateHeader(sender="server", step=7, round=3, model_fingerprint="fp"), self.state


FAST = TransportOptions(
    retries=0, push_timeout=10.0, heartbeat_timeout=5.0, state_timeout=10.0, server_threads=4
)


@pytest.fixture
def servers():
    """Factory of started servers, all stopped at teardown."""
    started: list[GossipServer] = []

    def make(
        handler, options: TransportOptions = FAST, server_cls=GossipServer, **kw
    ) -> GossipServer:
        s = server_cls(handler, bind="127.0.0.1:0", options=options, **kw)
        s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(grace=0.5)


@pytest.fixture
def clients():
    made: list[PeerClient] = []

    def make(address: str, options: TransportOptions = FAST) -> PeerClient:
        c = PeerClient(address, options=options)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _header(seq: int = 0, size: int = 0) -> pb.UpdateHeader:
    return pb.UpdateHeader(
        swarm="s", sender="a", receiver="b", seq=seq, kind=pb.DELTA, payload_size=size
    )


# ------------------------------------------------------------------------------ round trips


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [0, 1, 1000, MiB, 10_000_001])
def test_push_round_trip_intact(servers, clients, size):
    rec = Recorder()
    server = servers(rec)
    client = clients(server.address)
    payload = _bytes(size, seed=size)
    result = client.push_detailed(_header(seq=5), payload)
    assert result.reply.status == pb.PushReply.ACCEPTED
    assert result.reply.expected_seq == 6
    assert result.attempts == 1
    (header, got, peer), *_ = rec.updates
    assert got == payload
    assert header.payload_size == size and header.seq == 5 and header.sender == "a"
    assert peer.startswith("ipv4:127.0.0.1:")
    expected_wire = push_wire_bytes(header, size, FAST.chunk_size)
    assert result.wire_bytes == expected_wire == client.last_push_wire_bytes
    assert expected_wire >= size + header.ByteSize()


class MethodLog(grpc.GenericRpcHandler):
    """The server's own handlers, logging each method asked for; ``unserved`` methods are
    answered UNIMPLEMENTED, as by a server of a version that has no such method."""

    def __init__(self, inner: grpc.GenericRpcHandler, unserved: tuple[str, ...] = ()) -> None:
        self.inner = inner
        self.unserved = unserved
        self.methods: list[str] = []

    def service(self, details):
        method = details.method.rsplit("/", 1)[-1]
        self.methods.append(method)
        return None if method in self.unserved else self.inner.service(details)


class LoggedServer(GossipServer):
    """A real GossipServer whose calls are logged by method (:class:`MethodLog`)."""

    unserved: tuple[str, ...] = ()

    def _rpc_handlers(self) -> MethodLog:
        self.log = MethodLog(super()._rpc_handlers(), self.unserved)
        return self.log


class OlderServer(LoggedServer):
    """A server as of before PushWholeUpdate: it takes updates only as a stream."""

    unserved = ("PushWholeUpdate",)


@pytest.mark.timeout(60)
def test_an_update_that_fits_one_chunk_goes_in_one_unary_call(servers, clients):
    opts = TransportOptions(retries=0, chunk_size=4096)
    rec = Recorder()
    server = servers(rec, opts, server_cls=LoggedServer)
    client = clients(server.address, opts)
    head = len(pb.UpdateChunk(header=_header(seq=5, size=4000)).SerializeToString())
    fits = 4096 - head - 3  # the data chunk's prefix: tag and a 2-byte varint length
    payloads = [_bytes(100, seed=1), _bytes(fits, seed=2), _bytes(fits + 1, seed=3)]
    for payload in payloads:
        client.push(_header(seq=5), payload)
    assert server.log.methods == ["PushWholeUpdate", "PushWholeUpdate", "PushUpdate"]
    assert [data for _, data, _ in rec.updates] == payloads


@pytest.mark.timeout(60)
def test_an_older_peer_without_the_unary_push_is_streamed_to(servers, clients):
    rec = Recorder()
    server = servers(rec, server_cls=OlderServer)
    client = clients(server.address)
    small = [_bytes(50, seed=s) for s in range(3)]
    replies = [client.push(_header(seq=seq), p) for seq, p in enumerate(small)]
    assert [r.status for r in replies] == [pb.PushReply.ACCEPTED] * 3
    assert [data for _, data, _ in rec.updates] == small
    # Asked once; streamed to from then on.
    assert server.log.methods == ["PushWholeUpdate", "PushUpdate", "PushUpdate", "PushUpdate"]
    assert client.last_push_wire_bytes == push_wire_bytes(rec.updates[-1][0], 50, MiB) + 5


@pytest.mark.timeout(60)
def test_push_accepts_memoryview_and_small_chunks(servers, clients):
    opts = TransportOptions(retries=0, chunk_size=4096)
    rec = Recorder()
    server = servers(rec, opts)
    client = clients(server.address, opts)
    payload = _bytes(100_003, seed=3)
    client.push(_header(size=len(payload)), memoryview(payload))
    assert rec.updates[0][1] == payload


@pytest.mark.timeout(60)
def test_concurrent_pushes_do_not_mix(servers, clients):
    rec = Recorder()
    server = servers(rec)
    client = clients(server.address)
    payloads = {seq: _bytes(MiB + seq * 1000, seed=seq) for seq in range(8)}
    threads = [
        threading.Thread(target=client.push, args=(_header(seq=seq), p))
        for seq, p in payloads.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = {h.seq: data for h, data, _ in rec.updates}
    assert got == payloads


@pytest.mark.timeout(60)
def test_kept_payload_is_never_overwritten_and_free_buffers_are_reused(servers, clients):
    rec = Recorder()
    server = servers(rec)
    client = clients(server.address)
    first, second = _bytes(3 * MiB, seed=1), _bytes(3 * MiB, seed=2)
    rec.keep_payload = True
    client.push(_header(seq=0), first)
    rec.keep_payload = False
    client.push(_header(seq=1), second)
    client.push(_header(seq=2), second)
    # The kept view still shows the first payload: its buffer was not handed out again.
    assert bytes(rec.kept[0]) == first
    # The unkept buffer went back to the pool.
    assert server._pool.idle_bytes >= 3 * MiB


@pytest.mark.timeout(30)
def test_heartbeat_round_trip(servers, clients):
    server = servers(Recorder())
    client = clients(server.address)
    me = pb.PeerInfo(id="c", address="127.0.0.1:2", step=4, incarnation=9)
    other = pb.PeerInfo(id="d", address="127.0.0.1:3")
    reply = client.heartbeat(pb.HeartbeatRequest(swarm="s", sender=me, known=[other]))
    assert reply.responder.id == "server"
    assert list(reply.known) == [me, other]


@pytest.mark.timeout(60)
def test_state_download_larger_than_grpc_message_cap(servers, clients):
    state = _bytes(9 * MiB + 17, seed=9)
    server = servers(Recorder(state=state))
    client = clients(server.address)
    header, blob = client.download_state(pb.StateRequest(swarm="s", requester="c"))
    assert blob == state
    assert (header.sender, header.step, header.round) == ("server", 7, 3)
    assert header.payload_size == len(state)
    assert client.last_state_wire_bytes > len(state)


@pytest.mark.timeout(30)
def test_state_larger_than_client_limit_is_refused(servers, clients):
    server = servers(Recorder(state=_bytes(2 * MiB, seed=4)))
    client = clients(server.address, TransportOptions(retries=0, max_state_bytes=MiB))
    with pytest.raises(TransportError) as info:
        client.download_state(pb.StateRequest(swarm="s"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.reason == "too_large"


# ------------------------------------------------------------------------------ limits


@pytest.mark.timeout(60)
def test_oversized_push_is_refused_and_server_stays_up(servers, clients):
    rec = Recorder()
    rejects: list[tuple[str, str]] = []
    opts = TransportOptions(retries=0, max_payload_bytes=MiB)
    server = servers(rec, opts, on_reject=lambda reason, peer: rejects.append((reason, peer)))
    client = clients(server.address)
    with pytest.raises(UpdateRejected) as info:
        client.push(_header(), _bytes(MiB + 1, seed=1))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.reason == "too_large"
    assert "exceeds" in info.value.detail
    assert rec.updates == []
    assert [r for r, _ in rejects] == ["too_large"]
    # Still serving: a payload at the limit goes through.
    client.push(_header(seq=1), _bytes(MiB, seed=2))
    assert len(rec.updates) == 1


def _raw_push(address: str, chunks: list[pb.UpdateChunk], timeout: float = 10.0):
    """Push with the generated stub and protobuf-wrapped chunks (no fast path)."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.GossipStub(channel).PushUpdate(iter(chunks), timeout=timeout)


@pytest.mark.timeout(30)
def test_huge_declared_size_is_refused_before_allocating(servers):
    rec = Recorder()
    server = servers(rec)
    # 2**60 bytes could never be allocated: getting RESOURCE_EXHAUSTED (not INTERNAL from a
    # MemoryError) shows the header is checked before any buffer exists.
    chunks = [pb.UpdateChunk(header=_header(size=1 << 60)), pb.UpdateChunk(data=b"x")]
    with pytest.raises(grpc.RpcError) as info:
        _raw_push(server.address, chunks)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("gossipgrad-reject-reason", "too_large") in info.value.trailing_metadata()


def _data(n: int) -> pb.UpdateChunk:
    return pb.UpdateChunk(data=bytes(range(256)) * (n // 256) + bytes(n % 256))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("chunks", "detail"),
    [
        ([pb.UpdateChunk(header=_header(size=1000)), _data(600)], "600 bytes"),
        ([pb.UpdateChunk(header=_header(size=1000)), _data(600), _data(600)], "longer"),
        ([pb.UpdateChunk(header=_header(size=10))], "0 bytes"),
        ([_data(10), pb.UpdateChunk(header=_header(size=10))], "not an UpdateHeader"),
        ([], "empty stream"),
        ([pb.UpdateChunk()], "neither"),
        (
            [pb.UpdateChunk(header=_header(size=10)), pb.UpdateChunk(header=_header(size=10))],
            "second header",
        ),
    ],
    ids=["short", "long", "no-data", "data-first", "empty", "blank-chunk", "two-headers"],
)
def test_malformed_streams_are_refused(servers, chunks, detail):
    rec = Recorder()
    rejects: list[str] = []
    server = servers(rec, on_reject=lambda reason, peer: rejects.append(reason))
    with pytest.raises(grpc.RpcError) as info:
        _raw_push(server.address, chunks)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail in info.value.details()
    assert rejects == ["malformed"]
    assert rec.updates == []


@pytest.mark.timeout(30)
def test_protobuf_wrapped_chunks_from_generated_stub_are_accepted(servers):
    rec = Recorder()
    server = servers(rec)
    payload = _bytes(300_000, seed=6)
    chunks = [pb.UpdateChunk(header=_header(size=len(payload)))]
    chunks += [pb.UpdateChunk(data=payload[i : i + 65536]) for i in range(0, len(payload), 65536)]
    reply = _raw_push(server.address, chunks)
    assert reply.status == pb.PushReply.ACCEPTED
    assert rec.updates[0][1] == payload


@pytest.mark.timeout(30)
def test_client_refuses_header_that_contradicts_payload(servers, clients):
    server = servers(Recorder())
    client = clients(server.address)
    with pytest.raises(ValueError, match="payload_size"):
        client.push(_header(size=5), b"abc")


# ------------------------------------------------------------------------------ errors


@pytest.mark.timeout(30)
def test_handler_rejection_reaches_client_with_code_reason_and_detail(servers, clients):
    rec = Recorder()
    rec.raise_exc = UpdateRejected(
        grpc.StatusCode.FAILED_PRECONDITION, "fingerprint", "model fingerprint 'x' != ours 'y'"
    )
    server = servers(rec)
    client = clients(server.address)
    with pytest.raises(UpdateRejected) as info:
        client.push(_header(), b"payload")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.reason == "fingerprint"
    assert info.value.detail == "model fingerprint 'x' != ours 'y'"
    # A grpc.RpcError like any failed call, so `err.code()` branches keep working.
    assert isinstance(info.value, grpc.RpcError)
    assert info.value.details() == info.value.detail
    with pytest.raises(UpdateRejected) as info:
        client.heartbeat(pb.HeartbeatRequest(swarm="s"))
    assert info.value.reason == "fingerprint"
    with pytest.raises(UpdateRejected) as info:
        client.download_state(pb.StateRequest(swarm="s"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.timeout(30)
def test_handler_crash_is_internal_and_server_stays_up(servers, clients):
    rec = Recorder()
    rec.raise_exc = RuntimeError("boom")
    server = servers(rec)
    client = clients(server.address)
    with pytest.raises(TransportError) as info:
        client.push(_header(), b"payload")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert not isinstance(info.value, UpdateRejected)
    assert "RuntimeError" in info.value.detail
    rec.raise_exc = None
    assert client.push(_header(seq=1), b"ok").status == pb.PushReply.ACCEPTED


@pytest.mark.timeout(30)
def test_state_handler_size_mismatch_is_internal(servers, clients):
    class Liar(Recorder):
        def handle_state_request(self, request):
            return pb.StateHeader(payload_size=10), b"12345"

    server = servers(Liar())
    client = clients(server.address)
    with pytest.raises(TransportError) as info:
        client.download_state(pb.StateRequest(swarm="s"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert client.heartbeat(pb.HeartbeatRequest(swarm="s")).responder.id == "server"


def test_unknown_reject_reason_is_a_programming_error():
    with pytest.raises(ValueError, match="reject reason"):
        UpdateRejected(grpc.StatusCode.INVALID_ARGUMENT, "whatever", "x")
    with pytest.raises(ValueError, match="OK"):
        UpdateRejected(grpc.StatusCode.OK, "malformed", "x")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1 here")
def test_ipv6_loopback(clients):
    rec = Recorder()
    server = GossipServer(rec, bind="[::1]:0", options=FAST)
    server.start()
    try:
        assert server.address == f"[::1]:{server.port}"
        clients(server.address).push(_header(), b"over ipv6")
        assert rec.updates[0][2].startswith("ipv6:")
    finally:
        server.stop(grace=0.5)


def test_second_server_on_a_taken_port_fails(servers):
    first = servers(Recorder())
    with pytest.raises(OSError):
        GossipServer(Recorder(), bind=f"127.0.0.1:{first.port}", options=FAST).start()


def test_options_validate():
    with pytest.raises(ValueError, match="max_message_bytes"):
        TransportOptions(chunk_size=8 * MiB)
    with pytest.raises(ValueError, match="retry_codes"):
        TransportOptions(retry_codes=("NOPE",))
    with pytest.raises(ValueError, match="push_timeout"):
        TransportOptions(push_timeout=0)


# ------------------------------------------------------------------------------ deadlines, retries


@pytest.mark.timeout(30)
def test_deadline_on_hanging_handler(servers, clients):
    rec = Recorder()
    rec.stall = threading.Event()
    server = servers(rec)
    client = clients(server.address, TransportOptions(retries=3))
    try:
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            client.push(_header(), b"x" * 1000, timeout=0.5)
        elapsed = time.monotonic() - started
    finally:
        rec.stall.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.attempts == 1  # DEADLINE_EXCEEDED is not retried
    assert 0.45 <= elapsed < 3.0


@pytest.mark.timeout(30)
def test_no_server_fails_fast_without_retries(clients):
    probe = GossipServer(Recorder())
    probe.start()
    address = probe.address
    probe.stop(grace=0)
    client = clients(address)
    started = time.monotonic()
    with pytest.raises(TransportError) as info:
        client.heartbeat(pb.HeartbeatRequest(swarm="s"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 3.0
    # Nothing listens there: a definite answer, told at once (no retries by default).
    assert info.value.refused and info.value.attempts == 1, info.value
    with pytest.raises(TransportError) as info:
        client.push(_header(), b"to nobody", timeout=10)
    assert info.value.refused and info.value.attempts == 1, info.value
    # A deadline is not a refusal.
    assert not TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, "", "Connection refused").refused


@pytest.mark.timeout(60)
def test_push_retries_until_server_restarts_on_same_port(clients):
    first = GossipServer(Recorder(), options=FAST)
    port = first.start()
    first.stop(grace=0)
    rec = Recorder()
    second = GossipServer(rec, bind=f"127.0.0.1:{port}", options=FAST)
    restarter = threading.Timer(0.8, second.start)
    opts = TransportOptions(retries=50, backoff_initial=0.05, backoff_max=0.2, retry_refused=True)
    client = clients(f"127.0.0.1:{port}", opts)
    restarter.start()
    try:
        result = client.push_detailed(_header(), b"after restart", timeout=20)
    finally:
        restarter.join()
        second.stop(grace=0.5)
    assert result.reply.status == pb.PushReply.ACCEPTED
    assert result.attempts > 1
    assert rec.updates[0][1] == b"after restart"


@pytest.mark.timeout(30)
def test_graceful_stop_finishes_in_flight_push_then_refuses(clients):
    rec = Recorder()
    rec.stall = threading.Event()
    server = GossipServer(rec, options=FAST)
    server.start()
    client = clients(server.address)
    outcome: list[object] = []
    pusher = threading.Thread(
        target=lambda: outcome.append(client.push(_header(), b"in flight", timeout=20))
    )
    pusher.start()
    assert rec.entered.wait(10)
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 10.0})
    stopper.start()
    time.sleep(0.3)
    assert stopper.is_alive()  # waiting for the in-flight call
    rec.stall.set()
    pusher.join(10)
    stopper.join(10)
    assert not stopper.is_alive()
    assert outcome and outcome[0].status == pb.PushReply.ACCEPTED
    with pytest.raises(TransportError) as info:
        client.push(_header(seq=1), b"too late", timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    server.stop()  # idempotent


# ------------------------------------------------------------------------------ two processes


def _serve_in_child(queue, stop) -> None:  # runs in a spawned process
    class Echo:
        def handle_update(self, header, payload, context_peer):
            digest = hashlib.sha256(payload).hexdigest()
            return pb.PushReply(status=pb.PushReply.ACCEPTED, detail=digest)

        def handle_heartbeat(self, request):
            return pb.HeartbeatReply()

        def handle_state_request(self, request):
            raise UpdateRejected(grpc.StatusCode.NOT_FOUND, "stale", "no state")

    server = GossipServer(Echo())
    server.start()
    queue.put(server.address)
    stop.wait(60)
    server.stop(grace=1.0)


@pytest.mark.timeout(90)
def test_push_between_two_processes():
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_in_child, args=(queue, stop), daemon=True)
    proc.start()
    try:
        address = queue.get(timeout=60)
        payload = _bytes(12 * MiB + 5, seed=12)
        with PeerClient(address, options=FAST) as client:
            reply = client.push(_header(), payload)
        assert reply.detail == hashlib.sha256(payload).hexdigest()
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
