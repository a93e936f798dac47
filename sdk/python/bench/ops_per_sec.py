#!/usr/bin/env python3
"""Ops/s of a simple Python loop (the blocking and the asyncio client, one operation at a time)
against the Rust SDK (`dinomo bench`, 1 client x 1 outstanding, over its default KV wire and
over gRPC as this SDK uses) on the same cluster in the same run. Prints a table; a benchmark,
not a test.

    python bench/ops_per_sec.py                   # starts its own `dinomo up` ($DINOMO_BIN_DIR)
    python bench/ops_per_sec.py --routing 127.0.0.1:7900 [--credentials DIR | --insecure]

Workload: YCSB A-like, 50% get / 50% put, uniform over --records loaded keys of --key-size
bytes ("user" + digits; `dinomo bench` loads its own, --load, unmeasured), --value-size byte
values.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dinomo  # noqa: E402
import dinomo.aio  # noqa: E402
from dinomo import Op  # noqa: E402


def key(i: int, size: int) -> bytes:
    return b"user" + str(i).zfill(size - 4).encode()


def sync_loop(c: dinomo.Client, a: argparse.Namespace, value: bytes) -> float:
    rng = random.Random(1)
    n = 0
    end = time.monotonic() + a.seconds
    start = time.monotonic()
    while time.monotonic() < end:
        k = key(rng.randrange(a.records), a.key_size)
        if rng.random() < 0.5:
            c.get(k)
        else:
            c.put(k, value)
        n += 1
    return n / (time.monotonic() - start)


async def async_loop(routing: str, credentials: Optional[str], insecure: Optional[bool],
                     a: argparse.Namespace, value: bytes) -> float:
    async with await dinomo.aio.connect([routing], credentials=credentials, insecure=insecure) as c:
        rng = random.Random(2)
        n = 0
        end = time.monotonic() + a.seconds
        start = time.monotonic()
        while time.monotonic() < end:
            k = key(rng.randrange(a.records), a.key_size)
            if rng.random() < 0.5:
                await c.get(k)
            else:
                await c.put(k, value)
            n += 1
        return n / (time.monotonic() - start)


def rust_bench(dinomo_bin: Path, routing: str, credentials: Optional[str], insecure: Optional[bool],
               a: argparse.Namespace, transport: str, cwd: Path) -> float:
    out = cwd / f"bench-{transport}.json"
    cmd = [str(dinomo_bin), "bench", "--target", f"dinomo://{routing}", "--workload", "a",
           "--distribution", "uniform", "--records", str(a.records), "--key-size", str(a.key_size),
           "--value-size", str(a.value_size), "--clients", "1", "--outstanding", "1", "--threads", "1",
           "--duration", f"{a.seconds}s", "--kv-transport", transport, "--no-latency-reports",
           "--load", "--json", str(out)]
    cmd += ["--insecure"] if insecure else (["--credentials", credentials] if credentials else [])
    env = {k: v for k, v in os.environ.items() if k not in ("DINOMO_CREDENTIALS", "DINOMO_INSECURE")}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=a.seconds + 120)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    summary = json.loads(out.read_text())
    run = summary["run"]
    load = summary.get("load") or {}
    if load.get("errors"):
        print(f"  (dinomo bench {transport}, unmeasured load: {load['errors']} errors: {load['errors_by_kind']})")
    if run["errors"]:
        print(f"  (dinomo bench {transport}: {run['errors']} errors: {run['errors_by_kind']})")
    return float(run["throughput_ops_per_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routing", help="a running cluster's routing node (default: start one)")
    p.add_argument("--credentials")
    p.add_argument("--insecure", action="store_true", default=None)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--records", type=int, default=1000)
    p.add_argument("--key-size", type=int, default=24)
    p.add_argument("--value-size", type=int, default=100)
    a = p.parse_args()

    from cluster import DINOMO, start_cluster  # the tests' launcher: `dinomo up` on free ports

    work = Path(tempfile.mkdtemp(prefix="dinomo-bench-"))
    cluster = None
    routing, credentials = a.routing, a.credentials
    if routing is None:
        cluster = start_cluster(work / "cluster", insecure=bool(a.insecure))
        routing = cluster.routing
        credentials = None if cluster.credentials is None else str(cluster.credentials)
    try:
        value = os.urandom(a.value_size)
        with dinomo.connect([routing], credentials=credentials, insecure=a.insecure) as c:
            for i in range(0, a.records, 500):
                out = c.batch(Op.put(key(j, a.key_size), value) for j in range(i, min(i + 500, a.records)))
                for r in out:
                    r.result()
            kns = len(c.map.kns)
            py_sync = sync_loop(c, a, value)
        py_async = asyncio.run(async_loop(routing, credentials, a.insecure, a, value))
        rust_wire = rust_bench(DINOMO, routing, credentials, a.insecure, a, "wire", work)
        rust_grpc = rust_bench(DINOMO, routing, credentials, a.insecure, a, "grpc", work)
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"\nops/s, 1 client x 1 outstanding, 50% get / 50% put, uniform over {a.records} keys, "
          f"{a.key_size} B keys, {a.value_size} B values, {a.seconds:g} s each, {kns} KNs, "
          f"{'plain text' if a.insecure else 'TLS'}, same cluster, same run")
    print(f"  binaries: {DINOMO}")
    rows = [("Python, blocking client (gRPC Batch)", py_sync),
            ("Python, asyncio client (gRPC Batch)", py_async),
            ("Rust SDK, KV wire (dinomo bench)", rust_wire),
            ("Rust SDK, gRPC Pipeline (dinomo bench)", rust_grpc)]
    for name, v in rows:
        print(f"  {name:<42} {v:>9.0f}   ({v / rust_wire:.2f}x the Rust SDK on the wire)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
