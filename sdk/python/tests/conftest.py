"""Test-session plumbing: the ``cluster`` fixture (a TLS `dinomo up` cluster with 2 KNs, one
per test module that asks for it; see cluster.py) and the tests' import path."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import DINOMO, Cluster, start_cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A TLS cluster (2 KNs) for one test module."""
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


def pytest_report_header(config: pytest.Config) -> str:
    import dinomo

    return f"dinomo {dinomo.__version__} from {Path(dinomo.__file__).parent}; binaries from {DINOMO.parent}"
