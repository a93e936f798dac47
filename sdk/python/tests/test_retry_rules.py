"""The retry rules (routing contract section 6; the Rust SDK's execute_at_owner) against fake
nodes that count what reaches them, for the blocking and the asyncio client alike."""
from __future__ import annotations

import socket
import time
from typing import Iterator

import grpc
import pytest

import dinomo
from dinomo import Op
from dinomo._proto import kv_pb2

from fakes import FakeKn, FakeMonitor, FakeRouting, Flavour, encode_map, kn_error

FAST = dinomo.ClientConfig(deadline=2.0, rpc_timeout=0.5, connect_timeout=0.3, report_latency=False)


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> Iterator[Flavour]:
    f = Flavour(request.param)
    yield f
    f.close()


@pytest.fixture
def cleanup() -> Iterator[list]:
    servers: list = []
    yield servers
    for s in servers:
        s.stop()


def answer(code: int, message: str = "", value: bytes = b"", map_version: int = 0):
    return lambda r, n: kv_pb2.KvResponse(id=r.id, code=code, message=message, value=value, map_version=map_version)


def one_kn(cleanup: list, script=None) -> tuple[FakeKn, FakeRouting]:
    kn = FakeKn(script)
    routing = FakeRouting(encode_map(1, {1: kn.endpoint}))
    cleanup += [kn, routing]
    return kn, routing


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_values_and_final_answers(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup)
    c = flavour.connect(routing.endpoint, FAST)
    kn.script = answer(0, value=b"v")
    assert c.get("k") == b"v"
    kn.script = answer(5, "missing")
    assert c.get("k") is None
    assert c.delete("k") is False
    with pytest.raises(dinomo.NotFound):
        c.update("k", "v")
    kn.script = answer(6, "exists")
    with pytest.raises(dinomo.AlreadyExists):
        c.insert("k", "v")
    kn.script = answer(3, "key too long")
    with pytest.raises(dinomo.InvalidArgument, match="key too long"):
        c.put("k", "v")
    kn.script = answer(8, "the pool is full")
    with pytest.raises(dinomo.ResourceExhausted):
        c.put("k", "v")
    # Each final answer came from exactly one request: none was retried.
    assert len(kn.requests) == 7


def test_the_requests_carry_the_operation(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup)
    c = flavour.connect(routing.endpoint, FAST)
    c.put("a", "1")
    c.insert(b"b", b"2")
    c.update(bytearray(b"c"), "3")
    c.delete("d")
    c.get("e")
    r = kn.requests
    assert [x.WhichOneof("op") for x in r] == ["put", "put", "put", "delete", "get"]
    assert [x.put.mode for x in r[:3]] == [kv_pb2.UPSERT, kv_pb2.INSERT, kv_pb2.UPDATE]
    assert (r[0].put.key, r[0].put.value, r[1].put.key, r[2].put.key, r[3].delete.key, r[4].get.key) == (
        b"a", b"1", b"b", b"c", b"d", b"e")


def test_wrong_owner_refreshes_the_map_and_goes_to_the_new_owner(flavour: Flavour, cleanup: list) -> None:
    old = FakeKn(answer(9, "wrong owner", map_version=2))
    new = FakeKn(answer(0))
    routing = FakeRouting(encode_map(1, {1: old.endpoint}), encode_map(2, {2: new.endpoint}))
    cleanup += [old, new, routing]
    c = flavour.connect(routing.endpoint, FAST)
    c.put("k", "v")
    assert (len(old.requests), len(new.requests)) == (1, 1)
    assert c.map.version == 2


def test_unavailable_backs_off_and_retries_the_same_write(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup, lambda r, n: kv_pb2.KvResponse(id=r.id, code=14 if n < 3 else 0, message="moving"))
    c = flavour.connect(routing.endpoint, FAST)
    c.put("k", "v")
    assert len(kn.requests) == 3


def test_unknown_write_is_never_retried(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup, answer(2, "log write failed"))
    c = flavour.connect(routing.endpoint, FAST)
    for op in (lambda: c.put("k", "v"), lambda: c.insert("k", "v"), lambda: c.update("k", "v"), lambda: c.delete("k")):
        with pytest.raises(dinomo.OutcomeUnknown):
            op()
    assert len(kn.requests) == 4


