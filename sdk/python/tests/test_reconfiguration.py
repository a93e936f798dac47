"""A KV node added and one failed while clients run (the issue's test): a blocking and an
asyncio client each keep writing and reading their own keys through `dinomo admin add-kn` and
`dinomo admin fail-kn`; no error may reach them except OutcomeUnknown on a write, and every
read returns the last acknowledged write of its key (or the value of a write whose outcome was
unknown). Bounded: the workloads stop on an event, admin commands have timeouts."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pytest

import dinomo
import dinomo.aio
from dinomo._proto import kv_pb2
from dinomo.client import _KvNode

from cluster import Cluster, start_cluster

KEYS = 200
CFG = dinomo.ClientConfig(deadline=30.0)


@dataclass
class History:
    """What one sequential client saw, per key: the acknowledged value and the values of
    writes whose outcome is unknown since then; and every violation."""

    acked: dict[str, Optional[bytes]] = field(default_factory=dict)
    maybe: dict[str, set] = field(default_factory=dict)
    ops: int = 0
    unknown: int = 0
    errors: list[str] = field(default_factory=list)

    def wrote(self, key: str, value: bytes) -> None:
        self.acked[key] = value
        self.maybe[key] = set()

    def write_unknown(self, key: str, value: bytes) -> None:
        self.unknown += 1
        self.maybe.setdefault(key, set()).add(value)

    def read(self, key: str, got: Optional[bytes]) -> None:
        allowed = {self.acked.get(key)} | self.maybe.get(key, set())
        if got not in allowed:
            self.errors.append(f"get {key} = {got!r}, expected one of {allowed!r}")
        elif got != self.acked.get(key):
            # The unknown write turned out applied: it is now the acknowledged state.
            self.wrote(key, got)  # type: ignore[arg-type]


def sync_workload(c: dinomo.Client, h: History, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        key = f"sync:{i % KEYS}"
        value = f"{i}".encode()
        try:
            c.put(key, value)
            h.wrote(key, value)
        except dinomo.OutcomeUnknown:
            h.write_unknown(key, value)
        except Exception as e:  # noqa: BLE001 - any other error is the failure we look for
            h.errors.append(f"put {key}: {type(e).__name__}: {e}")
        try:
            h.read(key, c.get(key))
        except Exception as e:  # noqa: BLE001
            h.errors.append(f"get {key}: {type(e).__name__}: {e}")
        h.ops += 2
        i += 1


async def async_workload(c: dinomo.aio.Client, h: History, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        key = f"aio:{i % KEYS}"
        value = f"{i}".encode()
        try:
            await c.put(key, value)
            h.wrote(key, value)
        except dinomo.OutcomeUnknown:
            h.write_unknown(key, value)
        except Exception as e:  # noqa: BLE001
            h.errors.append(f"put {key}: {type(e).__name__}: {e}")
        try:
            h.read(key, await c.get(key))
        except Exception as e:  # noqa: BLE001
            h.errors.append(f"get {key}: {type(e).__name__}: {e}")
        h.ops += 2
        i += 1


def run_async(routing: str, credentials: Optional[Path], h: History, stop: threading.Event) -> None:
    async def main() -> None:
        async with await dinomo.aio.connect([routing], credentials=credentials, config=CFG) as c:
            await async_workload(c, h, stop)

    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001
        h.errors.append(f"asyncio client: {type(e).__name__}: {e}")


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def kn_ops(client: dinomo.Client, endpoint: str) -> int:
    """Gets, puts and deletes a KN has served (its Stats)."""
    node = _KvNode(endpoint, client.identity)
    try:
        s = node.stub.Stats(kv_pb2.KnStatsRequest(), timeout=5)
    finally:
        node.close()
    return s.gets + s.puts + s.deletes


@pytest.fixture(scope="module")
def moving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("reconfig"))
    try:
        yield c
    finally:
        c.stop()


def test_a_kn_added_and_one_failed_reach_no_caller(moving: Cluster) -> None:
    observer = dinomo.connect([moving.routing], credentials=moving.credentials)
    worker = dinomo.connect([moving.routing], credentials=moving.credentials, config=CFG)
    hs, ha = History(), History()
    stop = threading.Event()
    threads = [
        threading.Thread(target=sync_workload, args=(worker, hs, stop), daemon=True),
        threading.Thread(target=run_async, args=(moving.routing, moving.credentials, ha, stop), daemon=True),
    ]
    try:
        first = observer.map
        assert [k.id for k in first.kns] == [1, 2]
        for t in threads:
            t.start()
        wait_for(lambda: hs.ops > 50 and ha.ops > 50, 30, "both workloads to run")

        print(moving.admin("add-kn", timeout=90).strip())
        wait_for(lambda: len(observer.refresh_map().kns) == 3, 60, "a map with 3 KNs")
        added = observer.map
        ops = hs.ops + ha.ops
        wait_for(lambda: hs.ops + ha.ops > ops + 300, 30, "operations on the 3-KN map")
        new_kn = max(k.id for k in added.kns)
        served = kn_ops(observer, added.endpoint(new_kn) or "")
        assert served > 0, f"the added KN {new_kn} served no operation"

        print(moving.admin("fail-kn", "1", timeout=120).strip())
        wait_for(lambda: 1 not in [k.id for k in observer.refresh_map().kns], 90, "a map without KN 1")
        ops = hs.ops + ha.ops
        wait_for(lambda: hs.ops + ha.ops > ops + 300, 30, "operations after the failure")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=40)
    try:
        assert not any(t.is_alive() for t in threads), "a workload did not stop"
        print(f"maps: {first.version} -> {added.version} (KN {new_kn} added, served {served} ops) -> "
              f"{observer.map.version} (KN 1 failed); "
              f"ops sync {hs.ops} asyncio {ha.ops}; outcome-unknown writes {hs.unknown + ha.unknown}")
        assert hs.errors == [] and ha.errors == []
        assert worker.map.version >= observer.map.version
        assert 1 not in [k.id for k in worker.map.kns]
        # Every key reads back as its history allows, on the final map.
        for h, prefix in ((hs, "sync"), (ha, "aio")):
            for i in range(KEYS):
                key = f"{prefix}:{i}"
                if key in h.acked or key in h.maybe:
                    h.read(key, worker.get(key))
            assert h.errors == []
    finally:
        observer.close()
        worker.close()
