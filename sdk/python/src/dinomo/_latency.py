"""Latency reports to the cluster's monitor (the SLO policy's input), as the Rust SDK sends
them (client/src/latency.rs): every finished operation (a value, a definite error, or a
deadline; not a refused argument) is recorded with the KN that answered its last attempt; every
``report_every`` seconds the interval's count, latency sum, p99 and per-KN counts go to the
monitor (``ClientConfig.monitor``, else the one the routing nodes name) as
``MonitorService.ReportLatency``, and a new interval starts. An interval with no monitor to send
to, or whose report is not delivered, is dropped: latencies are a signal, not a record.

This module owns the recorder (thread-safe, I/O-free) and the report message; the clients own
the loop that sends it (a daemon thread, or an asyncio task).
"""
from __future__ import annotations

import math
import os
import random
import threading
from typing import Optional

from ._proto import monitor_pb2

#: Latencies kept per interval for the p99; past this, a uniform sample of them (reservoir).
MAX_SAMPLES = 1 << 16

#: The longest a client with latencies to report waits between asking the routing nodes for a
#: monitor while they name none (seconds; the Rust client's MAX_MONITOR_ASK_GAP).
MAX_MONITOR_ASK_GAP = 15.0


def client_id() -> str:
    """An id unique to this client: the process id and a random suffix."""
    return f"py-{os.getpid()}-{random.getrandbits(32):08x}"


class Recorder:
    """What was recorded since the last report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._count = 0
        self._sum_us = 0
        self._samples: list[int] = []
        self._per_kn: dict[int, list[int]] = {}

    def record(self, kn: Optional[int], seconds: float) -> None:
        us = max(1, int(seconds * 1e6))
        with self._lock:
            self._count += 1
            self._sum_us += us
            if len(self._samples) < MAX_SAMPLES:
                self._samples.append(us)
            else:
                j = random.randrange(self._count)
                if j < MAX_SAMPLES:
                    self._samples[j] = us
            if kn is not None:
                e = self._per_kn.setdefault(kn, [0, 0])
                e[0] += 1
                e[1] += us

    def take_report(self, client: str) -> Optional[monitor_pb2.LatencyReport]:
        """The interval's report (None if nothing was recorded), and a new interval."""
        with self._lock:
            if self._count == 0:
                return None
            samples = sorted(self._samples)
            p99 = samples[max(0, math.ceil(0.99 * len(samples)) - 1)]
            report = monitor_pb2.LatencyReport(
                client_id=client, count=self._count, sum_us=self._sum_us, p99_us=p99,
                per_kn=[monitor_pb2.KnLatency(kn_id=k, count=c, sum_us=s)
                        for k, (c, s) in sorted(self._per_kn.items())])
            self._reset()
            return report
