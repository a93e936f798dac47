"""The package's own routing code (dinomo.routing) against docs/routing-vectors.json, and the
map decoder's refusals (docs/routing-contract.md section 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dinomo.routing import ClusterMap, MapError, key_hash, vnode_position

VECTORS = Path(__file__).resolve().parents[3] / "docs" / "routing-vectors.json"


@pytest.fixture(scope="module")
def vectors() -> dict:
    return json.loads(VECTORS.read_text())


@pytest.fixture(scope="module")
def cmap(vectors: dict) -> ClusterMap:
    return ClusterMap.decode(json.dumps(vectors["map"], separators=(",", ":")))


def test_the_vectors_have_content(vectors: dict) -> None:
    assert len(vectors["keys"]) >= 30 and len(vectors["vnode_positions"]) >= 6


def test_vnode_positions(vectors: dict) -> None:
    for p in vectors["vnode_positions"]:
        assert vnode_position(p["kn"], p["vnode"]) == int(p["position"], 16), p


def test_key_hash_ring_owner_and_owners(vectors: dict, cmap: ClusterMap) -> None:
    for k in vectors["keys"]:
        key = bytes.fromhex(k["key_hex"])
        assert key_hash(key) == int(k["key_hash"], 16), k
        assert cmap.ring_owner(key) == k["ring_owner"], k
        assert cmap.owners(key) == k["owners"], k


def test_pick_owner_spreads_a_replicated_key_over_its_owners(vectors: dict, cmap: ClusterMap) -> None:
    seen = {cmap.pick_owner(b"hot") for _ in range(200)}
    assert seen == {5, 1}
    for k in vectors["keys"]:
        key = bytes.fromhex(k["key_hex"])
        if key != b"hot":
            assert cmap.pick_owner(key) == k["ring_owner"]


def test_the_decoded_map(cmap: ClusterMap) -> None:
    assert cmap.version == 2 and cmap.vnodes == 8 and cmap.shards_per_kn == 4
    assert [k.id for k in cmap.kns] == [1, 2, 5]
    assert cmap.endpoint(5) == "10.0.0.5:7800" and cmap.endpoint(3) is None


def _encoded(**changes: object) -> str:
    m: dict = {"format_version": 1, "version": 7, "vnodes": 128, "shards_per_kn": 4,
               "kns": [{"id": 1, "endpoint": "10.0.0.5:7800"}],
               "replicated": [{"key_hex": "686f74", "owners": [1]}]}
    m.update(changes)
    return json.dumps({k: v for k, v in m.items() if v is not None})


def test_the_documented_example_decodes() -> None:
    m = ClusterMap.decode(_encoded())
    assert m.owners(b"hot") == [1] and m.owners(b"other") == [1]


@pytest.mark.parametrize("bad", [
    _encoded(format_version=2),
    _encoded(format_version=None),
    _encoded(extra=1),
    _encoded(replicated=None),
    _encoded(version=0),
    _encoded(vnodes=0),
    _encoded(vnodes=4097),
    _encoded(kns=[{"id": 1, "endpoint": "a:1"}, {"id": 1, "endpoint": "b:1"}]),
    _encoded(kns=[{"id": 1, "endpoint": " "}]),
    _encoded(kns=[{"id": 1, "endpoint": "a:1", "zone": "x"}]),
    _encoded(replicated=[{"key_hex": "zz", "owners": [1]}]),
    _encoded(replicated=[{"key_hex": "68", "owners": [2]}]),
    _encoded(replicated=[{"key_hex": "68", "owners": [1, 1]}]),
    _encoded(replicated=[{"key_hex": "68", "owners": []}]),
    _encoded(version=-1),
    "[]",
    "not json",
])
def test_a_bad_map_is_refused(bad: str) -> None:
    with pytest.raises(MapError):
        ClusterMap.decode(bad)


def test_a_map_without_kns_owns_nothing() -> None:
    m = ClusterMap.decode(_encoded(kns=[], replicated=[]))
    assert m.owners(b"k") == [] and m.pick_owner(b"k") is None
