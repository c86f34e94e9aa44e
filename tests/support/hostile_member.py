"""Hostile swarm members, run as a process of their own against a live swarm (issue 40).

Two members with valid certificates of the swarm (``--certs`` holds ``evil`` and ``evil2``)
act for ``--seconds`` against every honest peer the bootstrap names. ``evil``:

* tells it, in heartbeat peer lists, that every honest peer left (at a far higher
  incarnation), moved to the hostile server's address, and that invented peers live there;
* runs that server with its own certificate, answering every heartbeat in an honest peer's
  name (a takeover, should anyone dial it as that peer);
* asks for the state and cancels the download after its header, once a round;
* every fifth round sends a peer list one entry over the limit (``MAX_KNOWN`` + 1);
* says it is at a step far ahead of the swarm's (to be every joiner's first donor).

``evil2`` keeps calls open that never send their request (heartbeats and whole pushes), more
than its per-caller limits allow, reopening each one the server cuts off.

A third certificate, ``watcher``, watches: each round it heartbeats every honest peer,
dialled as that peer, times the answer, and checks that every honest peer's list holds every
other honest peer alive, at the address and incarnation that peer gives itself. Rounds in
which some honest peer does not answer as itself (or says it is leaving) are not checked.
Writes a JSON report to ``--out``. With ``--watch-only`` the watcher alone runs: a baseline
of the same swarm without the attack, or, as another process with another watcher's
certificate (``--watcher``), answers timed where the attack's own threads do not compete for
the timing process.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import grpc
from gossipgrad.peer.membership.heartbeats import MAX_KNOWN
from gossipgrad.peer.network import GossipServer, PeerClient, TransportOptions, protocol
from gossipgrad.peer.network.protocol import STATE_CODEC
from gossipgrad.peer.security import TransportSecurity
from gossipgrad.proto import gossip_pb2 as pb

ME, STALLER, WATCHER = "evil", "evil2", "watcher"
GHOSTS = 8
FAR_STEP = 10**12  # what evil and evil2 say their step is
STALLED_HEARTBEATS = 4  # per honest peer, over its limit of 2
STALLED_PUSHES = 10  # per honest peer, over its limit of 8
CALL_S = 5.0  # the deadline of each call; the attacks' shortened to what is left of the attack
HANG_S = 50.0  # past the attack's end, the process prints where its main thread is and ends


class Impersonator:
    """The hostile server's handler: every heartbeat is answered as ``as_whom``."""

    def __init__(self) -> None:
        self.as_whom = pb.PeerInfo()
        self.calls = 0

    def handle_update(self, header, payload, context_peer: str = "") -> pb.PushReply:
        self.calls += 1
        return pb.PushReply(status=pb.PushReply.ACCEPTED)

    def handle_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.calls += 1
        return pb.HeartbeatReply(responder=self.as_whom)

    def handle_state_request(self, request: pb.StateRequest):
        self.calls += 1
        return pb.StateHeader(sender=ME), b""


class Stalling:
    """Calls to one honest peer that never send their request, reopened when cut off."""

    def __init__(self, address: str, sec: TransportSecurity, peer: str, stop: threading.Event):
        self._stop = stop
        self._channel = grpc.secure_channel(
            address, sec.channel_credentials(), options=sec.channel_args(peer)
        )
        self.outcomes: dict[str, int] = {}
        self.details: dict[str, str] = {}  # the first detail of each status
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(method,), daemon=True)
            for method in [protocol.HEARTBEAT] * STALLED_HEARTBEATS
            + [protocol.PUSH_WHOLE] * STALLED_PUSHES
        ]
        for t in self.threads:
            t.start()

    def _nothing(self):
        self._stop.wait()
        return
        yield  # a request stream that sends nothing

    def _loop(self, method: str) -> None:
        call = self._channel.stream_unary(protocol.method_path(method))
        while not self._stop.is_set():
            try:
                call(self._nothing(), timeout=60)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
                self.details.setdefault(code, err.details() or "")
            with self._lock:
                self.outcomes[code] = self.outcomes.get(code, 0) + 1

    def close(self) -> None:
        self._channel.close()  # cancels every call in flight
        until = time.monotonic() + CALL_S
        for t in self.threads:
            t.join(max(0.0, until - time.monotonic()))


