from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyRequest(_message.Message):
    __slots__ = ("toml",)
    TOML_FIELD_NUMBER: _ClassVar[int]
    toml: str
    def __init__(self, toml: _Optional[str] = ...) -> None: ...

class PolicyReply(_message.Message):
    __slots__ = ("toml",)
    TOML_FIELD_NUMBER: _ClassVar[int]
    toml: str
    def __init__(self, toml: _Optional[str] = ...) -> None: ...

class LatencyReport(_message.Message):
    __slots__ = ("client_id", "count", "sum_us", "p99_us", "per_kn")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_US_FIELD_NUMBER: _ClassVar[int]
    P99_US_FIELD_NUMBER: _ClassVar[int]
    PER_KN_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    count: int
    sum_us: int
    p99_us: int
    per_kn: _containers.RepeatedCompositeFieldContainer[KnLatency]
    def __init__(self, client_id: _Optional[str] = ..., count: _Optional[int] = ..., sum_us: _Optional[int] = ..., p99_us: _Optional[int] = ..., per_kn: _Optional[_Iterable[_Union[KnLatency, _Mapping]]] = ...) -> None: ...

class KnLatency(_message.Message):
    __slots__ = ("kn_id", "count", "sum_us")
    KN_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_US_FIELD_NUMBER: _ClassVar[int]
    kn_id: int
    count: int
    sum_us: int
    def __init__(self, kn_id: _Optional[int] = ..., count: _Optional[int] = ..., sum_us: _Optional[int] = ...) -> None: ...

class LatencyReply(_message.Message):
    __slots__ = ("report_every_ms",)
    REPORT_EVERY_MS_FIELD_NUMBER: _ClassVar[int]
    report_every_ms: int
    def __init__(self, report_every_ms: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KnStatus(_message.Message):
    __slots__ = ("kn_id", "endpoint", "occupancy", "ops", "alive")
    KN_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    kn_id: int
    endpoint: str
    occupancy: float
    ops: int
    alive: bool
    def __init__(self, kn_id: _Optional[int] = ..., endpoint: _Optional[str] = ..., occupancy: _Optional[float] = ..., ops: _Optional[int] = ..., alive: _Optional[bool] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("at_ms", "action", "reason", "map_version")
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    at_ms: int
    action: str
    reason: str
    map_version: int
    def __init__(self, at_ms: _Optional[int] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ..., map_version: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("map_version", "kns", "avg_latency_us", "p99_latency_us", "epoch", "recent", "replicated", "orchestrator")
    class ReplicatedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNS_FIELD_NUMBER: _ClassVar[int]
    AVG_LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    P99_LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_FIELD_NUMBER: _ClassVar[int]
    map_version: int
    kns: _containers.RepeatedCompositeFieldContainer[KnStatus]
    avg_latency_us: float
    p99_latency_us: float
    epoch: int
    recent: _containers.RepeatedCompositeFieldContainer[Decision]
    replicated: _containers.ScalarMap[str, int]
    orchestrator: str
    def __init__(self, map_version: _Optional[int] = ..., kns: _Optional[_Iterable[_Union[KnStatus, _Mapping]]] = ..., avg_latency_us: _Optional[float] = ..., p99_latency_us: _Optional[float] = ..., epoch: _Optional[int] = ..., recent: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., replicated: _Optional[_Mapping[str, int]] = ..., orchestrator: _Optional[str] = ...) -> None: ...

class AddKnRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KnRequest(_message.Message):
    __slots__ = ("kn_id",)
    KN_ID_FIELD_NUMBER: _ClassVar[int]
    kn_id: int
    def __init__(self, kn_id: _Optional[int] = ...) -> None: ...

class ActionReply(_message.Message):
    __slots__ = ("map_version", "message", "kn_id", "recovery_us")
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KN_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_US_FIELD_NUMBER: _ClassVar[int]
    map_version: int
    message: str
    kn_id: int
    recovery_us: int
    def __init__(self, map_version: _Optional[int] = ..., message: _Optional[str] = ..., kn_id: _Optional[int] = ..., recovery_us: _Optional[int] = ...) -> None: ...
