"""The asyncio client: :func:`connect` and :class:`Client`, the twin of ``dinomo.client``
with the same methods as coroutines and the same rules (decided in ``_core.py``).

Owns the I/O of the asyncio flavour (``grpc.aio`` channels, one per routing node and per KV
node; each round's Batch RPCs awaited together). Use one client per event loop.

    import dinomo.aio
    async with await dinomo.aio.connect(["127.0.0.1:7900"]) as c:
        await c.put("greeting", "hello")
"""
from __future__ import annotations

import asyncio
import time
from typing import Iterable, Optional, Sequence

import grpc
import grpc.aio

from . import _core
from ._latency import MAX_MONITOR_ASK_GAP, Recorder, client_id
from ._proto import kv_pb2, kv_pb2_grpc, monitor_pb2_grpc, routing_pb2, routing_pb2_grpc
from .credentials import Identity, PathLike, discover
from .errors import DinomoError, InvalidArgument, NoClusterMap, PermissionDenied
from .ops import BytesLike, Op, OpResult
from .routing import ClusterMap, MapError


def _channel(endpoint: str, identity: Optional[Identity], service: str) -> grpc.aio.Channel:
    options = _core.channel_options(identity, service)
    if identity is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, _core.channel_credentials(identity), options=options)


class _KvNode:
    """The channel to one KV node; knows without a round trip whether it is connected."""

    def __init__(self, endpoint: str, identity: Optional[Identity]) -> None:
        self.endpoint = endpoint
        self.channel = _channel(endpoint, identity, "kv")
        self.stub = kv_pb2_grpc.KvServiceStub(self.channel)

    async def connect(self, timeout: float) -> bool:
        """True once the channel is connected; waits up to ``timeout`` if it is not."""
        if self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return True
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Client:
    """A Dinomo client for asyncio. Create with :func:`connect`; close with :meth:`close` or
    ``async with``. Semantics as :class:`dinomo.Client`."""

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
        self._closed = False
        self._recorder: Optional[Recorder] = Recorder() if config.report_latency else None
        self._reporter: Optional["asyncio.Task[None]"] = None

    def _start_reports(self) -> None:
        if self._recorder is not None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        """As ``dinomo.client._report_loop``, until :meth:`close` cancels it."""
        assert self._recorder is not None
        me = client_id()
        next_ask, ask_gap = 0.0, self.config.report_every
        channel: Optional[grpc.aio.Channel] = None
        stub: Optional[monitor_pb2_grpc.MonitorServiceStub] = None
        current = ""
        try:
            while True:
                await asyncio.sleep(self.config.report_every)
                report = self._recorder.take_report(me)
                if report is not None and not (self.config.monitor or self._monitor) \
                        and time.monotonic() >= next_ask:
                    # As in the sync client: ask the routing nodes for a monitor named late,
                    # less often while they name none.
                    try:
                        await self.refresh_map()
                    except DinomoError:
                        pass
                    ask_gap = self.config.report_every if self._monitor \
                        else min(ask_gap * 2, MAX_MONITOR_ASK_GAP)
                    next_ask = time.monotonic() + ask_gap
                addr = self.config.monitor or self._monitor
                if report is None or not addr:
                    continue
                if addr != current:
                    if channel is not None:
                        await channel.close()
                    try:
                        channel = _channel(_core.check_endpoint(addr), self.identity, "monitor")
                    except InvalidArgument:
                        channel, stub, current = None, None, addr
                        continue
                    stub, current = monitor_pb2_grpc.MonitorServiceStub(channel), addr
                if stub is not None:
                    try:
                        await stub.ReportLatency(report, timeout=2.0)
                    except grpc.RpcError:
                        pass  # dropped: the monitor sees a quieter interval
        finally:
            if channel is not None:
                await channel.close()

    @property
    def map(self) -> ClusterMap:
        """The cluster map in use."""
        if self._map is None:
            raise NoClusterMap("no cluster map fetched yet")
        return self._map

    @property
    def monitor(self) -> str:
        """The monitor address the routing nodes named with the map ('' when none)."""
        return self._monitor

    async def refresh_map(self, newer_than: Optional[int] = None, timeout: Optional[float] = None) -> ClusterMap:
        """As :meth:`dinomo.Client.refresh_map`."""
        last = "no routing node tried"
        for _ in range(len(self._routing)):
            name, stub = self._routing[self._next_routing % len(self._routing)]
            req = routing_pb2.GetClusterMapRequest()
            if newer_than is not None:
                req.newer_than = newer_than
            try:
                reply = await stub.GetClusterMap(req, timeout=timeout or self.config.rpc_timeout)
            except grpc.RpcError as e:
                code, details = _core.status_of(e)
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise PermissionDenied(f"{name}: {details}") from None
                last = f"{name}: {code.name}: {details}"
                self._next_routing += 1
                continue
            try:
                m = ClusterMap.decode(reply.map)
            except MapError as e:
                raise NoClusterMap(f"{name}: {e}") from None
            if reply.monitor:
                self._monitor = reply.monitor
            if self._map is None or m.version > self._map.version:
                self._map = m
            return self._map
        hint = "" if self.identity is not None else (
            "; this client uses plain text (no credentials found), which a cluster with TLS refuses")
        raise NoClusterMap(f"no cluster map: {last}{hint}", last=last)

    async def _first_map(self) -> None:
        deadline = time.monotonic() + self.config.deadline
        while True:
            try:
                await self.refresh_map()
                return
            except NoClusterMap:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    def _node(self, endpoint: str) -> _KvNode:
        n = self._nodes.get(endpoint)
        if n is None:
            n = self._nodes[endpoint] = _KvNode(endpoint, self.identity)
        return n

    async def _send(self, call: _core.Call, g: _core.Group, version: int) -> None:
        node = self._node(g.endpoint)
        if not await node.connect(min(self.config.connect_timeout, call.remaining())):
            call.settle_group_unsent(g, "could not connect", version)
            return
        try:
            resp: kv_pb2.BatchResponse = await node.stub.Batch(
                g.request(call.ops), timeout=call.attempt_timeout())
        except grpc.RpcError as e:
            call.settle_group_error(g, e, version)
            return
        call.settle_group(g, resp, version)

    async def _run(self, ops: Sequence[Op]) -> list[OpResult]:
        if self._closed:
            raise InvalidArgument("the client is closed")
        call = _core.Call(ops, self.config)
        while call.pending:
            m = self.map
            groups = call.plan(m)
            await asyncio.gather(*(self._send(call, g, m.version) for g in groups))
            wanted, newer = call.refresh_wanted()
            if wanted:
                try:
                    await self.refresh_map(newer, call.attempt_timeout())
                except DinomoError:
                    pass  # best effort: the next round routes on the map we have
            delay = call.next_delay()
            if delay is None:
                break
            await asyncio.sleep(delay)
        call.record(self._recorder)
        return call.outcome()

    async def _one(self, op: Op) -> OpResult:
        return (await self._run([op]))[0]

    async def get(self, key: BytesLike) -> Optional[bytes]:
        """The value of ``key``, or None if it does not exist."""
        return (await self._one(Op.get(key))).result()  # type: ignore[return-value]

    async def put(self, key: BytesLike, value: BytesLike) -> None:
        """Creates or replaces ``key``."""
        (await self._one(Op.put(key, value))).result()

    async def insert(self, key: BytesLike, value: BytesLike) -> None:
        """Creates ``key``; :class:`~dinomo.AlreadyExists` if it exists."""
        (await self._one(Op.insert(key, value))).result()

    async def update(self, key: BytesLike, value: BytesLike) -> None:
        """Replaces ``key``; :class:`~dinomo.NotFound` if it does not exist."""
        (await self._one(Op.update(key, value))).result()

    async def delete(self, key: BytesLike) -> bool:
        """Deletes ``key``; returns whether it existed."""
        return bool((await self._one(Op.delete(key))).result())

    async def batch(self, ops: Iterable[Op]) -> list[OpResult]:
        """As :meth:`dinomo.Client.batch`."""
        ops = list(ops)
        for op in ops:
            if not isinstance(op, Op):
                raise TypeError(f"batch takes Op values, not {type(op).__name__}")
        if len({op.key for op in ops}) == len(ops):
            return await self._run(ops) if ops else []
        return [await self._one(op) for op in ops]

    async def close(self) -> None:
        """Closes every channel. The client cannot be used after."""
        self._closed = True
        if self._reporter is not None:
            self._reporter.cancel()
            try:
                await self._reporter
            except asyncio.CancelledError:
                pass
            self._reporter = None
        nodes, self._nodes = list(self._nodes.values()), {}
        for n in nodes:
            await n.channel.close()
        for ch in self._routing_channels:
            await ch.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect(
    routing: Sequence[str] | str,
    *,
    credentials: Optional[PathLike] = None,
    insecure: Optional[bool] = None,
    config: Optional[_core.ClientConfig] = None,
) -> Client:
    """As :func:`dinomo.connect`, for asyncio."""
    routes = [routing] if isinstance(routing, str) else list(routing)
    client = Client(routes, discover(credentials, insecure), config or _core.ClientConfig())
    try:
        await client._first_map()
    except BaseException:
        await client.close()
        raise
    client._start_reports()
    return client
