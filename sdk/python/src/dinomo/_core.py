"""The I/O-free part of both clients: settings, channel options, how each answer is judged
(done, failed, or retried after a map refresh or a backoff) and the bookkeeping of one call's
retries within its deadline. ``client.py`` (threads) and ``aio.py`` (asyncio) only move bytes.

The rules are the Rust SDK's (client/src/lib.rs ``execute_at_owner``) and the routing
contract's section 6:

* OK, NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT, RESOURCE_EXHAUSTED: final.
* FAILED_PRECONDITION (wrong owner): fetch a map newer than the one used, route again.
* UNAVAILABLE and other answers of a KN: back off (jittered, doubling), route again.
* UNKNOWN for a write: :class:`~dinomo.errors.OutcomeUnknown`, never retried.
* A transport failure after a write was sent (reset, timeout): OutcomeUnknown. Before it could
  be sent (the channel to the KN was not connected and could not connect): retried. Reads are
  always retried.
* UNAUTHENTICATED / PERMISSION_DENIED from the access layer (before any handler ran):
  :class:`~dinomo.errors.PermissionDenied`.

Everything is retried only until the call's one deadline; then
:class:`~dinomo.errors.Unavailable` names the attempts and the last reason.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import grpc

from ._latency import Recorder
from ._proto import kv_pb2
from .credentials import SERVICE_NAMES, Identity
from .errors import (
    AlreadyExists,
    DinomoError,
    InvalidArgument,
    NotFound,
    OutcomeUnknown,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from .ops import Op, OpKind, OpResult
from .routing import ClusterMap

#: Trailer a KV node puts on its own error statuses (proto/src/lib.rs KN_ANSWER_TRAILER).
KN_ANSWER_TRAILER = "dinomo-kn"
#: The largest request frame a KN reads is 64 MiB; one operation may carry up to this much.
MAX_OP_BYTES = (64 << 20) - 1024
#: A Batch RPC carries at most this many operations / bytes; larger groups are split.
MAX_BATCH_OPS = 1024
MAX_BATCH_BYTES = 8 << 20

# google.rpc.Code values used in KvResponse.code.
OK, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS = 0, 2, 3, 5, 6
RESOURCE_EXHAUSTED, FAILED_PRECONDITION, UNAVAILABLE = 8, 9, 14


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a client (defaults as the Rust SDK's ``ClientConfig::new``).

    ``deadline``: how long one call may keep retrying (seconds). ``min_backoff`` /
    ``max_backoff``: the first retry delay, doubled up to the max, jittered x0.75..1.25.
    ``rpc_timeout``: one attempt's limit. ``connect_timeout``: how long an attempt waits for a
    connection to a KN that is not connected. ``report_latency``: send latencies to the
    monitor every ``report_every`` seconds (``_latency.py``; on by default: without them the
    monitor's policy cannot tell a loaded cluster from an idle one); ``monitor``: its
    ``host:port``, default the one the routing nodes name.
    """

    deadline: float = 10.0
    min_backoff: float = 0.002
    max_backoff: float = 0.2
    rpc_timeout: float = 5.0
    connect_timeout: float = 2.0
    report_latency: bool = True
    monitor: Optional[str] = None
    report_every: float = 1.0

    def __post_init__(self) -> None:
        for name in ("deadline", "min_backoff", "max_backoff", "rpc_timeout", "connect_timeout", "report_every"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"ClientConfig.{name} must be positive")


def channel_options(identity: Optional[Identity], service: str) -> list[tuple[str, Union[str, int]]]:
    """gRPC channel options: 64 MiB messages both ways; reconnection attempts at most 2 s apart
    (gRPC's default grows to 2 minutes, far past a call's deadline, and a node that `dinomo up`
    restarts comes back at the same address); and under TLS the server name that the
    cluster's certificates carry for ``service`` (``kv`` or ``routing``)."""
    options: list[tuple[str, Union[str, int]]] = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if identity is not None:
        options.append(("grpc.ssl_target_name_override", SERVICE_NAMES[service]))
    return options


def channel_credentials(identity: Identity) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=identity.ca_pem,
        private_key=identity.key_pem,
        certificate_chain=identity.cert_pem,
    )


def check_endpoint(endpoint: str) -> str:
    """``host:port`` (an ``http://`` or ``https://`` prefix is dropped, as the Rust SDK does)."""
    authority = endpoint
    for prefix in ("http://", "https://"):
        if authority.startswith(prefix):
            authority = authority[len(prefix):]
    authority = authority.rstrip("/")
    host, sep, port = authority.rpartition(":")
    if not sep or not host or "/" in authority or not port.isdigit():
        raise InvalidArgument(f"bad address {endpoint!r}: expected host:port")
    return authority


