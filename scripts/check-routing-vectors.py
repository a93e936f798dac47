#!/usr/bin/env python3
"""Checks docs/routing-vectors.json against docs/routing-contract.md, implemented here from the
document alone (not from the Rust code): the key hash, the vnode positions, the ring owner and
the owners of every key. Needs the `xxhash` package (pip install xxhash).

    python3 scripts/check-routing-vectors.py [docs/routing-vectors.json]
"""
import bisect
import json
import struct
import sys

import xxhash


def key_hash(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key)


def position(kn: int, vnode: int) -> int:
    return key_hash(b"DNMVNODE" + struct.pack("<QI", kn, vnode))


def ring(m: dict) -> list:
    return sorted((position(k["id"], v), k["id"]) for k in m["kns"] for v in range(m["vnodes"]))


def ring_owner(points: list, h: int):
    if not points:
        return None
    i = bisect.bisect_left(points, (h, -1))
    return points[i % len(points)][1]


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/routing-vectors.json"
    with open(path) as f:
        v = json.load(f)
    m = v["map"]
    assert m["format_version"] == 1, m["format_version"]
    points = ring(m)
    replicated = {bytes.fromhex(r["key_hex"]): r["owners"] for r in m["replicated"]}
    bad = 0
    for p in v["vnode_positions"]:
        if position(p["kn"], p["vnode"]) != int(p["position"], 16):
            print(f"vnode {p}: position differs")
            bad += 1
    for k in v["keys"]:
        key = bytes.fromhex(k["key_hex"])
        h = key_hash(key)
        owner = ring_owner(points, h)
        owners = replicated.get(key, [owner])
        if h != int(k["key_hash"], 16) or owner != k["ring_owner"] or owners != k["owners"]:
            print(f"key {k['key_hex']!r}: got hash {h:016x} owner {owner} owners {owners}; file says {k}")
            bad += 1
    print(f"{len(v['keys'])} keys, {len(v['vnode_positions'])} vnode positions: {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
