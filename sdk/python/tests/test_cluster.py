"""The blocking and asyncio clients against a real TLS cluster (`dinomo up`): CRUD, batches,
the KV nodes' own errors, routing that agrees with the KNs' (no WRONG_OWNER), and credentials
found as the CLI finds them."""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path
from typing import Iterator

import pytest

import dinomo
import dinomo.aio
from dinomo import Op
from dinomo._proto import kv_pb2
from dinomo.client import _KvNode

from cluster import Cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[dinomo.Client]:
    with dinomo.connect([cluster.routing], credentials=cluster.credentials) as c:
        yield c


def test_crud(client: dinomo.Client) -> None:
    assert client.get("crud:missing") is None
    client.put("crud:greeting", "hello")
    assert client.get("crud:greeting") == b"hello"
    client.put("crud:greeting", b"again")
    assert client.get(b"crud:greeting") == b"again"
    with pytest.raises(dinomo.AlreadyExists):
        client.insert("crud:greeting", "no")
    assert client.get("crud:greeting") == b"again"
    client.insert("crud:counter", "0")
    client.update("crud:counter", "1")
    assert client.get("crud:counter") == b"1"
    with pytest.raises(dinomo.NotFound):
        client.update("crud:nobody", "1")
    assert client.get("crud:nobody") is None
    assert client.delete("crud:counter") is True
    assert client.delete("crud:counter") is False
    assert client.get("crud:counter") is None
    client.insert("crud:counter", "again")  # a deleted key can be inserted again
    assert client.get("crud:counter") == b"again"


def test_binary_and_large_values(client: dinomo.Client) -> None:
    key = bytes(range(256))
    value = os.urandom(512 * 1024)
    client.put(key, value)
    assert client.get(key) == value
    client.put("crud:empty-value", b"")
    assert client.get("crud:empty-value") == b""


def test_the_kn_limits_are_invalid_argument(client: dinomo.Client) -> None:
    with pytest.raises(dinomo.InvalidArgument):
        client.put(b"", "v")
    with pytest.raises(dinomo.InvalidArgument):
        client.put(b"k" * 5000, "v")
    with pytest.raises(dinomo.InvalidArgument):
        client.put("crud:too-big", b"x" * (2 << 20))
    assert client.get("crud:too-big") is None


def test_batch_across_kns(client: dinomo.Client) -> None:
    assert len(client.map.kns) == 2
    keys = [f"batch:{i}" for i in range(300)]
    out = client.batch([Op.put(k, f"v{i}") for i, k in enumerate(keys)])
    assert all(r.ok for r in out)
    out = client.batch([Op.get(k) for k in keys] + [Op.get("batch:missing")])
    assert [r.value for r in out] == [f"v{i}".encode() for i in range(300)] + [None]
    out = client.batch([Op.insert(keys[0], "x"), Op.update("batch:missing", "x"), Op.delete(keys[1]),
                        Op.delete("batch:missing")])
    assert [type(r.error).__name__ if r.error else r.value for r in out] == [
        "AlreadyExists", "NotFound", True, False]
    # The same key twice runs in order.
    out = client.batch([Op.put("batch:seq", "1"), Op.get("batch:seq"), Op.update("batch:seq", "2"),
                        Op.get("batch:seq")])
    assert [r.value for r in out] == [None, b"1", None, b"2"]
    assert client.batch([]) == []


def test_one_client_shared_by_threads(client: dinomo.Client) -> None:
    errors: list[str] = []

    def work(t: int) -> None:
        try:
            for i in range(40):
                key = f"threads:{t}:{i}"
                client.put(key, str(i))
                if client.get(key) != str(i).encode():
                    errors.append(f"{key} read back wrong")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert errors == [] and not any(th.is_alive() for th in threads)


def test_every_operation_went_to_its_owner(cluster: Cluster, client: dinomo.Client) -> None:
    """The KNs count WRONG_OWNER answers: the SDK's ring (checked against the vectors) and the
    KNs' agree, so after all the operations above there are none."""
    for i in range(100):
        client.put(f"owner:{i}", "v")
    gets = 0
    for kn in client.map.kns:
        node = _KvNode(kn.endpoint, client.identity)
        try:
            s = node.stub.Stats(kv_pb2.KnStatsRequest(), timeout=5)
        finally:
            node.close()
        assert s.wrong_owner == 0, (kn, s)
        gets += s.puts
    assert gets >= 100


def test_asyncio_twin(cluster: Cluster) -> None:
    async def run() -> None:
        async with await dinomo.aio.connect([cluster.routing], credentials=cluster.credentials) as c:
            assert await c.get("aio:k") is None
            await c.put("aio:k", "1")
            assert await c.get("aio:k") == b"1"
            with pytest.raises(dinomo.AlreadyExists):
                await c.insert("aio:k", "2")
            await c.update("aio:k", "3")
            with pytest.raises(dinomo.NotFound):
                await c.update("aio:missing", "3")
            assert await c.delete("aio:k") is True
            assert await c.delete("aio:k") is False
            out = await c.batch([Op.put(f"aio:{i}", str(i)) for i in range(50)])
            assert all(r.ok for r in out)
            got = await asyncio.gather(*(c.get(f"aio:{i}") for i in range(50)))
            assert got == [str(i).encode() for i in range(50)]
            with pytest.raises(dinomo.InvalidArgument):
                await c.put(b"", "v")

    asyncio.run(run())


def test_credentials_from_the_environment_and_the_working_directory(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DINOMO_INSECURE", raising=False)
    monkeypatch.setenv("DINOMO_CREDENTIALS", str(cluster.credentials))
    monkeypatch.chdir(tmp_path)
    with dinomo.connect(cluster.routing) as c:
        c.put("cred:env", "1")
    monkeypatch.delenv("DINOMO_CREDENTIALS")
    monkeypatch.chdir(cluster.dir)  # where `dinomo up` ran: .dinomo/credentials
    with dinomo.connect(cluster.routing) as c:
        assert c.get("cred:env") == b"1"


def test_plain_text_is_refused_by_a_secured_cluster(cluster: Cluster) -> None:
    cfg = dinomo.ClientConfig(deadline=1.0, rpc_timeout=0.5)
    with pytest.raises(dinomo.NoClusterMap, match="plain text"):
        dinomo.connect(cluster.routing, insecure=True, config=cfg)


def test_an_identity_of_another_role_is_permission_denied(cluster: Cluster, tmp_path: Path) -> None:
    assert cluster.credentials is not None
    wrong = tmp_path / "node-as-client"
    wrong.mkdir()
    shutil.copy(cluster.credentials / "ca.pem", wrong / "ca.pem")
    shutil.copy(cluster.credentials / "kn.pem", wrong / "client.pem")
    shutil.copy(cluster.credentials / "kn-key.pem", wrong / "client-key.pem")
    with pytest.raises(dinomo.PermissionDenied):
        dinomo.connect(cluster.routing, credentials=wrong, config=dinomo.ClientConfig(deadline=3.0))


def test_a_missing_explicit_folder_is_an_error(cluster: Cluster, tmp_path: Path) -> None:
    with pytest.raises(dinomo.CredentialsError):
        dinomo.connect(cluster.routing, credentials=tmp_path / "none")
