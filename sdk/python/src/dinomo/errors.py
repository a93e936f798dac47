"""The SDK's exceptions: one class per outcome a caller handles differently.

Every exception the SDK raises on purpose is a :class:`DinomoError`. The classes mirror the Rust
SDK's ``ClientError`` (client/src/error.rs): :class:`NotFound` (update of a missing key),
:class:`AlreadyExists` (insert of an existing key), :class:`InvalidArgument` (fix the request;
retrying won't help), :class:`ResourceExhausted` (the pool is full; nothing was written),
:class:`OutcomeUnknown` (a write that may or may not have been applied: never retried by the
SDK), :class:`Unavailable` (the deadline passed while the cluster could not serve the
operation; its subclass :class:`NoClusterMap` when no routing node gave a map) and
:class:`PermissionDenied` (the cluster refused this caller's identity).
"""
from __future__ import annotations


class DinomoError(Exception):
    """Base class of every error the SDK raises."""


class NotFound(DinomoError):
    """Update of a key that does not exist."""

    def __init__(self, message: str = "the key does not exist") -> None:
        super().__init__(message)


class AlreadyExists(DinomoError):
    """Insert of a key that already exists."""

    def __init__(self, message: str = "the key already exists") -> None:
        super().__init__(message)


class InvalidArgument(DinomoError):
    """The request is malformed (empty or oversized key or value, bad address, unreadable
    credentials...): fix it, retrying won't help."""


class CredentialsError(InvalidArgument):
    """A credentials folder named explicitly (argument or ``DINOMO_CREDENTIALS`` with
    ``credentials=...``) lacks the files of the identity, or they cannot be read."""


class ResourceExhausted(DinomoError):
    """The cluster's memory pool is full: the write was not applied. Delete or overwrite keys,
    or use a larger pool; retrying the same write right away won't help."""


class OutcomeUnknown(DinomoError):
    """A write failed in a way that hides whether it was applied (the KV node or the connection
    died while it was in flight, or the node's log write failed). The SDK never retries such a
    write; read the key to find out."""


class Unavailable(DinomoError):
    """The operation's deadline passed while the cluster could not serve it (the owner was
    unreachable, moving or reconfiguring). Nothing is known to have been applied, except as
    :class:`OutcomeUnknown` would have said. ``attempts`` counts the tries; ``last`` is the
    last reason."""

    def __init__(self, message: str, attempts: int = 0, last: str = "") -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last = last


class NoClusterMap(Unavailable):
    """No routing node answered with a cluster map within the deadline."""


class PermissionDenied(DinomoError):
    """The cluster refused this caller (no client certificate, or one whose role may not call
    the operation). Check the credentials: ``DINOMO_CREDENTIALS``, ``.dinomo/credentials`` or
    ``credentials=``; a cluster started with ``--insecure`` needs ``insecure=True``."""