def test_unknown_read_is_retried(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup, lambda r, n: kv_pb2.KvResponse(id=r.id, code=2 if n == 1 else 0, value=b"x"))
    c = flavour.connect(routing.endpoint, FAST)
    assert c.get("k") == b"x"
    assert len(kn.requests) == 2


def test_a_write_that_times_out_is_outcome_unknown_a_read_is_retried(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup)

    def hang_first(batch, context):
        if kn.calls == 1:
            time.sleep(0.8)  # past rpc_timeout: the client gives up with the request delivered
        return None

    kn.call_script = hang_first
    c = flavour.connect(routing.endpoint, FAST)
    with pytest.raises(dinomo.OutcomeUnknown, match="DEADLINE_EXCEEDED"):
        c.put("k", "v")
    assert len(kn.requests) == 1
    kn.calls = 0
    kn.script = answer(0, value=b"v")
    assert c.get("k") == b"v"
    assert kn.calls == 2


def test_a_write_that_never_left_is_retried_at_the_next_owner(flavour: Flavour, cleanup: list) -> None:
    live = FakeKn(answer(0))
    dead = f"127.0.0.1:{closed_port()}"
    routing = FakeRouting(encode_map(1, {1: dead}), encode_map(2, {2: live.endpoint}))
    cleanup += [live, routing]
    c = flavour.connect(routing.endpoint, FAST)
    c.put("k", "v")  # the connection to `dead` is refused: nothing was sent, so retried
    assert len(live.requests) == 1
    assert c.map.version == 2


def test_the_deadline_ends_the_retries(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup, answer(14, "stopping"))
    cfg = dinomo.ClientConfig(deadline=0.4, rpc_timeout=0.2, connect_timeout=0.2, report_latency=False)
    c = flavour.connect(routing.endpoint, cfg)
    t = time.monotonic()
    with pytest.raises(dinomo.Unavailable) as e:
        c.put("k", "v")
    assert 0.35 < time.monotonic() - t < 2.0
    assert e.value.attempts > 1 and "stopping" in e.value.last
    assert len(kn.requests) == e.value.attempts


def test_a_refusal_of_the_access_layer_is_permission_denied(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup)
    kn.call_script = lambda batch, context: context.abort(grpc.StatusCode.UNAUTHENTICATED, "needs a client certificate")
    c = flavour.connect(routing.endpoint, FAST)
    with pytest.raises(dinomo.PermissionDenied):
        c.put("k", "v")
    assert kn.calls == 1


def test_a_kn_status_on_the_whole_call_is_judged_like_an_answer(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup)
    kn.call_script = lambda batch, context: kn_error(context, grpc.StatusCode.INVALID_ARGUMENT, "an empty batch")
    c = flavour.connect(routing.endpoint, FAST)
    with pytest.raises(dinomo.InvalidArgument, match="empty batch"):
        c.put("k", "v")
    # Without the KN's trailer, an UNKNOWN status after sending is a transport failure.
    kn.call_script = lambda batch, context: context.abort(grpc.StatusCode.UNKNOWN, "proxy error")
    with pytest.raises(dinomo.OutcomeUnknown):
        c.put("k", "v")


def test_batch_one_rpc_per_kn_results_in_order(flavour: Flavour, cleanup: list) -> None:
    a = FakeKn(lambda r, n: kv_pb2.KvResponse(id=r.id, code=0, value=b"A:" + r.get.key))
    b = FakeKn(lambda r, n: kv_pb2.KvResponse(id=r.id, code=0, value=b"B:" + r.get.key))
    routing = FakeRouting(encode_map(1, {1: a.endpoint, 2: b.endpoint}))
    cleanup += [a, b, routing]
    c = flavour.connect(routing.endpoint, FAST)
    keys = [f"key{i}".encode() for i in range(40)]
    out = c.batch([Op.get(k) for k in keys])
    assert (a.calls, b.calls) == (1, 1)
    owner = {1: b"A:", 2: b"B:"}
    assert [r.value for r in out] == [owner[c.map.ring_owner(k)] + k for k in keys]
    # A key twice: one at a time, in order.
    out = c.batch([Op.put("x", "1"), Op.get("x"), Op.delete("x")])
    assert [r.ok for r in out] == [True, True, True] and a.calls + b.calls == 5


