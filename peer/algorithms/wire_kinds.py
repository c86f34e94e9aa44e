"""The protocol's update kinds and reply statuses in the edge state machine's terms
(peer/algorithms/edges.py knows nothing of the wire)."""

from __future__ import annotations

import grpc
from gossipgrad.peer.algorithms.edges import Kind, Verdict
from gossipgrad.proto import gossip_pb2 as pb

KINDS = {pb.INIT: Kind.INIT, pb.RESYNC: Kind.RESYNC, pb.DELTA: Kind.DELTA}
WIRE_KIND = {v: k for k, v in KINDS.items()}
STATUS = {
    Verdict.ACCEPTED: pb.PushReply.ACCEPTED,
    Verdict.DUPLICATE: pb.PushReply.DUPLICATE,
    Verdict.NEED_RESYNC: pb.PushReply.NEED_RESYNC,
    Verdict.FINISHED: pb.PushReply.FINISHED,
}
VERDICT = {v: k for k, v in STATUS.items()}
# Refusals of the update itself: sending the same bytes again cannot help.
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
