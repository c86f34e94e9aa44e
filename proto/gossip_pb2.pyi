from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_KIND_UNSPECIFIED: _ClassVar[UpdateKind]
    DELTA: _ClassVar[UpdateKind]
    RESYNC: _ClassVar[UpdateKind]
    GRADIENT: _ClassVar[UpdateKind]
    INIT: _ClassVar[UpdateKind]
    FINAL: _ClassVar[UpdateKind]
    BUFFERS: _ClassVar[UpdateKind]
    SHARED: _ClassVar[UpdateKind]
    ANCHOR: _ClassVar[UpdateKind]
UPDATE_KIND_UNSPECIFIED: UpdateKind
DELTA: UpdateKind
RESYNC: UpdateKind
GRADIENT: UpdateKind
INIT: UpdateKind
FINAL: UpdateKind
BUFFERS: UpdateKind
SHARED: UpdateKind
ANCHOR: UpdateKind

class UpdateHeader(_message.Message):
    __slots__ = ("swarm", "sender", "receiver", "seq", "round", "kind", "checksum", "payload_size", "model_fingerprint", "dense_size", "edge_epoch", "weight", "dropped_epoch", "origin")
    SWARM_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DENSE_SIZE_FIELD_NUMBER: _ClassVar[int]
    EDGE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    swarm: str
    sender: str
    receiver: str
    seq: int
    round: int
    kind: UpdateKind
    checksum: int
    payload_size: int
    model_fingerprint: str
    dense_size: int
    edge_epoch: int
    weight: float
    dropped_epoch: int
    origin: str
    def __init__(self, swarm: _Optional[str] = ..., sender: _Optional[str] = ..., receiver: _Optional[str] = ..., seq: _Optional[int] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[UpdateKind, str]] = ..., checksum: _Optional[int] = ..., payload_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., dense_size: _Optional[int] = ..., edge_epoch: _Optional[int] = ..., weight: _Optional[float] = ..., dropped_epoch: _Optional[int] = ..., origin: _Optional[str] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WholeUpdate(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("status", "expected_seq", "detail")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[PushReply.Status]
        ACCEPTED: _ClassVar[PushReply.Status]
        DUPLICATE: _ClassVar[PushReply.Status]
        NEED_RESYNC: _ClassVar[PushReply.Status]
        FINISHED: _ClassVar[PushReply.Status]
    STATUS_UNSPECIFIED: PushReply.Status
    ACCEPTED: PushReply.Status
    DUPLICATE: PushReply.Status
    NEED_RESYNC: PushReply.Status
    FINISHED: PushReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: PushReply.Status
    expected_seq: int
    detail: str
    def __init__(self, status: _Optional[_Union[PushReply.Status, str]] = ..., expected_seq: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("id", "address", "step", "round", "incarnation", "leaving", "metrics_address", "relay", "relay_epoch", "relaying", "checking", "relay_port")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELAYING_FIELD_NUMBER: _ClassVar[int]
    CHECKING_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    step: int
    round: int
    incarnation: int
    leaving: bool
    metrics_address: str
    relay: str
    relay_epoch: int
    relaying: int
    checking: bool
    relay_port: int
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., step: _Optional[int] = ..., round: _Optional[int] = ..., incarnation: _Optional[int] = ..., leaving: _Optional[bool] = ..., metrics_address: _Optional[str] = ..., relay: _Optional[str] = ..., relay_epoch: _Optional[int] = ..., relaying: _Optional[int] = ..., checking: _Optional[bool] = ..., relay_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("swarm", "sender", "known", "view_digest")
    SWARM_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    VIEW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    swarm: str
    sender: PeerInfo
    known: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    view_digest: int
    def __init__(self, swarm: _Optional[str] = ..., sender: _Optional[_Union[PeerInfo, _Mapping]] = ..., known: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., view_digest: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("responder", "known", "view_digest")
    RESPONDER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    VIEW_DIGEST_FIELD_NUMBER: _ClassVar[int]
    responder: PeerInfo
    known: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    view_digest: int
    def __init__(self, responder: _Optional[_Union[PeerInfo, _Mapping]] = ..., known: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., view_digest: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("swarm", "requester", "state_format")
    SWARM_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    swarm: str
    requester: str
    state_format: int
    def __init__(self, swarm: _Optional[str] = ..., requester: _Optional[str] = ..., state_format: _Optional[int] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("sender", "step", "round", "payload_size", "model_fingerprint", "state_format")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    sender: str
    step: int
    round: int
    payload_size: int
    model_fingerprint: str
    state_format: int
    def __init__(self, sender: _Optional[str] = ..., step: _Optional[int] = ..., round: _Optional[int] = ..., payload_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., state_format: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReachabilityRequest(_message.Message):
    __slots__ = ("swarm", "requester", "address")
    SWARM_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    swarm: str
    requester: str
    address: str
    def __init__(self, swarm: _Optional[str] = ..., requester: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ReachabilityReply(_message.Message):
    __slots__ = ("result", "checker", "detail")
    class Result(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESULT_UNSPECIFIED: _ClassVar[ReachabilityReply.Result]
        REACHABLE: _ClassVar[ReachabilityReply.Result]
        REFUSED: _ClassVar[ReachabilityReply.Result]
        TIMED_OUT: _ClassVar[ReachabilityReply.Result]
        WRONG_IDENTITY: _ClassVar[ReachabilityReply.Result]
        FAILED: _ClassVar[ReachabilityReply.Result]
    RESULT_UNSPECIFIED: ReachabilityReply.Result
    REACHABLE: ReachabilityReply.Result
    REFUSED: ReachabilityReply.Result
    TIMED_OUT: ReachabilityReply.Result
    WRONG_IDENTITY: ReachabilityReply.Result
    FAILED: ReachabilityReply.Result
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CHECKER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    result: ReachabilityReply.Result
    checker: str
    detail: str
    def __init__(self, result: _Optional[_Union[ReachabilityReply.Result, str]] = ..., checker: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("swarm", "peer", "splice")
    SWARM_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SPLICE_FIELD_NUMBER: _ClassVar[int]
    swarm: str
    peer: str
    splice: bool
    def __init__(self, swarm: _Optional[str] = ..., peer: _Optional[str] = ..., splice: _Optional[bool] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("tunnel", "ticket")
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    tunnel: int
    ticket: bytes
    def __init__(self, tunnel: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class RelayOpen(_message.Message):
    __slots__ = ("swarm", "sender", "target", "tunnel", "splice", "ticket")
    SWARM_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    SPLICE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    swarm: str
    sender: str
    target: str
    tunnel: int
    splice: bool
    ticket: bytes
    def __init__(self, swarm: _Optional[str] = ..., sender: _Optional[str] = ..., target: _Optional[str] = ..., tunnel: _Optional[int] = ..., splice: _Optional[bool] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("open", "data")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    open: RelayOpen
    data: bytes
    def __init__(self, open: _Optional[_Union[RelayOpen, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
