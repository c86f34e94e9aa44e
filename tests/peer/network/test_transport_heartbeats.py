"""Heartbeats have their own budget, and clients close without leaking.

What must hold, on real servers on 127.0.0.1:

* while large pushes (many small chunks, then a slow handler) fill every bulk slot of the
  server and every call the pushing peer may have in flight, that same peer's heartbeats
  are all answered, promptly;
* a push beyond the bulk budget is refused (RESOURCE_EXHAUSTED, counted ``rate_limited``);
* heartbeats and bulk calls travel on two connections; a closed client holds none, its
  calls fail with CANCELLED (an in-flight one promptly), and closing many clients leaves no
  threads behind.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from gossipgrad.peer.network import GossipServer, PeerClient, TransportError, TransportOptions
from gossipgrad.proto import gossip_pb2 as pb

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 1 << 10, 1 << 20


class SlowSink:
    """Accepts pushes, holding each one until ``release`` is set; answers heartbeats at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.heartbeats = 0

    def handle_update(self, header, payload, context_peer):
        self.entered.release()
        self.release.wait(60)
        return pb.PushReply(status=pb.PushReply.ACCEPTED, detail=str(len(payload)))

    def handle_heartbeat(self, request):
        self.heartbeats += 1
        return pb.HeartbeatReply(responder=pb.PeerInfo(id="server"))

    def handle_state_request(self, request):
        return pb.StateHeader(sender="server"), b""


def _header(sender: str) -> pb.UpdateHeader:
    return pb.UpdateHeader(swarm="s", sender=sender, receiver="server", kind=pb.RESYNC)


def _beat(sender: str) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(swarm="s", sender=pb.PeerInfo(id=sender, address="127.0.0.1:1"))


