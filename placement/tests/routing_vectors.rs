//! The routing contract's test vectors (docs/routing-contract.md): a cluster map, vnode
//! positions, and keys with their hash, ring owner, owners and shard, in
//! docs/routing-vectors.json. This test fails if this build routes any of them differently;
//! clients in other languages (the Python SDK) check the same file.
//!
//! `DINOMO_WRITE_VECTORS=1 cargo test -p dinomo-placement --test routing_vectors` rewrites the
//! file from this build: only for a deliberate format change, which also needs a new
//! `format_version` of the map.

use dinomo_placement::{ClusterMap, KnInfo};
use serde_json::{json, Value};

const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/routing-vectors.json");

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn u64_hex(x: u64) -> String {
    format!("{x:016x}")
}

/// The map of the vectors: KN ids with gaps, a replicated key, few vnodes (so that a reader can
/// follow the ring by hand).
fn map() -> ClusterMap {
    let kns = [1u32, 2, 5]
        .iter()
        .map(|&id| KnInfo {
            id,
            endpoint: format!("10.0.0.{id}:7800"),
        })
        .collect();
    ClusterMap::new(kns, 8, 4)
        .unwrap()
        .with_replicated(b"hot".to_vec(), vec![5, 1])
        .unwrap()
}

fn keys() -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"a".to_vec(),
        b"hot".to_vec(),
        b"user1".to_vec(),
        b"user1000".to_vec(),
        vec![0x00, 0xff, 0x10],
        vec![b'x'; 100],
    ];
    keys.extend((0..16).map(|i| format!("key{i}").into_bytes()));
    keys.extend((0..8).map(|i| format!("user{:020}", i * 7919).into_bytes()));
    keys
}

fn vectors() -> Value {
    let map = map();
    let positions: Vec<Value> = map
        .kn_ids()
        .flat_map(|kn| {
            (0..2u32).map(move |v| {
                json!({
                    "kn": kn,
                    "vnode": v,
                    "position": u64_hex(dinomo_placement::vnode_position(u64::from(kn), v)),
                })
            })
        })
        .collect();
    let keys: Vec<Value> = keys()
        .iter()
        .map(|k| {
            json!({
                "key_hex": hex(k),
                "key_hash": u64_hex(dinomo_placement::key_hash(k)),
                "ring_owner": map.owner(k),
                "owners": map.owners(k),
                "shard": map.shard_of(k),
            })
        })
        .collect();
    json!({
        "about": "Routing test vectors: see docs/routing-contract.md. u64 values are 16 hex digits.",
        "map": serde_json::from_slice::<Value>(&map.encode()).unwrap(),
        "vnode_positions": positions,
        "keys": keys,
    })
}

#[test]
fn this_build_routes_the_vectors_as_written() {
    let computed = vectors();
    if std::env::var("DINOMO_WRITE_VECTORS").as_deref() == Ok("1") {
        let text = serde_json::to_string_pretty(&computed).unwrap() + "\n";
        std::fs::write(FILE, text).unwrap();
        return;
    }
    let text = std::fs::read_to_string(FILE).expect("docs/routing-vectors.json");
    let written: Value = serde_json::from_str(&text).unwrap();
    // The written map decodes to the same map (the encoding is part of the contract).
    let decoded = ClusterMap::decode(written["map"].to_string().as_bytes()).unwrap();
    assert_eq!(
        decoded.encode(),
        map().encode(),
        "the map's encoding changed"
    );
    assert_eq!(
        written["vnode_positions"], computed["vnode_positions"],
        "vnode positions changed: a cluster-map format change"
    );
    let (w, c) = (
        written["keys"].as_array().unwrap(),
        computed["keys"].as_array().unwrap(),
    );
    assert_eq!(w.len(), c.len());
    for (w, c) in w.iter().zip(c) {
        assert_eq!(w, c, "key {} routes differently", w["key_hex"]);
    }
}