def from_kn(err: grpc.RpcError) -> bool:
    """Was this status produced by a KV node (its trailer), not by the transport?"""
    trailers = getattr(err, "trailing_metadata", None)
    md = trailers() if callable(trailers) else None
    return any(k == KN_ANSWER_TRAILER for k, _ in (md or ()))


def status_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return code, details or ""


@dataclass(frozen=True)
class Retry:
    """An attempt that did not decide the operation: why, and which map refresh it calls for
    (``newer_than``: a map newer than that version; ``any_map``: whatever is newest)."""

    reason: str
    newer_than: Optional[int] = None
    any_map: bool = False


Verdict = Union[OpResult, Retry]


def judge_response(op: Op, r: kv_pb2.KvResponse, map_version: int) -> Verdict:
    """One KvResponse (a KN's answer to one operation)."""
    code, msg = r.code, r.message
    if code == OK:
        if op.kind is OpKind.GET:
            return OpResult(op, bytes(r.value))
        if op.kind is OpKind.DELETE:
            return OpResult(op, True)
        return OpResult(op, None)
    if code == NOT_FOUND:
        if op.kind is OpKind.GET:
            return OpResult(op, None)
        if op.kind is OpKind.DELETE:
            return OpResult(op, False)
        return OpResult(op, error=NotFound(msg or "the key does not exist"))
    final = _final_error(code, msg)
    if final is not None:
        return OpResult(op, error=final)
    if code == UNKNOWN and not op.idempotent:
        return OpResult(op, error=OutcomeUnknown(msg))
    if code == FAILED_PRECONDITION:
        return Retry(msg, newer_than=map_version)
    return Retry(msg or f"code {code}")


def _final_error(code: int, msg: str) -> Optional[DinomoError]:
    if code == ALREADY_EXISTS:
        return AlreadyExists(msg or "the key already exists")
    if code == INVALID_ARGUMENT:
        return InvalidArgument(msg)
    if code == RESOURCE_EXHAUSTED:
        return ResourceExhausted(msg)
    return None


def judge_rpc_error(
    op: Op, code: grpc.StatusCode, details: str, kn_answer: bool, sent: bool, endpoint: str, map_version: int
) -> Verdict:
    """A whole Batch call that failed with status ``code``. ``kn_answer``: the status carries
    the KN's trailer. ``sent``: the request may have left this process."""
    where = f"{endpoint}: {code.name}: {details}"
    if kn_answer:
        if code == grpc.StatusCode.NOT_FOUND:
            return judge_response(op, kv_pb2.KvResponse(code=NOT_FOUND, message=details), map_version)
        final = _final_error(code.value[0], details)
        if final is not None:
            return OpResult(op, error=final)
        if code == grpc.StatusCode.UNKNOWN and not op.idempotent:
            return OpResult(op, error=OutcomeUnknown(where))
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return Retry(where, newer_than=map_version)
        return Retry(where)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # The access layer refuses before any handler runs: nothing was applied.
        return OpResult(op, error=PermissionDenied(where))
    if sent and not op.idempotent:
        return OpResult(op, error=OutcomeUnknown(where))
    return Retry(where, any_map=True)


def never_sent(op: Op, endpoint: str, why: str, map_version: int) -> Verdict:
    """An attempt that could not send (no connection to the KN): safe to retry any op."""
    return judge_rpc_error(op, grpc.StatusCode.UNAVAILABLE, why, False, False, endpoint, map_version)


@dataclass
class Group:
    """The operations (indices into the call's ops) of one Batch RPC to one KN."""

    endpoint: str
    indices: list[int]

    def request(self, ops: Sequence[Op]) -> kv_pb2.BatchRequest:
        return kv_pb2.BatchRequest(requests=[ops[i].to_request(n + 1) for n, i in enumerate(self.indices)])


