"""Fake routing and KV nodes (in-process gRPC servers on loopback) whose answers a test
scripts, and which count what they receive: how the retry rules are checked without a
cluster, including the faults a real one cannot produce on demand (UNKNOWN, a hung write)."""
from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from concurrent import futures
from typing import Any, Callable, Optional

import grpc

import dinomo
import dinomo.aio
from dinomo._proto import kv_pb2, kv_pb2_grpc, monitor_pb2, monitor_pb2_grpc, routing_pb2, routing_pb2_grpc

# An answer to one operation: (code, message) or a callable returning a KvResponse.
Script = Callable[[kv_pb2.KvRequest, int], kv_pb2.KvResponse]


def encode_map(version: int, kns: dict[int, str]) -> bytes:
    return json.dumps({
        "format_version": 1, "version": version, "vnodes": 16, "shards_per_kn": 1,
        "kns": [{"id": i, "endpoint": e} for i, e in sorted(kns.items())], "replicated": [],
    }).encode()


class FakeKn(kv_pb2_grpc.KvServiceServicer):
    """A KV node whose Batch answers come from ``script(request, n)`` (n counts requests from
    1), or whose whole call is handled by ``call_script(batch, context)`` when set."""

    def __init__(self, script: Optional[Script] = None) -> None:
        self.script: Script = script or (lambda r, n: kv_pb2.KvResponse(id=r.id, code=0))
        self.call_script: Optional[Callable[[kv_pb2.BatchRequest, Any], Optional[kv_pb2.BatchResponse]]] = None
        self.requests: list[kv_pb2.KvRequest] = []
        self.calls = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        kv_pb2_grpc.add_KvServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self.server.start()

    def Batch(self, request: kv_pb2.BatchRequest, context: Any) -> kv_pb2.BatchResponse:
        with self._lock:
            self.calls += 1
            self.requests.extend(request.requests)
            first = len(self.requests) - len(request.requests)
        if self.call_script is not None:
            r = self.call_script(request, context)
            if r is not None:
                return r
        return kv_pb2.BatchResponse(responses=[
            self.script(req, first + n + 1) for n, req in enumerate(request.requests)])

    def stop(self) -> None:
        self.server.stop(0)


class FakeRouting(routing_pb2_grpc.RoutingServiceServicer):
    """A routing node serving ``maps[min(calls, len - 1)]``: the first call gets the first map,
    later calls the next ones, the last one forever after (or ``advance()`` by hand)."""

    def __init__(self, *maps: bytes) -> None:
        self.maps = list(maps)
        self.calls = 0
        self.monitor = ""
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        routing_pb2_grpc.add_RoutingServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self.server.start()

    def GetClusterMap(self, request: routing_pb2.GetClusterMapRequest, context: Any) -> routing_pb2.ClusterMapReply:
        m = self.maps[min(self.calls, len(self.maps) - 1)]
        self.calls += 1
        return routing_pb2.ClusterMapReply(version=json.loads(m)["version"], map=m, monitor=self.monitor)

    def stop(self) -> None:
        self.server.stop(0)


class FakeMonitor(monitor_pb2_grpc.MonitorServiceServicer):
    """A monitor that keeps the latency reports it receives."""

    def __init__(self) -> None:
        self.reports: list[monitor_pb2.LatencyReport] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        monitor_pb2_grpc.add_MonitorServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"
        self.server.start()

    def ReportLatency(self, request: monitor_pb2.LatencyReport, context: Any) -> monitor_pb2.LatencyReply:
        self.reports.append(request)
        return monitor_pb2.LatencyReply(report_every_ms=1000)

    def stop(self) -> None:
        self.server.stop(0)


def kn_error(context: Any, code: grpc.StatusCode, message: str) -> None:
    """Aborts a call as a KN does: with its trailer."""
    context.set_trailing_metadata((("dinomo-kn", "1"),))
    context.abort(code, message)


class Flavour:
    """The sync client, or the asyncio one driven from a private event loop, behind one
    blocking interface, so each rule is tested on both."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: Optional[asyncio.AbstractEventLoop] = asyncio.new_event_loop() if name == "async" else None
        self.clients: list[Any] = []

    def connect(self, routing: str, config: dinomo.ClientConfig) -> "Flavour.Handle":
        if self.loop is None:
            c: Any = dinomo.connect([routing], insecure=True, config=config)
        else:
            c = self.loop.run_until_complete(dinomo.aio.connect([routing], insecure=True, config=config))
        self.clients.append(c)
        return Flavour.Handle(c, self.loop)

    class Handle:
        def __init__(self, client: Any, loop: Optional[asyncio.AbstractEventLoop]) -> None:
            self.client = client
            self.loop = loop

        def __getattr__(self, name: str) -> Any:
            f = getattr(self.client, name)
            if self.loop is None or not inspect.iscoroutinefunction(f):
                return f
            loop = self.loop
            return lambda *a, **kw: loop.run_until_complete(f(*a, **kw))

    def sleep(self, seconds: float) -> None:
        """Waits, letting the asyncio client's background task run."""
        if self.loop is None:
            time.sleep(seconds)
        else:
            self.loop.run_until_complete(asyncio.sleep(seconds))

    def close(self) -> None:
        for c in self.clients:
            if self.loop is None:
                c.close()
            else:
                self.loop.run_until_complete(c.close())
        if self.loop is not None:
            self.loop.close()
