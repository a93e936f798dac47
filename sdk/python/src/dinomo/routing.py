"""The routing contract (docs/routing-contract.md) in Python: decoding the cluster map, the key
hash, the ring, and the owners of a key.

This module owns everything a client needs to pick the KV node (KN) for a key from a map, and
nothing else (no I/O). Its behaviour is checked against docs/routing-vectors.json by
tests/test_routing_vectors.py.
"""
from __future__ import annotations

import bisect
import json
import random
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import xxhash

#: The only map encoding this SDK reads (section 2 of the contract).
MAP_FORMAT_VERSION = 1
MAX_VNODES = 4096
MAX_SHARDS_PER_KN = 1024
MAX_RING_POINTS = 1 << 20
_VNODE_PREFIX = b"DNMVNODE"
_MAP_FIELDS = {"format_version", "version", "vnodes", "shards_per_kn", "kns", "replicated"}


class MapError(ValueError):
    """A cluster map that does not follow the contract (refused, never half-read)."""


def key_hash(key: bytes) -> int:
    """XXH3-64 of the key's bytes, seed 0 (section 3)."""
    return xxhash.xxh3_64_intdigest(key)


def vnode_position(kn: int, vnode: int) -> int:
    """The ring position of virtual node ``vnode`` of KN ``kn`` (section 4): XXH3-64 of
    ``b"DNMVNODE" ++ u64_le(kn) ++ u32_le(vnode)``."""
    return xxhash.xxh3_64_intdigest(_VNODE_PREFIX + struct.pack("<QI", kn, vnode))


@dataclass(frozen=True)
class KnInfo:
    """One member of the map: its id and the ``host:port`` of its KvService."""

    id: int
    endpoint: str


