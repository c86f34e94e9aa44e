"""Whether the other members can dial this peer: a dial-back at start.

A peer that nobody can dial (behind NAT, or a firewall dropping inbound connections) still
heartbeats and pushes outbound, so without a check it would train alone and exit 0. At start
a peer with a bootstrap list therefore asks a member to dial it back:

1. it heartbeats the first bootstrap address that answers, so the member holds the address
   it advertises from its own word (``PeerRecord.heard_directly``);
2. it asks that member (``CheckReachability``) to dial that address back;
3. the member (:class:`DialBack`) dials only the address its table holds from the
   requester's own heartbeat for the requester's id (under mutual TLS the transport has
   matched that id to the caller's certificate), at most :data:`DIAL_BACKS_BURST` times and
   then once per :data:`DIAL_BACK_EVERY_S` per requester, one dial-back per requester at a
   time, each one heartbeat within :data:`DIAL_BACK_TIMEOUT_S` on a new client pinned to the
   requester's certificate name: the same call, through the same client, a neighbour makes
   (where that fails to connect, a bare TCP connection to the address tells a dropped or
   refused connection from a TLS handshake that failed: :func:`tcp_probe`).

The answer is the peer's :class:`Reachability`: ``reachable``, ``unreachable`` with a cause
(:data:`UNREACHABLE_CAUSES`), or ``unknown`` (:data:`UNKNOWN_CAUSES`: the first peer of a
swarm, a member too old to serve the check, busy ones). Only ``unreachable`` is an error,
and only with ``peer.require_reachable`` (:class:`NotReachable`).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Callable

import grpc
from gossipgrad.peer.network import TransportError, UpdateRejected, WrongServer
from gossipgrad.peer.network.limits import PeerLimiter
from gossipgrad.peer.runtime.joining import JoinError
from gossipgrad.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

#: Seconds the member gives its dial-back (connection, TLS handshake and one heartbeat): a
#: firewall that drops inbound packets shows as this long a wait, then ``timed_out``.
DIAL_BACK_TIMEOUT_S = 5.0
#: Seconds of the dial-back's deadline kept for a bare TCP connection when the heartbeat had
#: no answer, to tell a silent listener from dropped packets.
SILENT_PORT_PROBE_S = 1.0
#: Seconds a peer waits for the member's answer: the dial-back's deadline and a margin.
CHECK_TIMEOUT_S = DIAL_BACK_TIMEOUT_S + 5.0
#: Times a bootstrap peer is asked when the call ends without any answer (CANCELLED,
#: UNAVAILABLE, DEADLINE_EXCEEDED, no reason token: a channel closed under the call, a
#: member still starting), the n-th retry after n x CHECK_RETRY_S seconds. A check cut off
#: so once, as a start-up race did in a netns run, was taken as "unknown" and the NAT'd site
#: trained alone.
CHECK_ATTEMPTS = 3
CHECK_RETRY_S = 0.5
#: Dial-backs one requester may have at once, then one per DIAL_BACK_EVERY_S seconds.
DIAL_BACKS_BURST = 2
DIAL_BACK_EVERY_S = 10.0

REACHABLE, UNREACHABLE, UNKNOWN = "reachable", "unreachable", "unknown"

#: Why a dial-back failed, from the member's answer.
UNREACHABLE_CAUSES: dict[int, str] = {
    pb.ReachabilityReply.REFUSED: "refused",
    pb.ReachabilityReply.TIMED_OUT: "timed_out",
    pb.ReachabilityReply.WRONG_IDENTITY: "wrong_identity",
    pb.ReachabilityReply.FAILED: "failed",
}
#: Why no answer came: no bootstrap list, no bootstrap peer answered, the members answered
#: UNIMPLEMENTED (older versions), were busy or refused to dial.
UNKNOWN_CAUSES = ("first_peer", "no_answer", "not_supported", "busy", "refused_check")

_PLAIN_CAUSE = {
    "refused": "the connection was refused (nothing listens there)",
    "timed_out": f"no answer within {DIAL_BACK_TIMEOUT_S:g}s (inbound connections dropped)",
    "wrong_identity": "something else answered there (not this peer's gossip server with its "
    "certificate)",
    "failed": "the dial-back failed",
}


@dataclasses.dataclass(frozen=True)
class Reachability:
    """What a dial-back found out about this peer's advertised address.

    Attributes:
        status: ``reachable``, ``unreachable`` or ``unknown``.
        address: the address dialled (the one this peer advertises).
        cause: why not reachable or not known ("" when reachable).
        checker: the id of the member that dialled ("" if none did).
        detail: the transport's words, for a human.
    """

    status: str
    address: str
    cause: str = ""
    checker: str = ""
    detail: str = ""

    @property
    def gauge(self) -> float:
        """``gossipgrad_reachable``: 1 reachable, 0 unreachable, -1 unknown."""
        return {REACHABLE: 1.0, UNREACHABLE: 0.0}.get(self.status, -1.0)

    def summary(self) -> str:
        """One line saying what was found and, if unreachable, what to open."""
        by = f" (checked by {self.checker})" if self.checker else ""
        detail = " ".join(self.detail.split())  # one line, whatever the transport said
        if self.status == REACHABLE:
            return f"reachable at {self.address}{by}"
        if self.status == UNKNOWN:
            return f"reachability of {self.address} unknown: {self.cause}{by} {detail}"
        port = self.address.rsplit(":", 1)[-1]
        return (
            f"NOT reachable at {self.address}: {_PLAIN_CAUSE.get(self.cause, self.cause)}{by}"
            f" [{detail}]; open TCP port {port} inbound to this host, or set peer.advertise "
            "to an address the other sites can reach"
        )


class NotReachable(JoinError):
    """This peer's advertised address cannot be dialled and ``peer.require_reachable`` is set:
    its neighbours could never push to it, so it would train alone. One line (the daemon logs
    it and exits non-zero)."""


def check(
    bootstrap: list[str],
    address: str,
    introduce: Callable[[str], str],
    ask: Callable[[str, str], pb.ReachabilityReply],
    pause: Callable[[float], None] = time.sleep,
) -> Reachability:
    """Ask the first bootstrap peer that answers to dial ``address`` back (twice if the
    first dial-back timed out; up to :data:`CHECK_ATTEMPTS` times a peer whose call ended
    without any answer).

    Args:
        bootstrap: addresses to try, in order.
        address: the address this peer advertises.
        introduce: heartbeats a bootstrap address (raises on failure), so the member holds
            ``address`` from this peer's own word before it is asked; returns its id.
        ask: ``ask(bootstrap address, its id)``: the ``CheckReachability`` call to it
            (raises TransportError).
        pause: sleeps between attempts at one peer.
    """
    if not bootstrap:
        return Reachability(UNKNOWN, address, "first_peer")
    cause, detail = "no_answer", ""
    targets = list(bootstrap)
    asked = dict.fromkeys(targets, 0)
    timed_out: Reachability | None = None  # a first "no answer", asked again once
    while targets:
        target = targets.pop(0)
        asked[target] += 1
        try:
            reply = ask(target, introduce(target))
        except TransportError as err:
            code = err.code()
            if _no_answer(err) and asked[target] < CHECK_ATTEMPTS:
                log.info("reachability check: %s did not answer (%s), asking again", target, err)
                pause(CHECK_RETRY_S * asked[target])
                targets.insert(0, target)
                detail = f"{target}: {err}"
            elif code == grpc.StatusCode.UNIMPLEMENTED:
                cause, detail = "not_supported", f"{target} is an older version"
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                cause, detail = "busy", f"{target}: {err.detail}"
            elif err.reason:
                cause, detail = "refused_check", f"{target}: {err.reason}: {err.detail}"
            else:
                detail = f"{target}: {err}"
            continue
        except Exception as err:  # the introduction's transport raises its own errors
            detail = f"{target}: {err}"
            continue
        if reply.result == pb.ReachabilityReply.REACHABLE:
            return Reachability(REACHABLE, address, checker=reply.checker)
        found = Reachability(
            UNREACHABLE,
            address,
            UNREACHABLE_CAUSES.get(reply.result, "failed"),
            reply.checker,
            reply.detail,
        )
        if found.cause != "timed_out" or timed_out is not None:
            return found
        # Silence may be a lost packet or a member too loaded to finish in time, and the
        # verdict stops the peer: one more dial-back (a refusal or another identity is
        # definite at once).
        timed_out = found
        targets.insert(0, target)
    if timed_out is not None:
        return timed_out
    return Reachability(UNKNOWN, address, cause, detail=detail)


def _no_answer(err: TransportError) -> bool:
    """The call ended without any answer from the member (no reason token): worth asking
    again, where a refusal, a busy member or an older version is an answer."""
    silent = (
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    return err.code() in silent and not err.reason


class DialBack:
    """The member's side of ``CheckReachability``: bounded, and only to what was advertised.

    Args:
        checker: this member's id (named in every answer).
        advertised: requester id -> the address its own heartbeats advertised here, or None.
        dial: ``dial(address, peer_id, timeout)`` heartbeats ``peer_id`` at ``address`` through
            a new client pinned to it and returns the id that answered; raises TransportError.
        probe: ``probe(address, timeout)``: a bare TCP connection to where ``address`` is
            dialled (:func:`tcp_probe`), made only to say why a dial failed.
    """

    def __init__(
        self,
        checker: str,
        advertised: Callable[[str], str | None],
        dial: Callable[[str, str, float], str],
        probe: Callable[[str, float], str],
    ) -> None:
        self.checker = checker
        self._advertised = advertised
        self._dial = dial
        self._probe = probe
        self._limits = PeerLimiter(
            max_streams=1, rate=1.0 / DIAL_BACK_EVERY_S, burst=DIAL_BACKS_BURST
        )

    def handle(self, request: pb.ReachabilityRequest) -> pb.ReachabilityReply:
        """Dial the requester back, or raise UpdateRejected (``unknown_sender``: not the
        address it advertised for itself; ``rate_limited``: too many dial-backs)."""
        who, address = request.requester, request.address
        if not who or not address or self._advertised(who) != address:
            raise UpdateRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "unknown_sender",
                f"{who!r} has not advertised {address!r} for itself here; only the address a "
                "peer's own heartbeat advertises is dialled back",
            )
        refused = self._limits.enter(who)
        if refused is not None:
            raise UpdateRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limited", f"dial-backs: {refused}"
            )
        try:
            result, detail = self._try(address, who)
        finally:
            self._limits.leave(who)
        log.info(
            "dialled %s back at %s: %s", who, address, pb.ReachabilityReply.Result.Name(result)
        )
        return pb.ReachabilityReply(result=result, checker=self.checker, detail=detail)

    def _try(self, address: str, who: str) -> tuple[int, str]:
        R = pb.ReachabilityReply
        deadline = time.monotonic() + DIAL_BACK_TIMEOUT_S
        try:  # the last SILENT_PORT_PROBE_S of the deadline kept for a bare connection
            answered = self._dial(address, who, DIAL_BACK_TIMEOUT_S - SILENT_PORT_PROBE_S)
        except WrongServer as err:
            return R.WRONG_IDENTITY, str(err)
        except TransportError as err:
            if err.refused:
                return R.REFUSED, str(err)
            code = err.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                # Nothing answered as a gossip server in time: a bare connection tells a port
                # that takes connections and stays silent (something else listens there)
                # from one whose packets are dropped.
                tcp = self._probe(address, SILENT_PORT_PROBE_S)
                result = R.WRONG_IDENTITY if tcp == "connected" else R.TIMED_OUT
                return result, f"{err} (TCP: {tcp})"
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return R.WRONG_IDENTITY, str(err)
            if code != grpc.StatusCode.UNAVAILABLE:
                return R.FAILED, str(err)
            # UNAVAILABLE whether the TCP handshake failed or TLS failed after it: a bare
            # connection tells which, for the rest of the deadline.
            tcp = self._probe(address, max(1.0, deadline - time.monotonic()))
            result = {
                "refused": R.REFUSED,
                "timed_out": R.TIMED_OUT,
                "connected": R.WRONG_IDENTITY,
            }.get(tcp, R.FAILED)
            return result, f"{err} (TCP: {tcp})"
        if answered != who:
            return R.WRONG_IDENTITY, f"{answered or 'no peer'} answered at {address}, not {who}"
        return R.REACHABLE, ""


def tcp_probe(address: str, timeout: float) -> str:
    """A bare TCP connection to ``host:port``, closed at once: ``connected``, ``refused``,
    ``timed_out`` (no answer: inbound packets dropped) or ``error: ...`` (no route, a
    name that does not resolve)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return "connected"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timed_out"
    except (OSError, ValueError) as err:
        return f"error: {err}"
