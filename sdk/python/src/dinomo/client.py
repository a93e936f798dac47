"""The blocking client: :func:`connect` and :class:`Client`.

Owns the I/O of the threaded flavour: one gRPC channel per routing node and per KV node
(kept across maps), the cached cluster map, and the loop that sends each round of a call's
operations (one ``KvService.Batch`` per KN, all in flight together) and sleeps between rounds.
What each answer means and when to retry is decided in ``_core.py``; routing in
``routing.py``. A client is safe to share between threads.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Iterable, Optional, Sequence

import grpc

from . import _core
from ._latency import MAX_MONITOR_ASK_GAP, Recorder, client_id
from ._proto import kv_pb2_grpc, monitor_pb2_grpc, routing_pb2, routing_pb2_grpc
from .credentials import Identity, PathLike, discover
from .errors import DinomoError, InvalidArgument, NoClusterMap, PermissionDenied
from .ops import BytesLike, Op, OpResult
from .routing import ClusterMap, MapError


def _channel(endpoint: str, identity: Optional[Identity], service: str) -> grpc.Channel:
    options = _core.channel_options(identity, service)
    if identity is None:
        return grpc.insecure_channel(endpoint, options=options)
    return grpc.secure_channel(endpoint, _core.channel_credentials(identity), options=options)


class _KvNode:
    """The channel to one KV node, and whether it is connected (tracked by a subscription, so
    an operation knows without a round trip whether a request it sends can reach the node)."""

    def __init__(self, endpoint: str, identity: Optional[Identity]) -> None:
        self.endpoint = endpoint
        self.channel = _channel(endpoint, identity, "kv")
        self.stub = kv_pb2_grpc.KvServiceStub(self.channel)
        self._state: Optional[grpc.ChannelConnectivity] = None
        self.channel.subscribe(self._on_state, try_to_connect=True)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        self._state = state

    def connect(self, timeout: float) -> bool:
        """True once the channel is connected; waits up to ``timeout`` if it is not."""
        if self._state is grpc.ChannelConnectivity.READY:
            return True
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    def unsubscribe(self) -> None:
        self.channel.unsubscribe(self._on_state)

    def close(self) -> None:
        _close_channels([self])


def _close_channels(nodes: list[_KvNode]) -> None:
    """Ends the state subscriptions, waits until gRPC's polling thread of each channel has
    noticed (it checks every 0.2 s; closing a channel under it makes that thread raise
    "Cannot monitor channel state: Channel closed!"), then closes the channels."""
    for n in nodes:
        n.unsubscribe()
    deadline = time.monotonic() + 1.0
    for n in nodes:
        # grpcio keeps the poller's state in a private attribute; without it, wait one period.
        state = getattr(n.channel, "_connectivity_state", None)
        if state is None:
            time.sleep(0.25)
            break
        while getattr(state, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.01)
    for n in nodes:
        n.channel.close()


class Client:
    """A Dinomo client (blocking). Create with :func:`connect`; close with :meth:`close` or a
    ``with`` block.

    Each operation goes straight to the KV node that owns its key under the cached cluster
    map; WRONG_OWNER refreshes the map, UNAVAILABLE backs off, both retried within
    ``config.deadline``. A write whose outcome cannot be known raises
    :class:`~dinomo.OutcomeUnknown` and is never retried.
    """

    def __init__(self, routing: Sequence[str], identity: Optional[Identity], config: _core.ClientConfig) -> None:
        if not routing:
            raise InvalidArgument("no routing node given")
        self.config = config
        self.identity = identity
        names = [_core.check_endpoint(e) for e in routing]
        self._routing_channels = [_channel(r, identity, "routing") for r in names]
        self._routing = [(r, routing_pb2_grpc.RoutingServiceStub(ch))
                         for r, ch in zip(names, self._routing_channels)]
        self._next_routing = 0
        self._map: Optional[ClusterMap] = None
        self._monitor = ""
        self._nodes: dict[str, _KvNode] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._recorder: Optional[Recorder] = Recorder() if config.report_latency else None
        self._stop_reports = threading.Event()
        self._reporter: Optional[threading.Thread] = None

    def _start_reports(self) -> None:
        if self._recorder is None:
            return
        self._reporter = threading.Thread(
            target=_report_loop, args=(weakref.ref(self), self._stop_reports, self.config.report_every),
            name="dinomo-latency-reports", daemon=True)
        self._reporter.start()

    # -- the map ---------------------------------------------------------------------------

    @property
    def map(self) -> ClusterMap:
        """The cluster map in use."""
        m = self._map
        if m is None:
            raise NoClusterMap("no cluster map fetched yet")
        return m

    @property
    def monitor(self) -> str:
        """The monitor address the routing nodes named with the map ('' when none)."""
        return self._monitor

    def refresh_map(self, newer_than: Optional[int] = None, timeout: Optional[float] = None) -> ClusterMap:
        """Fetches the map from a routing node (trying each in turn), waiting briefly (up to 3 s,
        the routing node's limit) for one newer than ``newer_than`` if given; keeps the highest
        version seen and returns it. ``timeout`` bounds each routing call (default: the RPC
        timeout)."""
        last = "no routing node tried"
        for _ in range(len(self._routing)):
            with self._lock:
                name, stub = self._routing[self._next_routing % len(self._routing)]
            req = routing_pb2.GetClusterMapRequest()
            if newer_than is not None:
                req.newer_than = newer_than
            try:
                reply = stub.GetClusterMap(req, timeout=timeout or self.config.rpc_timeout)
            except grpc.RpcError as e:
                code, details = _core.status_of(e)
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise PermissionDenied(f"{name}: {details}") from None
                last = f"{name}: {code.name}: {details}"
                with self._lock:
                    self._next_routing += 1
                continue
            try:
                m = ClusterMap.decode(reply.map)
            except MapError as e:
                raise NoClusterMap(f"{name}: {e}") from None
            with self._lock:
                if reply.monitor:
                    self._monitor = reply.monitor
                if self._map is None or m.version > self._map.version:
                    self._map = m
                return self._map
        raise NoClusterMap(f"no cluster map: {last}{self._plain_text_hint()}", last=last)

    def _plain_text_hint(self) -> str:
        if self.identity is not None:
            return ""
        return ("; this client uses plain text (no credentials found: set DINOMO_CREDENTIALS, "
                "run where .dinomo/credentials is, or pass credentials=), which a cluster with "
                "TLS refuses")

    def _first_map(self) -> None:
        deadline = time.monotonic() + self.config.deadline
        while True:
            try:
                self.refresh_map()
                return
            except NoClusterMap:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _node(self, endpoint: str) -> _KvNode:
        with self._lock:
            n = self._nodes.get(endpoint)
            if n is None:
                n = self._nodes[endpoint] = _KvNode(endpoint, self.identity)
            return n

    # -- operations ------------------------------------------------------------------------

    def _run(self, ops: Sequence[Op]) -> list[OpResult]:
        if self._closed:
            raise InvalidArgument("the client is closed")
        call = _core.Call(ops, self.config)
        while call.pending:
            m = self.map
            groups = call.plan(m)
            ready: list[tuple[_core.Group, _KvNode]] = []
            for g in groups:
                node = self._node(g.endpoint)
                if node.connect(min(self.config.connect_timeout, call.remaining())):
                    ready.append((g, node))
                else:
                    call.settle_group_unsent(g, "could not connect", m.version)
            if len(ready) == 1:
                # One KN (every single-key call): a plain blocking call, cheaper than a future.
                g, node = ready[0]
                try:
                    resp = node.stub.Batch(g.request(call.ops), timeout=call.attempt_timeout())
                    call.settle_group(g, resp, m.version)
                except grpc.RpcError as e:
                    call.settle_group_error(g, e, m.version)
            else:
                # Several KNs: every call in flight at once, then their answers.
                sent = [(g, node.stub.Batch.future(g.request(call.ops), timeout=call.attempt_timeout()))
                        for g, node in ready]
                for g, fut in sent:
                    try:
                        call.settle_group(g, fut.result(), m.version)
                    except grpc.RpcError as e:
                        call.settle_group_error(g, e, m.version)
            wanted, newer = call.refresh_wanted()
            if wanted:
                try:
                    self.refresh_map(newer, call.attempt_timeout())
                except DinomoError:
                    pass  # best effort: the next round routes on the map we have
            delay = call.next_delay()
            if delay is None:
                break
            time.sleep(delay)
        call.record(self._recorder)
        return call.outcome()

    def _one(self, op: Op) -> OpResult:
        return self._run([op])[0]

    def get(self, key: BytesLike) -> Optional[bytes]:
        """The value of ``key``, or None if it does not exist."""
        return self._one(Op.get(key)).result()  # type: ignore[return-value]

    def put(self, key: BytesLike, value: BytesLike) -> None:
        """Creates or replaces ``key``."""
        self._one(Op.put(key, value)).result()

    def insert(self, key: BytesLike, value: BytesLike) -> None:
        """Creates ``key``; :class:`~dinomo.AlreadyExists` if it exists."""
        self._one(Op.insert(key, value)).result()

    def update(self, key: BytesLike, value: BytesLike) -> None:
        """Replaces ``key``; :class:`~dinomo.NotFound` if it does not exist."""
        self._one(Op.update(key, value)).result()

    def delete(self, key: BytesLike) -> bool:
        """Deletes ``key``; returns whether it existed."""
        return bool(self._one(Op.delete(key)).result())

    def batch(self, ops: Iterable[Op]) -> list[OpResult]:
        """Runs several operations and returns their results in order (each an
        :class:`~dinomo.OpResult`: ``.value`` or ``.error``; ``.result()`` raises). Operations on
        distinct keys go together, one Batch RPC per KV node, each with the retry rules of a
        single call; if a key appears more than once, the operations run one at a time in the
        order given."""
        ops = list(ops)
        for op in ops:
            if not isinstance(op, Op):
                raise TypeError(f"batch takes Op values, not {type(op).__name__}")
        if len({op.key for op in ops}) == len(ops):
            return self._run(ops) if ops else []
        return [self._one(op) for op in ops]

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Closes every channel. The client cannot be used after."""
        self._closed = True
        self._stop_reports.set()
        if self._reporter is not None and self._reporter is not threading.current_thread():
            self._reporter.join(timeout=5)
        with self._lock:
            nodes, self._nodes = list(self._nodes.values()), {}
        _close_channels(nodes)
        for ch in self._routing_channels:
            ch.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _report_loop(ref: "weakref.ref[Client]", stop: threading.Event, every: float) -> None:
    """Sends the latency reports of the client ``ref`` names until it is closed or collected."""
    me = client_id()
    next_ask, ask_gap = 0.0, every
    channel: Optional[grpc.Channel] = None
    stub: Optional[monitor_pb2_grpc.MonitorServiceStub] = None
    current = ""
    try:
        while not stop.wait(every):
            client = ref()
            if client is None or client._recorder is None:
                return
            report = client._recorder.take_report(me)
            if report is not None and not (client.config.monitor or client.monitor) \
                    and time.monotonic() >= next_ask:
                # Connected before the routing nodes knew of the monitor, and a client whose
                # operations all succeed never fetches the map again: ask them, less often
                # while they name none (a cluster without a monitor).
                try:
                    client.refresh_map()
                except (DinomoError, ValueError):
                    pass  # the next operation reports what is wrong; ValueError: closed
                ask_gap = every if client.monitor else min(ask_gap * 2, MAX_MONITOR_ASK_GAP)
                next_ask = time.monotonic() + ask_gap
            addr = client.config.monitor or client.monitor
            identity = client.identity
            del client
            if report is None or not addr:
                continue
            if addr != current:
                if channel is not None:
                    channel.close()
                try:
                    channel = _channel(_core.check_endpoint(addr), identity, "monitor")
                except InvalidArgument:
                    channel, stub, current = None, None, addr
                    continue
                stub, current = monitor_pb2_grpc.MonitorServiceStub(channel), addr
            if stub is not None:
                try:
                    stub.ReportLatency(report, timeout=2.0)
                except grpc.RpcError:
                    pass  # dropped: the monitor sees a quieter interval
    finally:
        if channel is not None:
            channel.close()


def connect(
    routing: Sequence[str] | str,
    *,
    credentials: Optional[PathLike] = None,
    insecure: Optional[bool] = None,
    config: Optional[_core.ClientConfig] = None,
) -> Client:
    """Connects to a Dinomo cluster through its routing node(s) (``"host:port"``; ``dinomo up``
    prints it, 127.0.0.1:7900 by default) and fetches the cluster map.

    TLS: ``insecure=True`` (or ``DINOMO_INSECURE=1``) for a cluster started with
    ``--insecure``; ``credentials=DIR`` for a credentials folder; otherwise
    ``$DINOMO_CREDENTIALS``, then ``.dinomo/credentials``, as the CLI looks
    (:mod:`dinomo.credentials`). Raises :class:`~dinomo.NoClusterMap` if no routing node gives a
    map within the deadline, :class:`~dinomo.PermissionDenied` if the cluster refuses this
    caller.
    """
    routes = [routing] if isinstance(routing, str) else list(routing)
    client = Client(routes, discover(credentials, insecure), config or _core.ClientConfig())
    try:
        client._first_map()
    except BaseException:
        client.close()
        raise
    client._start_reports()
    return client
