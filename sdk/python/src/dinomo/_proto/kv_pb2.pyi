from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPSERT: _ClassVar[PutMode]
    INSERT: _ClassVar[PutMode]
    UPDATE: _ClassVar[PutMode]
UPSERT: PutMode
INSERT: PutMode
UPDATE: PutMode

class MapRequest(_message.Message):
    __slots__ = ("map",)
    MAP_FIELD_NUMBER: _ClassVar[int]
    map: bytes
    def __init__(self, map: _Optional[bytes] = ...) -> None: ...

class MapReply(_message.Message):
    __slots__ = ("map_version",)
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    map_version: int
    def __init__(self, map_version: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("key", "value", "mode")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    mode: PutMode
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., mode: _Optional[_Union[PutMode, str]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvRequest(_message.Message):
    __slots__ = ("id", "get", "put", "delete")
    ID_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    id: int
    get: GetRequest
    put: PutRequest
    delete: DeleteRequest
    def __init__(self, id: _Optional[int] = ..., get: _Optional[_Union[GetRequest, _Mapping]] = ..., put: _Optional[_Union[PutRequest, _Mapping]] = ..., delete: _Optional[_Union[DeleteRequest, _Mapping]] = ...) -> None: ...

class KvResponse(_message.Message):
    __slots__ = ("id", "code", "message", "value", "map_version")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    message: str
    value: bytes
    map_version: int
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., value: _Optional[bytes] = ..., map_version: _Optional[int] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[KvRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[KvRequest, _Mapping]]] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[KvResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[KvResponse, _Mapping]]] = ...) -> None: ...

class KnStatsRequest(_message.Message):
    __slots__ = ("top_keys",)
    TOP_KEYS_FIELD_NUMBER: _ClassVar[int]
    top_keys: int
    def __init__(self, top_keys: _Optional[int] = ...) -> None: ...

class KeyCount(_message.Message):
    __slots__ = ("key", "count")
    KEY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    count: int
    def __init__(self, key: _Optional[bytes] = ..., count: _Optional[int] = ...) -> None: ...

class KnStatsResponse(_message.Message):
    __slots__ = ("kn_id", "map_version", "gets", "puts", "deletes", "value_hits", "shortcut_hits", "unmerged_hits", "misses", "wrong_owner", "round_trips", "bytes_read", "bytes_written", "occupancy", "top_keys", "batches", "cache_values", "cache_shortcuts", "promotions", "demotions")
    KN_ID_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    DELETES_FIELD_NUMBER: _ClassVar[int]
    VALUE_HITS_FIELD_NUMBER: _ClassVar[int]
    SHORTCUT_HITS_FIELD_NUMBER: _ClassVar[int]
    UNMERGED_HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    WRONG_OWNER_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    TOP_KEYS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_VALUES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SHORTCUTS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    kn_id: int
    map_version: int
    gets: int
    puts: int
    deletes: int
    value_hits: int
    shortcut_hits: int
    unmerged_hits: int
    misses: int
    wrong_owner: int
    round_trips: int
    bytes_read: int
    bytes_written: int
    occupancy: float
    top_keys: _containers.RepeatedCompositeFieldContainer[KeyCount]
    batches: int
    cache_values: int
    cache_shortcuts: int
    promotions: int
    demotions: int
    def __init__(self, kn_id: _Optional[int] = ..., map_version: _Optional[int] = ..., gets: _Optional[int] = ..., puts: _Optional[int] = ..., deletes: _Optional[int] = ..., value_hits: _Optional[int] = ..., shortcut_hits: _Optional[int] = ..., unmerged_hits: _Optional[int] = ..., misses: _Optional[int] = ..., wrong_owner: _Optional[int] = ..., round_trips: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., occupancy: _Optional[float] = ..., top_keys: _Optional[_Iterable[_Union[KeyCount, _Mapping]]] = ..., batches: _Optional[int] = ..., cache_values: _Optional[int] = ..., cache_shortcuts: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ...) -> None: ...
