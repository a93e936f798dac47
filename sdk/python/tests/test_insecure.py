"""A cluster started with `dinomo up --insecure`: plain text, chosen by argument or by
$DINOMO_INSECURE as the CLI does."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import dinomo

from cluster import Cluster, start_cluster


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("insecure"), insecure=True, kns=1)
    try:
        yield c
    finally:
        c.stop()


def test_insecure_by_argument(plain: Cluster) -> None:
    with dinomo.connect([plain.routing], insecure=True) as c:
        c.put("plain:k", "v")
        assert c.get("plain:k") == b"v"
        assert [k.id for k in c.map.kns] == [1]


def test_insecure_by_environment(plain: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DINOMO_INSECURE", "1")
    monkeypatch.chdir(tmp_path)
    with dinomo.connect(plain.routing) as c:
        assert c.identity is None
        assert c.get("plain:k") == b"v"
