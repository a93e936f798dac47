"""Dinomo's Python SDK.

    import dinomo
    with dinomo.connect(["127.0.0.1:7900"]) as client:
        client.put("greeting", "hello")
        assert client.get("greeting") == b"hello"

:func:`connect` returns a blocking :class:`Client`; ``dinomo.aio.connect`` its asyncio twin.
Modules: ``client`` / ``aio`` (I/O), ``_core`` (retry rules), ``routing`` (the routing
contract), ``credentials`` (finding the TLS identity), ``ops`` (operations and results),
``errors`` (exceptions), ``_latency`` (latency reports to the monitor).
"""
from ._core import ClientConfig
from .client import Client, connect
from .errors import (
    AlreadyExists,
    CredentialsError,
    DinomoError,
    InvalidArgument,
    NoClusterMap,
    NotFound,
    OutcomeUnknown,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from .ops import Op, OpKind, OpResult
from .routing import ClusterMap

__version__ = "0.1.0"

__all__ = [
    "AlreadyExists",
    "Client",
    "ClientConfig",
    "ClusterMap",
    "CredentialsError",
    "DinomoError",
    "InvalidArgument",
    "NoClusterMap",
    "NotFound",
    "Op",
    "OpKind",
    "OpResult",
    "OutcomeUnknown",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "connect",
]
