from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetClusterMapRequest(_message.Message):
    __slots__ = ("newer_than",)
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    newer_than: int
    def __init__(self, newer_than: _Optional[int] = ...) -> None: ...

class WatchClusterMapRequest(_message.Message):
    __slots__ = ("known_version",)
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    known_version: int
    def __init__(self, known_version: _Optional[int] = ...) -> None: ...

class ClusterMapReply(_message.Message):
    __slots__ = ("version", "map", "monitor")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    version: int
    map: bytes
    monitor: str
    def __init__(self, version: _Optional[int] = ..., map: _Optional[bytes] = ..., monitor: _Optional[str] = ...) -> None: ...
