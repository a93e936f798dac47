"""Operations and their results: :class:`Op` (one get/put/insert/update/delete, what
``Client.batch`` takes) and :class:`OpResult` (what it returns for each), and the conversion of
keys and values to bytes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

from ._proto import kv_pb2
from .errors import DinomoError

#: What the SDK accepts as a key or a value: bytes-like, or ``str`` (encoded as UTF-8).
BytesLike = Union[bytes, bytearray, memoryview, str]
#: What an operation returns: Get the value (None: missing), Delete whether the key existed,
#: writes None.
Value = Union[bytes, bool, None]


def to_bytes(b: BytesLike, what: str = "key") -> bytes:
    """``b`` as bytes (``str`` as UTF-8); TypeError for anything else."""
    if isinstance(b, bytes):
        return b
    if isinstance(b, str):
        return b.encode("utf-8")
    if isinstance(b, (bytearray, memoryview)):
        return bytes(b)
    raise TypeError(f"a {what} must be bytes or str, not {type(b).__name__}")


class OpKind(enum.Enum):
    GET = "get"
    PUT = "put"
    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"


_PUT_MODE = {
    OpKind.PUT: kv_pb2.UPSERT,
    OpKind.INSERT: kv_pb2.INSERT,
    OpKind.UPDATE: kv_pb2.UPDATE,
}


@dataclass(frozen=True)
class Op:
    """One operation. Build with :meth:`get`, :meth:`put`, :meth:`insert`, :meth:`update`,
    :meth:`delete`."""

    kind: OpKind
    key: bytes
    value: bytes = b""

    @staticmethod
    def get(key: BytesLike) -> "Op":
        return Op(OpKind.GET, to_bytes(key))

    @staticmethod
    def put(key: BytesLike, value: BytesLike) -> "Op":
        """Create or replace."""
        return Op(OpKind.PUT, to_bytes(key), to_bytes(value, "value"))

    @staticmethod
    def insert(key: BytesLike, value: BytesLike) -> "Op":
        """Create only (AlreadyExists if the key exists)."""
        return Op(OpKind.INSERT, to_bytes(key), to_bytes(value, "value"))

    @staticmethod
    def update(key: BytesLike, value: BytesLike) -> "Op":
        """Replace only (NotFound if the key does not exist)."""
        return Op(OpKind.UPDATE, to_bytes(key), to_bytes(value, "value"))

    @staticmethod
    def delete(key: BytesLike) -> "Op":
        return Op(OpKind.DELETE, to_bytes(key))

    @property
    def idempotent(self) -> bool:
        """Reads may always be retried; writes only when they surely never left the client."""
        return self.kind is OpKind.GET

    @property
    def size(self) -> int:
        """The key's and value's bytes together."""
        return len(self.key) + len(self.value)

    def to_request(self, id: int) -> kv_pb2.KvRequest:
        if self.kind is OpKind.GET:
            return kv_pb2.KvRequest(id=id, get=kv_pb2.GetRequest(key=self.key))
        if self.kind is OpKind.DELETE:
            return kv_pb2.KvRequest(id=id, delete=kv_pb2.DeleteRequest(key=self.key))
        put = kv_pb2.PutRequest(key=self.key, value=self.value, mode=_PUT_MODE[self.kind])
        return kv_pb2.KvRequest(id=id, put=put)


@dataclass(frozen=True)
class OpResult:
    """The outcome of one operation of a batch: ``value`` (as the single-op method returns
    it) or ``error`` (the exception it would raise)."""

    op: Op
    value: Value = None
    error: Optional[DinomoError] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def result(self) -> Value:
        """The value, or raises the error."""
        if self.error is not None:
            raise self.error
        return self.value