@dataclass(frozen=True)
class ClusterMap:
    """A decoded cluster map. Build one with :meth:`decode`; the ring is computed once."""

    version: int
    vnodes: int
    shards_per_kn: int
    kns: tuple[KnInfo, ...]
    replicated: Mapping[bytes, tuple[int, ...]]
    _positions: list[int] = field(default_factory=list, repr=False, compare=False)
    _point_kns: list[int] = field(default_factory=list, repr=False, compare=False)

    @staticmethod
    def decode(data: bytes | str) -> "ClusterMap":
        """Decodes the compact JSON of section 2; raises :class:`MapError` for any departure
        (another format_version, an unknown or missing field, a bad value)."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise MapError(f"not a cluster map object: {e}") from None
        if not isinstance(obj, dict):
            raise MapError("not a cluster map object")
        if "format_version" not in obj:
            raise MapError("the format_version field is missing")
        if obj["format_version"] != MAP_FORMAT_VERSION:
            raise MapError(
                f"cluster map format_version {obj['format_version']!r}; this SDK reads only "
                f"{MAP_FORMAT_VERSION} (upgrade the SDK)"
            )
        unknown = set(obj) - _MAP_FIELDS
        missing = _MAP_FIELDS - set(obj)
        if unknown or missing:
            raise MapError(f"unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        version = _uint(obj["version"], "version", 64)
        vnodes = _uint(obj["vnodes"], "vnodes", 32)
        shards = _uint(obj["shards_per_kn"], "shards_per_kn", 32)
        kns = [_kn(k) for k in _list(obj["kns"], "kns")]
        replicated: dict[bytes, tuple[int, ...]] = {}
        for r in _list(obj["replicated"], "replicated"):
            if not isinstance(r, dict) or set(r) != {"key_hex", "owners"}:
                raise MapError(f"replicated entry {r!r}: expected key_hex and owners only")
            try:
                key = bytes.fromhex(r["key_hex"])
            except (TypeError, ValueError):
                raise MapError(f"replicated key_hex {r['key_hex']!r} is not hex") from None
            if key in replicated:
                raise MapError(f"replicated key {key!r} listed twice")
            replicated[key] = tuple(_uint(o, "owner", 32) for o in _list(r["owners"], "owners"))
        m = ClusterMap(version, vnodes, shards, tuple(sorted(kns, key=lambda k: k.id)), replicated)
        m._validate()
        m._build_ring()
        return m

    def _validate(self) -> None:
        if self.version == 0:
            raise MapError("map version 0")
        if not 1 <= self.vnodes <= MAX_VNODES:
            raise MapError(f"vnodes {self.vnodes}: expected 1..{MAX_VNODES}")
        if not 1 <= self.shards_per_kn <= MAX_SHARDS_PER_KN:
            raise MapError(f"shards_per_kn {self.shards_per_kn}: expected 1..{MAX_SHARDS_PER_KN}")
        ids = [k.id for k in self.kns]
        if len(set(ids)) != len(ids):
            raise MapError(f"duplicate KN ids in {ids}")
        if any(not k.endpoint.strip() for k in self.kns):
            raise MapError("a KN with an empty endpoint")
        if len(self.kns) * self.vnodes > MAX_RING_POINTS:
            raise MapError(f"{len(self.kns)} KNs x {self.vnodes} vnodes: too many ring points")
        for key, owners in self.replicated.items():
            if not key:
                raise MapError("an empty replicated key")
            if not owners:
                raise MapError(f"replicated key {key!r} without owners")
            if len(set(owners)) != len(owners) or not set(owners) <= set(ids):
                raise MapError(f"replicated key {key!r}: owners {owners} not distinct members")

    def _build_ring(self) -> None:
        points = sorted(
            (vnode_position(k.id, v), k.id) for k in self.kns for v in range(self.vnodes)
        )
        positions: list[int] = []
        owners: list[int] = []
        for pos, kn in points:
            # A 64-bit collision: the smaller id (sorted first) owns the arc, the other none.
            if positions and positions[-1] == pos:
                continue
            positions.append(pos)
            owners.append(kn)
        object.__setattr__(self, "_positions", positions)
        object.__setattr__(self, "_point_kns", owners)

    def ring_owner(self, key: bytes) -> Optional[int]:
        """The ring owner of ``key`` (section 4), ignoring replication; None without KNs."""
        if not self._positions:
            return None
        i = bisect.bisect_left(self._positions, key_hash(key))
        return self._point_kns[i % len(self._positions)]

    def owners(self, key: bytes) -> list[int]:
        """The KNs that serve ``key`` (section 5): a replicated key's list, else its ring owner,
        else none (a map without KNs)."""
        listed = self.replicated.get(key)
        if listed is not None:
            return list(listed)
        owner = self.ring_owner(key)
        return [] if owner is None else [owner]

    def pick_owner(self, key: bytes) -> Optional[int]:
        """The KN to send ``key`` to: its owner, or one of a replicated key's owners at random
        (as the Rust SDK does, which spreads a hot key's load)."""
        listed = self.replicated.get(key)
        if listed is not None:
            return random.choice(listed)
        return self.ring_owner(key)

    def endpoint(self, kn: int) -> Optional[str]:
        """The endpoint of member ``kn``, or None if it is not a member."""
        for k in self.kns:
            if k.id == kn:
                return k.endpoint
        return None


def _uint(v: Any, name: str, bits: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < (1 << bits):
        raise MapError(f"{name} {v!r}: expected an unsigned {bits}-bit integer")
    return v


def _list(v: Any, name: str) -> Sequence[Any]:
    if not isinstance(v, list):
        raise MapError(f"{name}: expected a list")
    return v


def _kn(k: Any) -> KnInfo:
    if not isinstance(k, dict) or set(k) != {"id", "endpoint"}:
        raise MapError(f"kns entry {k!r}: expected id and endpoint only")
    if not isinstance(k["endpoint"], str):
        raise MapError(f"kns entry {k!r}: endpoint is not a string")
    return KnInfo(_uint(k["id"], "kn id", 32), k["endpoint"])
