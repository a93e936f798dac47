"""Real clusters for the tests and the benchmark: ``dinomo up`` from the binaries in
``$DINOMO_BIN_DIR`` (default: <repo>/target/debug), each in its own temporary directory and on
loopback ports of its own, stopped (and their process group killed) whatever the outcome.

When the ``dinomo`` binary is missing, :func:`start_cluster` fails rather than skips: CI must
run the cluster tests (DINOMO_SKIP_CLUSTER=1 skips them on purpose, e.g. on a laptop without
a build). Each `up` leads a new process group; with $DINOMO_TEST_PIDFILE set, its id is appended there.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[3]
BIN_DIR = Path(os.environ.get("DINOMO_BIN_DIR", REPO / "target" / "debug"))
DINOMO = BIN_DIR / "dinomo"
START_TIMEOUT = 120.0


def port_offsets(kns: int) -> list[int]:
    """Every port `dinomo up --port-base B` uses, as offsets from B (cli/src/up.rs), with room
    for two KNs added later."""
    offs = [-100, 0, 1, 2, 200, 1900, 2000, 2200]
    for i in range(1, kns + 3):
        offs += [100 + i, 2100 + i]
    return offs


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pick_port_base(kns: int) -> int:
    for _ in range(200):
        base = random.randrange(12000, 60000 - 2300, 10)
        if all(free(base + o) for o in port_offsets(kns)):
            return base
    raise RuntimeError("no free port range for a cluster on 127.0.0.1")


@dataclass
class Cluster:
    """A running `dinomo up`: where it lives and how to reach it."""

    dir: Path
    port_base: int
    insecure: bool
    proc: subprocess.Popen
    log: Path
    env: dict = field(default_factory=dict)

    @property
    def routing(self) -> str:
        return f"127.0.0.1:{self.port_base + 200}"

    @property
    def monitor(self) -> str:
        return f"127.0.0.1:{self.port_base - 100}"

    @property
    def credentials(self) -> Optional[Path]:
        return None if self.insecure else self.dir / ".dinomo" / "credentials"

    def security_args(self) -> list[str]:
        return ["--insecure"] if self.insecure else ["--credentials", str(self.credentials)]

    def admin(self, *action: str, timeout: float = 60.0) -> str:
        """Runs `dinomo admin ACTION...` against this cluster's monitor; returns its output."""
        cmd = [str(DINOMO), "admin", "--monitor", self.monitor, *self.security_args(), *action]
        r = subprocess.run(cmd, cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stdout}{r.stderr}")
        return r.stdout

    def stop(self) -> None:
        """SIGTERM to `up` (it stops its nodes in order), then SIGKILL to whatever is left of
        its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DINOMO_")}
    env.setdefault("RUST_LOG", "warn")
    return env


def start_cluster(dir: Path, *, insecure: bool = False, kns: int = 2) -> Cluster:
    """Starts `dinomo up` in ``dir`` and waits until it prints that it is up."""
    if os.environ.get("DINOMO_SKIP_CLUSTER") == "1":
        import pytest

        pytest.skip("DINOMO_SKIP_CLUSTER=1")
    if not DINOMO.exists():
        raise AssertionError(f"{DINOMO} is missing: build it or set DINOMO_BIN_DIR")
    dir.mkdir(parents=True, exist_ok=True)
    base = pick_port_base(kns)
    cmd = [str(DINOMO), "up", "--port-base", str(base), "--kns", str(kns), "--pool-size", "256MiB",
           "--cache-size", "32MiB", "--kn-threads", "1"]
    if insecure:
        cmd.append("--insecure")
    log = dir / "up.log"
    env = clean_env()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pidfile = os.environ.get("DINOMO_TEST_PIDFILE")
    if pidfile:
        # ci.sh kills these process groups by id if this session dies before its finalizers.
        with open(pidfile, "a") as f:
            f.write(f"{proc.pid}\n")
    c = Cluster(dir, base, insecure, proc, log, env)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        text = log.read_text(errors="replace")
        if "Press Ctrl-C to stop." in text:
            return c
        if proc.poll() is not None or time.monotonic() > deadline:
            c.stop()
            raise AssertionError(f"`{' '.join(cmd)}` did not come up:\n{text[-4000:]}")
        time.sleep(0.2)