class Call:
    """One client call (one op, or a batch on distinct keys): which ops are still pending,
    their results, attempts and last errors, the backoff, and the deadline.

    A round: :meth:`plan` the pending ops on the current map into :class:`Group`\\ s, send
    them, :meth:`settle` each op's verdict, then :meth:`refresh_wanted` / :meth:`next_delay`.
    """

    def __init__(self, ops: Sequence[Op], cfg: ClientConfig) -> None:
        self.ops = list(ops)
        self.cfg = cfg
        self.start = time.monotonic()
        self.deadline = self.start + cfg.deadline
        self.results: list[Optional[OpResult]] = [None] * len(self.ops)
        #: The KN each op was last sent to (for the latency reports).
        self.kns: list[Optional[int]] = [None] * len(self.ops)
        self.attempts = [0] * len(self.ops)
        self.last = [""] * len(self.ops)
        self.backoff = cfg.min_backoff
        self.pending: list[int] = []
        self._newer_than: Optional[int] = None
        self._any_map = False
        for i, op in enumerate(self.ops):
            if op.size > MAX_OP_BYTES:
                # Refused here: the KN would refuse the whole frame.
                self.results[i] = OpResult(op, error=InvalidArgument(
                    f"key and value of {op.size} bytes together; at most {MAX_OP_BYTES} fit a request"))
            else:
                self.pending.append(i)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def attempt_timeout(self) -> float:
        """One attempt's timeout: the RPC timeout, cut to what the deadline leaves (at least a
        little, so that the last attempt can still answer)."""
        return max(0.05, min(self.cfg.rpc_timeout, self.remaining()))

    def plan(self, m: ClusterMap) -> list[Group]:
        """Routes the pending ops on map ``m``; ops that no KN owns are settled as retries."""
        by_endpoint: dict[str, list[int]] = {}
        for i in self.pending:
            self.attempts[i] += 1
            kn = m.pick_owner(self.ops[i].key)
            self.kns[i] = kn
            endpoint = None if kn is None else m.endpoint(kn)
            if endpoint is None:
                self.settle(i, Retry(f"no KV node owns the key under map version {m.version}",
                                     newer_than=m.version))
            else:
                by_endpoint.setdefault(endpoint, []).append(i)
        groups: list[Group] = []
        for endpoint, indices in by_endpoint.items():
            chunk: list[int] = []
            size = 0
            for i in indices:
                if chunk and (len(chunk) >= MAX_BATCH_OPS or size + self.ops[i].size > MAX_BATCH_BYTES):
                    groups.append(Group(endpoint, chunk))
                    chunk, size = [], 0
                chunk.append(i)
                size += self.ops[i].size
            groups.append(Group(endpoint, chunk))
        return groups

    def settle(self, i: int, v: Verdict) -> None:
        if isinstance(v, OpResult):
            self.results[i] = v
            return
        self.last[i] = v.reason
        if v.newer_than is not None:
            self._newer_than = v.newer_than if self._newer_than is None else max(self._newer_than, v.newer_than)
        if v.any_map:
            self._any_map = True

    def settle_group(self, g: Group, resp: kv_pb2.BatchResponse, map_version: int) -> None:
        """A Batch's answer: one response per request, in order."""
        if len(resp.responses) != len(g.indices):
            for i in g.indices:
                self.settle(i, judge_rpc_error(self.ops[i], grpc.StatusCode.INTERNAL,
                                               f"{len(resp.responses)} answers to {len(g.indices)} requests",
                                               False, True, g.endpoint, map_version))
            return
        for i, r in zip(g.indices, resp.responses):
            self.settle(i, judge_response(self.ops[i], r, map_version))

    def settle_group_error(self, g: Group, err: grpc.RpcError, map_version: int) -> None:
        code, details = status_of(err)
        kn = from_kn(err)
        for i in g.indices:
            self.settle(i, judge_rpc_error(self.ops[i], code, details, kn, True, g.endpoint, map_version))

    def settle_group_unsent(self, g: Group, why: str, map_version: int) -> None:
        for i in g.indices:
            self.settle(i, never_sent(self.ops[i], g.endpoint, why, map_version))

    def refresh_wanted(self) -> tuple[bool, Optional[int]]:
        """Whether this round calls for a map refresh, and ``newer_than`` for it (None: any).
        Resets the request."""
        wanted = self._any_map or self._newer_than is not None
        newer = None if self._any_map else self._newer_than
        self._any_map, self._newer_than = False, None
        return wanted, newer

    def next_delay(self) -> Optional[float]:
        """After a round: None when every op is settled (ops past the deadline are settled as
        :class:`Unavailable`), else the backoff to sleep before the next round."""
        self.pending = [i for i in self.pending if self.results[i] is None]
        if not self.pending:
            return None
        if time.monotonic() >= self.deadline:
            for i in self.pending:
                self.results[i] = OpResult(self.ops[i], error=Unavailable(
                    f"deadline of {self.cfg.deadline:g} s exceeded after {self.attempts[i]} attempts; "
                    f"last error: {self.last[i]}", self.attempts[i], self.last[i]))
            self.pending = []
            return None
        delay = min(self.backoff * random.uniform(0.75, 1.25), self.remaining())
        self.backoff = min(self.backoff * 2, self.cfg.max_backoff)
        return delay

    def record(self, recorder: Optional["Recorder"]) -> None:
        """Adds the finished ops' latencies to ``recorder`` (not those refused as invalid)."""
        if recorder is None:
            return
        elapsed = time.monotonic() - self.start
        for r, kn in zip(self.results, self.kns):
            if r is not None and not isinstance(r.error, InvalidArgument):
                recorder.record(kn, elapsed)

    def outcome(self) -> list[OpResult]:
        out = [r for r in self.results if r is not None]
        assert len(out) == len(self.ops), "every op is settled"
        return out