def ask_state_and_cancel(channel: grpc.Channel, swarm: str, timeout: float) -> None:
    """Ask the peer at the other end of ``channel`` for its state and cancel the download
    once its header came. (One channel per peer for the whole attack: a channel opened and
    closed per ask, with a cancelled stream on it, is the likeliest place of the hang that
    outlived the attack in full suites.)"""
    download = channel.unary_stream(
        protocol.method_path(protocol.STATE),
        request_serializer=pb.StateRequest.SerializeToString,
        response_deserializer=STATE_CODEC.decode,
    )
    call = download(pb.StateRequest(swarm=swarm, requester=ME), timeout=timeout)
    with contextlib.suppress(grpc.RpcError, StopIteration):
        next(call)  # the header: the state was there to send
    call.cancel()


class Progress:
    """Where the main loop is, one line per step, flushed at once to a file of its own: a
    process that hangs holding the GIL (its watchdog thread never runs) still shows its
    last step there."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("w", buffering=1)
        self._t0 = time.monotonic()

    def __call__(self, what: str) -> None:
        self._file.write(f"{time.monotonic() - self._t0:8.3f} {what}\n")


def heartbeat(swarm: str, sender: str, known: list[pb.PeerInfo] = ()) -> pb.HeartbeatRequest:
    """A heartbeat from ``sender``, which lives where nothing listens (so it is no one's
    neighbour for long), asking for the whole peer list (digest 0)."""
    me = pb.PeerInfo(id=sender, address="127.0.0.1:9", incarnation=1, step=FAR_STEP)
    return pb.HeartbeatRequest(swarm=swarm, sender=me, known=list(known), view_digest=0)


def watchdog(seconds: float) -> None:
    """In ``seconds``, print the main thread's stack and end the process with status 1."""
    main_thread = threading.main_thread().ident

    def fire() -> None:
        frame = sys._current_frames().get(main_thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        sys.stderr.write(f"still running {seconds:.0f} s after start; the main thread:\n{stack}")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("bootstrap", "certs", "out", "swarm"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--watch-only", action="store_true", help="the watcher alone: no attack")
    parser.add_argument("--watcher", default=WATCHER, help="the watching member's certificate")
    args = parser.parse_args()
    certs = Path(args.certs)
    # Every call below has a deadline; should the process outlive them all anyway, it prints
    # where its main thread is and ends, so that the test shows the hang instead of a
    # timeout. (faulthandler's dump of every thread stops at 100 threads, and the stalled
    # calls' threads alone are more: the main thread, listed last, was left out.) faulthandler
    # still ends it should the watchdog not get the GIL.
    watchdog(args.seconds + HANG_S)
    faulthandler.dump_traceback_later(args.seconds + HANG_S + 10, exit=True)

    def member(pid: str) -> TransportSecurity:
        return TransportSecurity.from_files(
            certs / "ca.pem", certs / f"{pid}.pem", certs / f"{pid}.key"
        )

    sec, staller, watcher = member(ME), member(STALLER), member(args.watcher)
    opts = TransportOptions(retries=0)
    handler = Impersonator()
    server = GossipServer(handler, security=sec)
    server.start()
    stop = threading.Event()
    report: dict = {"rounds": 0, "checked": 0, "violations": [], "latencies": [], "errors": {}}
    stalled: dict[str, Stalling] = {}
    clients: dict[str, PeerClient] = {}  # evil's
    state_channels: dict[str, grpc.Channel] = {}
    progress = Progress(Path(args.out + ".progress"))
    watching: dict[str, PeerClient] = {}
    with PeerClient(args.bootstrap, opts, watcher) as boot:
        reply = boot.heartbeat(heartbeat(args.swarm, args.watcher), timeout=CALL_S)
    honest = {
        i.id: i.address
        for i in reply.known
        if i.id not in (ME, STALLER) and not i.id.startswith(WATCHER)
    }
    too_long = [
        pb.PeerInfo(id=f"many-{k}", address=server.address, incarnation=1)
        for k in range(MAX_KNOWN + 1)
    ]
    end = time.monotonic() + args.seconds

    def deadline() -> float:
        """A call's deadline: CALL_S, or what is left of the attack (1 s at least)."""
        return min(CALL_S, max(1.0, end - time.monotonic()))

    try:
        while time.monotonic() < end:
            report["rounds"] += 1
            progress(f"round {report['rounds']}")
            replies: dict[str, pb.HeartbeatReply] = {}
            for pid, address in honest.items():
                if pid not in clients:  # (setdefault would build and leak two clients a round)
                    clients[pid] = PeerClient(address, opts, sec, peer=pid)
                    watching[pid] = PeerClient(address, opts, watcher, peer=pid)
                    state_channels[pid] = grpc.secure_channel(
                        address, sec.channel_credentials(), options=sec.channel_args(pid)
                    )
                progress(f"watch {pid}")
                watch = watching[pid]
                if pid not in stalled and not args.watch_only:
                    stalled[pid] = Stalling(address, staller, pid, stop)
                t0 = time.monotonic()
                try:
                    replies[pid] = watch.heartbeat(
                        heartbeat(args.swarm, args.watcher), timeout=CALL_S
                    )
                    report["latencies"].append(time.monotonic() - t0)
                except grpc.RpcError as err:
                    name = f"observe {pid}: {err.code().name}"
                    report["errors"][name] = report["errors"].get(name, 0) + 1
            truth = {pid: r.responder for pid, r in replies.items()}
            if len(replies) == len(honest) and all(
                r.responder.id == pid and not r.responder.leaving for pid, r in replies.items()
            ):
                report["checked"] += 1
                for pid, reply in replies.items():
                    held = {i.id: i for i in reply.known}
                    for other, own in truth.items():
                        if other == pid:
                            continue
                        got = held.get(other)
                        if got is None or got.leaving:
                            report["violations"].append(f"{pid} holds {other} dead")
                        elif (got.address, got.incarnation) != (own.address, own.incarnation):
                            report["violations"].append(
                                f"{pid} holds {other} at {got.address}/{got.incarnation}, "
                                f"it says {own.address}/{own.incarnation}"
                            )
            if args.watch_only:
                time.sleep(0.2)
                continue
            # The attacks.
            handler.as_whom = pb.PeerInfo(
                id=next(iter(honest)), address=server.address, incarnation=time.time_ns()
            )
            forged = []
            for pid, own in truth.items():
                forged.append(
                    pb.PeerInfo(
                        id=pid,
                        address=own.address,
                        incarnation=own.incarnation + 10**12,
                        leaving=True,
                    )
                )
                forged.append(pb.PeerInfo(id=pid, address=server.address,
                                          incarnation=own.incarnation + 10**12))  # fmt: skip
            forged += [
                pb.PeerInfo(id=f"ghost-{k}", address=server.address, incarnation=time.time_ns())
                for k in range(GHOSTS)
            ]
            for pid, client in clients.items():
                progress(f"forge {pid}")
                try:
                    client.heartbeat(heartbeat(args.swarm, ME, forged), timeout=deadline())
                except grpc.RpcError as err:
                    name = f"forge {pid}: {err.code().name}"
                    report["errors"][name] = report["errors"].get(name, 0) + 1
                if report["rounds"] % 5 == 1:
                    try:
                        client.heartbeat(heartbeat(args.swarm, ME, too_long), timeout=deadline())
                    except grpc.RpcError as err:
                        name = f"too long {pid}: {err.code().name}"
                        report["errors"][name] = report["errors"].get(name, 0) + 1
                progress(f"state {pid}")
                ask_state_and_cancel(state_channels[pid], args.swarm, deadline())
            time.sleep(0.2)
    finally:
        progress("closing")
        stop.set()
        for s in stalled.values():
            s.close()
        for c in [*clients.values(), *watching.values(), *state_channels.values()]:
            c.close()
        server.stop(grace=0)
        progress("closed")
    report["stalled"] = {pid: s.outcomes for pid, s in stalled.items()}
    report["stalled_details"] = {pid: s.details for pid, s in stalled.items()}
    report["impersonator_calls"] = handler.calls
    report["honest"] = sorted(honest)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