def _push_in_background(client: PeerClient, sender: str, size: int, out: list) -> threading.Thread:
    def run() -> None:
        try:
            out.append(client.push(_header(sender), bytes(size), timeout=60))
        except TransportError as err:
            out.append(err)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_heartbeats_are_answered_while_bulk_pushes_fill_the_server() -> None:
    # Two bulk slots, two calls in flight per peer: two pushes from peer "a" fill both, which
    # before heartbeats had their own budget left "a"'s heartbeats refused or queued.
    opts = TransportOptions(
        retries=0,
        chunk_size=4 * KiB,
        server_threads=2,
        max_concurrent_rpcs=2,
        max_streams_per_peer=2,
        heartbeat_slots=3,
    )
    sink = SlowSink()
    rejects: list[str] = []
    server = GossipServer(sink, options=opts, on_reject=lambda r, p: rejects.append(r))
    server.start()
    client = PeerClient(server.address, options=opts)
    other = PeerClient(server.address, options=opts)
    results: list[object] = []
    try:
        pushers = [_push_in_background(client, "a", 24 * MiB, results) for _ in range(2)]
        latencies: list[float] = []
        streaming = 0  # heartbeats answered before both pushes reached the handler
        entered = 0
        window_end = time.monotonic() + 30
        while time.monotonic() < window_end and (entered < 2 or len(latencies) < streaming + 20):
            started = time.monotonic()
            reply = client.heartbeat(_beat("a"), timeout=5)
            latencies.append(time.monotonic() - started)
            assert reply.responder.id == "server"
            while sink.entered.acquire(blocking=False):
                entered += 1
            streaming += entered < 2
            time.sleep(0.02)
        assert entered == 2, ("the pushes never reached the handler", results)
        # Both bulk slots are taken: a third push (another peer) is refused, not queued ...
        with pytest.raises(TransportError) as info:
            other.push(_header("b"), b"x" * 100, timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.reason == "rate_limited" and rejects == ["rate_limited"]
        # ... while that peer's heartbeats still pass.
        assert other.heartbeat(_beat("b"), timeout=5).responder.id == "server"
        assert all(t.is_alive() for t in pushers), "pushes ended before the check"
    finally:
        sink.release.set()
        for t in pushers:
            t.join(60)
        client.close()
        other.close()
        server.stop(grace=0.5)
    assert [r.detail for r in results] == [str(24 * MiB)] * 2, results
    assert streaming >= 1, "no heartbeat overlapped the chunk streams"
    # Promptly: a heartbeat queued behind the pushes would wait for them to end, which they do
    # only after this loop, and miss its deadline. The bounds leave room for a loaded machine.
    ordered = sorted(latencies)
    assert ordered[len(ordered) // 2] < 0.1 and ordered[-1] < 3.0, ordered[-5:]
    print(
        f"heartbeats under load: n={len(latencies)} (during streaming {streaming}), "
        f"median {sorted(latencies)[len(latencies) // 2] * 1e3:.1f} ms, "
        f"max {max(latencies) * 1e3:.1f} ms"
    )


def _connections_to(port: int) -> int:
    """Established TCP connections this process has open to ``127.0.0.1:port`` (client ends)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port and _ours(inode):
                count += 1
    return count


def _ours(inode: str) -> bool:
    target = f"socket:[{inode}]"
    fd_dir = Path("/proc/self/fd")
    for fd in fd_dir.iterdir():
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_heartbeats_and_bulk_use_separate_connections_and_close_frees_both() -> None:
    sink = SlowSink()
    sink.release.set()
    server = GossipServer(sink, options=TransportOptions(retries=0))
    server.start()
    try:
        client = PeerClient(server.address, options=TransportOptions(retries=0))
        client.heartbeat(_beat("a"))
        assert _wait_for(lambda: _connections_to(server.port) == 1)  # bulk not opened yet
        client.push(_header("a"), b"payload")
        assert _wait_for(lambda: _connections_to(server.port) == 2)
        client.close()
        client.close()  # idempotent
        assert _wait_for(lambda: _connections_to(server.port) == 0)
        with pytest.raises(TransportError) as info:
            client.heartbeat(_beat("a"))
        assert info.value.code() == grpc.StatusCode.CANCELLED
    finally:
        server.stop(grace=0.5)


def test_close_cancels_an_in_flight_push_promptly() -> None:
    sink = SlowSink()
    server = GossipServer(sink, options=TransportOptions(retries=3))
    server.start()
    client = PeerClient(server.address, options=TransportOptions(retries=3))
    results: list[object] = []
    try:
        pusher = _push_in_background(client, "a", 1000, results)
        assert sink.entered.acquire(timeout=10)
        started = time.monotonic()
        client.close()
        pusher.join(10)
        assert not pusher.is_alive()
        assert time.monotonic() - started < 3.0
    finally:
        sink.release.set()
        server.stop(grace=0.5)
    (err,) = results
    assert isinstance(err, TransportError) and err.code() == grpc.StatusCode.CANCELLED
    assert err.attempts == 1  # a closed client does not retry


def _client_threads() -> list[str]:
    """Names of live threads, less the server's workers (its pool grows on demand)."""
    return [t.name for t in threading.enumerate() if not t.name.startswith("gossip-server")]


def test_closing_many_clients_leaves_no_threads_behind() -> None:
    sink = SlowSink()
    sink.release.set()
    server = GossipServer(sink, options=TransportOptions(retries=0))
    server.start()
    try:
        warm = PeerClient(server.address)  # let gRPC start its process-wide threads first
        warm.heartbeat(_beat("w"))
        warm.push(_header("w"), b"x")
        warm.close()
        time.sleep(0.5)
        baseline = _client_threads()
        for i in range(20):
            with PeerClient(server.address) as c:
                c.heartbeat(_beat(f"c{i}"))
                c.push(_header(f"c{i}"), bytes(100_000))
                c.download_state(pb.StateRequest(swarm="s", requester=f"c{i}"))
        assert _wait_for(lambda: len(_client_threads()) <= len(baseline)), (
            baseline,
            _client_threads(),
        )
    finally:
        server.stop(grace=0.5)