def test_batch_reports_each_operations_own_outcome(flavour: Flavour, cleanup: list) -> None:
    codes = {b"ok": 0, b"missing": 5, b"exists": 6, b"unknown": 2}
    kn, routing = one_kn(cleanup, lambda r, n: kv_pb2.KvResponse(id=r.id, code=codes[r.put.key or r.get.key]))
    c = flavour.connect(routing.endpoint, FAST)
    out = c.batch([Op.put("ok", "v"), Op.update("missing", "v"), Op.insert("exists", "v"), Op.put("unknown", "v"),
                   Op.get("missing")])
    assert [type(r.error).__name__ if r.error else r.value for r in out] == [
        None, "NotFound", "AlreadyExists", "OutcomeUnknown", None]
    with pytest.raises(dinomo.AlreadyExists):
        out[2].result()


def test_an_oversized_operation_is_refused_before_sending(flavour: Flavour, cleanup: list) -> None:
    kn, routing = one_kn(cleanup)
    c = flavour.connect(routing.endpoint, FAST)
    with pytest.raises(dinomo.InvalidArgument, match="at most"):
        c.put("k", b"x" * (64 << 20))
    assert kn.calls == 0


def test_no_routing_node_is_no_cluster_map(flavour: Flavour) -> None:
    cfg = dinomo.ClientConfig(deadline=0.3, rpc_timeout=0.2)
    t = time.monotonic()
    with pytest.raises(dinomo.NoClusterMap):
        flavour.connect(f"127.0.0.1:{closed_port()}", cfg)
    assert time.monotonic() - t < 3
    assert issubclass(dinomo.NoClusterMap, dinomo.Unavailable)


def test_bad_arguments() -> None:
    with pytest.raises(dinomo.InvalidArgument):
        dinomo.connect(["no-port"], insecure=True)
    with pytest.raises(dinomo.InvalidArgument):
        dinomo.ClientConfig(deadline=0)
    with pytest.raises(TypeError):
        Op.put(1, "v")  # type: ignore[arg-type]


def test_latencies_are_reported_to_the_monitor_the_routing_node_names(flavour: Flavour, cleanup: list) -> None:
    a, b = FakeKn(answer(0)), FakeKn(answer(0))
    routing = FakeRouting(encode_map(1, {1: a.endpoint, 2: b.endpoint}))
    monitor = FakeMonitor()
    routing.monitor = monitor.endpoint
    cleanup += [a, b, routing, monitor]
    c = flavour.connect(routing.endpoint, dinomo.ClientConfig(report_every=0.1))
    for i in range(30):
        c.put(f"k{i}", "v")
    with pytest.raises(dinomo.InvalidArgument):
        c.put("k", b"x" * (64 << 20))  # refused before sending: not a latency
    deadline = time.monotonic() + 5
    while sum(r.count for r in monitor.reports) < 30 and time.monotonic() < deadline:
        flavour.sleep(0.05)
    reports = list(monitor.reports)
    assert sum(r.count for r in reports) >= 30
    assert len({r.client_id for r in reports}) == 1
    per_kn = {k.kn_id for r in reports for k in r.per_kn}
    assert per_kn == {1, 2}
    assert all(r.p99_us > 0 and r.sum_us >= r.p99_us for r in reports)


def test_a_monitor_the_routing_node_names_after_connect_is_found(flavour: Flavour, cleanup: list) -> None:
    """A client connected before its routing node knew of the monitor (a cluster starting, its
    clients with it), whose operations all succeed and so never fetch the map again, asks the
    routing nodes again while it has latencies and nowhere to send them."""
    a = FakeKn(answer(0))
    routing = FakeRouting(encode_map(1, {1: a.endpoint}))
    monitor = FakeMonitor()
    cleanup += [a, routing, monitor]
    c = flavour.connect(routing.endpoint, dinomo.ClientConfig(report_every=0.1))
    assert c.monitor == ""
    routing.monitor = monitor.endpoint
    deadline = time.monotonic() + 5
    while not monitor.reports and time.monotonic() < deadline:
        c.put("k", "v")
        flavour.sleep(0.05)
    assert monitor.reports, "no latency reached the monitor"
    assert c.monitor == monitor.endpoint
