use super::*;
use crate::key_hash;
use proptest::prelude::*;

fn kn(id: KnId) -> KnInfo {
    KnInfo {
        id,
        endpoint: format!("10.0.0.{id}:7000"),
    }
}

fn map_of(ids: impl IntoIterator<Item = KnId>, vnodes: u32) -> ClusterMap {
    ClusterMap::new(ids.into_iter().map(kn).collect(), vnodes, 4).unwrap()
}

fn sample_keys(n: usize, salt: u64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("user{salt}:{i}").into_bytes())
        .collect()
}

#[test]
fn new_is_version_one_sorted_and_valid() {
    let m = ClusterMap::new(vec![kn(5), kn(1), kn(3)], 64, 8).unwrap();
    assert_eq!(m.version, 1);
    assert_eq!(m.kn_ids().collect::<Vec<_>>(), vec![1, 3, 5]);
    assert!(m.replicated.is_empty());
    assert_eq!(m.endpoint(3), Some("10.0.0.3:7000"));
    assert_eq!(m.endpoint(4), None);
    assert!(m.contains(5) && !m.contains(2));
}

#[test]
fn new_refuses_invalid_input() {
    use PlacementError::*;
    assert_eq!(
        ClusterMap::new(vec![kn(1), kn(1)], 64, 1),
        Err(DuplicateKn(1))
    );
    let blank = KnInfo {
        id: 2,
        endpoint: "  ".into(),
    };
    assert_eq!(ClusterMap::new(vec![blank], 64, 1), Err(EmptyEndpoint(2)));
    assert_eq!(
        ClusterMap::new(vec![kn(1)], 0, 1),
        Err(BadVnodes {
            found: 0,
            max: MAX_VNODES
        })
    );
    assert!(matches!(
        ClusterMap::new(vec![kn(1)], MAX_VNODES + 1, 1),
        Err(BadVnodes { .. })
    ));
    assert_eq!(
        ClusterMap::new(vec![kn(1)], 64, 0),
        Err(BadShards {
            found: 0,
            max: MAX_SHARDS_PER_KN
        })
    );
    let many: Vec<KnInfo> = (0..1000).map(kn).collect();
    assert!(matches!(
        ClusterMap::new(many, MAX_VNODES, 1),
        Err(RingTooLarge { kns: 1000, .. })
    ));
}

#[test]
fn empty_map_owns_nothing() {
    let m = ClusterMap::new(vec![], 64, 2).unwrap();
    assert_eq!(m.owner(b"k"), None);
    assert!(m.owners(b"k").is_empty());
    assert!(!m.is_owner(0, b"k"));
    assert!(m.shard_of(b"k") < 2);
}

#[test]
fn error_messages_name_values() {
    let e = ClusterMap::new(vec![kn(1)], 64, 0).unwrap_err().to_string();
    assert!(e.contains("got 0") && e.contains("1024"), "{e}");
    let e = map_of([1], 8)
        .with_replicated(b"hot".to_vec(), vec![9])
        .unwrap_err()
        .to_string();
    assert!(e.contains("0x686f74") && e.contains("KN 9"), "{e}");
}

#[test]
fn owners_follow_ring_unless_replicated() {
    let m = map_of([1, 2, 3, 4], 64);
    for key in sample_keys(200, 0) {
        let o = m.owner(&key).unwrap();
        assert_eq!(m.owner_by_hash(key_hash(&key)), Some(o));
        assert_eq!(m.owners(&key), vec![o]);
        for id in 1..=4 {
            assert_eq!(m.is_owner(id, &key), id == o);
        }
    }
    let hot = b"hot-key".to_vec();
    let ring_owner = m.owner(&hot).unwrap();
    let others: Vec<KnId> = (1..=4).filter(|&i| i != ring_owner).take(2).collect();
    let r = m.with_replicated(hot.clone(), others.clone()).unwrap();
    assert_eq!(r.version, 2);
    assert!(r.is_replicated(&hot));
    assert_eq!(r.owners(&hot), others);
    assert_eq!(r.owner(&hot), Some(ring_owner), "owner() is the ring alone");
    assert!(!r.is_owner(ring_owner, &hot));
    assert!(others.iter().all(|&o| r.is_owner(o, &hot)));
    // The original map is untouched.
    assert_eq!(m.version, 1);
    assert!(!m.is_replicated(&hot));
}

#[test]
fn replica_candidates_start_with_owner() {
    let m = map_of([1, 2, 3, 4, 5], 64);
    for key in sample_keys(100, 1) {
        let c = m.replica_candidates(&key, 3);
        assert_eq!(c.len(), 3);
        assert_eq!(c[0], m.owner(&key).unwrap());
    }
}

#[test]
fn with_replicated_validates() {
    use PlacementError::*;
    let m = map_of([1, 2, 3], 32);
    assert_eq!(
        m.with_replicated(b"k".to_vec(), vec![1, 7]),
        Err(UnknownReplicaOwner {
            key: "0x6b".into(),
            kn: 7
        })
    );
    assert_eq!(
        m.with_replicated(b"k".to_vec(), vec![2, 2]),
        Err(DuplicateReplicaOwner {
            key: "0x6b".into(),
            kn: 2
        })
    );
    assert_eq!(
        m.with_replicated(Vec::new(), vec![1]),
        Err(EmptyReplicatedKey)
    );
    let r = m.with_replicated(b"k".to_vec(), vec![3, 1]).unwrap();
    assert_eq!(r.replicated.get(&b"k"[..]), Some(&vec![3, 1]));
    let d = r.with_replicated(b"k".to_vec(), vec![]).unwrap();
    assert_eq!(d.version, 3);
    assert!(d.replicated.is_empty());
    // De-replicating a key that is not replicated only bumps the version.
    let d2 = d.with_replicated(b"other".to_vec(), vec![]).unwrap();
    assert_eq!(d2.version, 4);
    assert!(d2.replicated.is_empty());
}

#[test]
fn with_kn_added_and_removed() {
    use PlacementError::*;
    let m = map_of([1, 2], 32);
    assert_eq!(m.with_kn_added(kn(2)), Err(DuplicateKn(2)));
    let a = m.with_kn_added(kn(0)).unwrap();
    assert_eq!(a.version, 2);
    assert_eq!(a.kn_ids().collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(a.with_kn_removed(9), Err(UnknownKn(9)));

    let r = a
        .with_replicated(b"x".to_vec(), vec![2, 0])
        .unwrap()
        .with_replicated(b"y".to_vec(), vec![2])
        .unwrap();
    let gone = r.with_kn_removed(2).unwrap();
    assert_eq!(gone.version, r.version + 1);
    assert!(!gone.contains(2));
    assert_eq!(gone.replicated.get(&b"x"[..]), Some(&vec![0]));
    assert!(
        !gone.is_replicated(b"y"),
        "a key left with no owners is de-replicated"
    );
    assert!(gone.owners(b"y")[0] != 2);

    let mut maxed = m.clone();
    maxed.version = u64::MAX;
    assert_eq!(maxed.with_kn_added(kn(3)), Err(VersionExhausted(u64::MAX)));
}

#[test]
fn direct_field_writes_do_not_leave_a_stale_ring() {
    let mut m = map_of([1, 2], 32);
    assert!(m.owner(b"k").is_some()); // builds and caches the ring
    m.kns.retain(|k| k.id == 1);
    assert_eq!(m.owner(b"k"), Some(1));
    m.kns = vec![kn(2)];
    assert_eq!(m.owner(b"k"), Some(2));
}

#[test]
fn debug_omits_the_ring() {
    let m = map_of([1], 4)
        .with_replicated(b"hot".to_vec(), vec![1])
        .unwrap();
    let _ = m.owner(b"k");
    let s = format!("{m:?}");
    assert!(s.contains("version: 2") && s.contains("0x686f74"), "{s}");
    assert!(!s.contains("positions"), "{s}");
}

#[test]
fn changed_ranges_of_membership_changes() {
    let m = map_of([1, 2, 3, 4], 64);
    assert!(m.changed_ranges(&m).is_empty());
    let added = m.with_kn_added(kn(9)).unwrap();
    let c = m.changed_ranges(&added);
    assert!(c.contains(&9));
    // Only members of either map can appear.
    for &k in &c {
        assert!(k == 9 || m.contains(k));
    }
    let removed = m.with_kn_removed(3).unwrap();
    let c = m.changed_ranges(&removed);
    assert!(c.contains(&3));
    // Symmetric.
    assert_eq!(c, removed.changed_ranges(&m));
}

#[test]
fn changed_ranges_of_replication_changes_is_exactly_the_owners() {
    let m = map_of([1, 2, 3, 4, 5], 64);
    let key = b"hot".to_vec();
    let o = m.owner(&key).unwrap();
    let others: Vec<KnId> = (1..=5).filter(|&i| i != o).take(2).collect();
    let r = m.with_replicated(key.clone(), others.clone()).unwrap();
    let mut expected: Vec<KnId> = others.iter().copied().chain([o]).collect();
    expected.sort_unstable();
    assert_eq!(m.changed_ranges(&r), expected);
    // Reordering the owner list does not change ownership.
    let mut reordered = others.clone();
    reordered.reverse();
    let r2 = r.with_replicated(key.clone(), reordered).unwrap();
    assert!(r.changed_ranges(&r2).is_empty());
    // De-replicating hands the key back to its ring owner.
    let d = r2.with_replicated(key, vec![]).unwrap();
    assert_eq!(r2.changed_ranges(&d), expected);
}

#[test]
fn shard_of_spreads_one_kns_keys_evenly() {
    let shards = 8;
    let m = ClusterMap::new((1..=4).map(kn).collect(), 64, shards).unwrap();
    let keys = sample_keys(40_000, 7);
    for id in 1..=4 {
        let mut counts = vec![0usize; shards as usize];
        let mut total = 0usize;
        for key in keys.iter().filter(|k| m.owner(k) == Some(id)) {
            let s = m.shard_of(key);
            assert_eq!(s, m.shard_of_hash(key_hash(key)));
            counts[s as usize] += 1;
            total += 1;
        }
        let fair = total as f64 / f64::from(shards);
        for (s, &c) in counts.iter().enumerate() {
            let ratio = c as f64 / fair;
            assert!(
                (0.8..=1.2).contains(&ratio),
                "KN {id} shard {s}: {ratio:.3}x fair share ({counts:?})"
            );
        }
    }
}

#[test]
fn encode_is_the_documented_json() {
    let m = map_of([2], 8)
        .with_replicated(b"hot".to_vec(), vec![2])
        .unwrap();
    let s = String::from_utf8(m.encode()).unwrap();
    assert_eq!(
        s,
        r#"{"format_version":1,"version":2,"vnodes":8,"shards_per_kn":4,"kns":[{"id":2,"endpoint":"10.0.0.2:7000"}],"replicated":[{"key_hex":"686f74","owners":[2]}]}"#
    );
}

#[test]
fn decode_refuses_other_format_versions_by_name() {
    let m = map_of([1, 2], 16);
    let s = String::from_utf8(m.encode()).unwrap();
    let v2 = s.replace("\"format_version\":1", "\"format_version\":2");
    let e = ClusterMap::decode(v2.as_bytes()).unwrap_err();
    assert_eq!(
        e,
        PlacementError::FormatVersion {
            found: 2,
            expected: 1
        }
    );
    let msg = e.to_string();
    assert!(
        msg.contains("format version 2") && msg.contains("format version 1"),
        "{msg}"
    );
    // A future version with fields we do not know is still refused by version.
    let future = br#"{"format_version":3,"ring":"something new"}"#;
    assert!(matches!(
        ClusterMap::decode(future),
        Err(PlacementError::FormatVersion { found: 3, .. })
    ));
    let missing = s.replace("\"format_version\":1,", "");
    assert!(matches!(
        ClusterMap::decode(missing.as_bytes()),
        Err(PlacementError::Malformed(_))
    ));
}

#[test]
fn decode_refuses_invalid_maps() {
    use PlacementError::*;
    let good = String::from_utf8(
        map_of([1, 2], 16)
            .with_replicated(b"k".to_vec(), vec![1])
            .unwrap()
            .encode(),
    )
    .unwrap();
    type Check = fn(&PlacementError) -> bool;
    let cases: Vec<(String, Check)> = vec![
        (good.replace("\"version\":2", "\"version\":0"), |e| {
            *e == ZeroVersion
        }),
        (good.replace("\"id\":2", "\"id\":1"), |e| {
            *e == DuplicateKn(1)
        }),
        (good.replace("\"owners\":[1]", "\"owners\":[5]"), |e| {
            matches!(e, UnknownReplicaOwner { kn: 5, .. })
        }),
        (good.replace("\"owners\":[1]", "\"owners\":[]"), |e| {
            matches!(e, NoReplicaOwners(_))
        }),
        (
            good.replace("\"key_hex\":\"6b\"", "\"key_hex\":\"6\""),
            |e| matches!(e, Malformed(_)),
        ),
        (
            good.replace("\"key_hex\":\"6b\"", "\"key_hex\":\"zz\""),
            |e| matches!(e, Malformed(_)),
        ),
        (
            good.replace("\"key_hex\":\"6b\"", "\"key_hex\":\"\""),
            |e| *e == EmptyReplicatedKey,
        ),
        (
            good.replace(
                "[{\"key_hex\":\"6b\",\"owners\":[1]}]",
                "[{\"key_hex\":\"6b\",\"owners\":[1]},{\"key_hex\":\"6B\",\"owners\":[2]}]",
            ),
            |e| matches!(e, DuplicateReplicatedKey(_)),
        ),
        (
            good.replace("\"vnodes\":16", "\"vnodes\":4294967295"),
            |e| matches!(e, BadVnodes { .. }),
        ),
        (
            good.replace("\"vnodes\":16,", "\"vnodes\":16,\"extra\":true,"),
            |e| matches!(e, Malformed(m) if m.contains("extra")),
        ),
        (good.replace("\"vnodes\":16", "\"vnodes\":-1"), |e| {
            matches!(e, Malformed(_))
        }),
        (good[..good.len() / 2].to_string(), |e| {
            matches!(e, Malformed(_))
        }),
        ("[]".to_string(), |e| matches!(e, Malformed(_))),
        (String::new(), |e| matches!(e, Malformed(_))),
    ];
    for (bytes, ok) in cases {
        assert_ne!(bytes, good, "test case did not change the encoding");
        let e = ClusterMap::decode(bytes.as_bytes()).unwrap_err();
        assert!(ok(&e), "{bytes} -> unexpected {e:?}");
    }
    assert!(ClusterMap::decode(good.as_bytes()).is_ok());
}

/// A random valid map reached through the public transitions.
fn arb_map() -> impl Strategy<Value = ClusterMap> {
    (
        prop::collection::btree_set(0u32..64, 0..10),
        1u32..96,
        1u32..16,
        prop::collection::vec(
            (
                prop::collection::vec(any::<u8>(), 1..12),
                prop::collection::vec(any::<prop::sample::Index>(), 0..4),
            ),
            0..4,
        ),
    )
        .prop_map(|(ids, vnodes, shards, reps)| {
            let mut m =
                ClusterMap::new(ids.iter().map(|&i| kn(i)).collect(), vnodes, shards).unwrap();
            let members: Vec<KnId> = ids.into_iter().collect();
            if !members.is_empty() {
                for (key, picks) in reps {
                    let mut owners: Vec<KnId> = picks
                        .iter()
                        .map(|p| members[p.index(members.len())])
                        .collect();
                    owners.dedup();
                    let mut seen = BTreeSet::new();
                    owners.retain(|o| seen.insert(*o));
                    m = m.with_replicated(key, owners).unwrap();
                }
            }
            m
        })
}

/// One random transition applied to `m` (or `m` unchanged if it does not apply).
#[derive(Clone, Debug)]
enum Step {
    Add(KnId),
    Remove(prop::sample::Index),
    Replicate(Vec<u8>, Vec<prop::sample::Index>),
    ReplicateSampleKey(usize, Vec<prop::sample::Index>),
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u32..64).prop_map(Step::Add),
        any::<prop::sample::Index>().prop_map(Step::Remove),
        (
            prop::collection::vec(any::<u8>(), 1..6),
            prop::collection::vec(any::<prop::sample::Index>(), 0..3)
        )
            .prop_map(|(k, o)| Step::Replicate(k, o)),
        (
            0usize..3000,
            prop::collection::vec(any::<prop::sample::Index>(), 0..3)
        )
            .prop_map(|(k, o)| Step::ReplicateSampleKey(k, o)),
    ]
}

fn apply(m: &ClusterMap, step: &Step, keys: &[Vec<u8>]) -> ClusterMap {
    let members: Vec<KnId> = m.kn_ids().collect();
    let pick_owners = |picks: &[prop::sample::Index]| -> Vec<KnId> {
        let mut seen = BTreeSet::new();
        picks
            .iter()
            .map(|p| members[p.index(members.len())])
            .filter(|o| seen.insert(*o))
            .collect()
    };
    let next = match step {
        Step::Add(id) => m.with_kn_added(kn(*id)).ok(),
        Step::Remove(i) if !members.is_empty() => {
            m.with_kn_removed(members[i.index(members.len())]).ok()
        }
        Step::Replicate(key, picks) if !members.is_empty() => {
            m.with_replicated(key.clone(), pick_owners(picks)).ok()
        }
        Step::ReplicateSampleKey(i, picks) if !members.is_empty() => m
            .with_replicated(keys[*i % keys.len()].clone(), pick_owners(picks))
            .ok(),
        _ => None,
    };
    next.unwrap_or_else(|| m.clone())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn encode_decode_roundtrip(m in arb_map()) {
        let bytes = m.encode();
        let back = ClusterMap::decode(&bytes).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(back.encode(), bytes);
        for key in sample_keys(50, 3) {
            prop_assert_eq!(back.owners(&key), m.owners(&key));
        }
    }

    #[test]
    fn decode_never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = ClusterMap::decode(&bytes);
    }

    #[test]
    fn decode_never_panics_on_corrupted_encodings(
        m in arb_map(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = m.encode();
        for (at, b) in flips {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        if let Ok(d) = ClusterMap::decode(&bytes) {
            // Whatever survives must be a valid map.
            prop_assert!(d.validate().is_ok());
        }
        let n = cut.index(bytes.len());
        let _ = ClusterMap::decode(&bytes[..n]);
    }

    #[test]
    fn changed_ranges_agrees_with_sampled_keys(
        start in arb_map(),
        steps in prop::collection::vec(arb_step(), 1..4),
        salt in any::<u64>(),
    ) {
        let keys = sample_keys(3_000, salt);
        let mut next = start.clone();
        for step in &steps {
            next = apply(&next, step, &keys);
        }
        let changed: BTreeSet<KnId> = start.changed_ranges(&next).into_iter().collect();
        prop_assert_eq!(changed.len(), start.changed_ranges(&next).len(), "sorted and distinct");
        let all_keys = keys.iter().chain(start.replicated.keys()).chain(next.replicated.keys());
        for key in all_keys {
            let before: BTreeSet<KnId> = start.owners(key).into_iter().collect();
            let after: BTreeSet<KnId> = next.owners(key).into_iter().collect();
            if before != after {
                // Every KN that loses or gains the key takes part.
                for k in before.iter().chain(&after) {
                    prop_assert!(changed.contains(k), "KN {} owns key {:?} in only one map", k, key);
                }
            }
            // A KN outside the set owns this key in both maps or in neither.
            for k in start.kn_ids().chain(next.kn_ids()) {
                if !changed.contains(&k) {
                    prop_assert_eq!(start.is_owner(k, key), next.is_owner(k, key));
                }
            }
        }
    }
}

#[test]
fn a_key_entering_or_leaving_replication_involves_its_owners_even_if_they_stay() {
    let m = map_of([1, 2, 3], 64);
    let key = b"hot".to_vec();
    let o = m.owner(&key).unwrap();
    // Replicated over its ring owner alone: same owner set, different serving mode.
    let r = m.with_replicated(key.clone(), vec![o]).unwrap();
    assert_eq!(m.changed_ranges(&r), vec![o]);
    // And back (e.g. after the other owners were removed): the owner is paused again.
    let d = r.with_replicated(key, vec![]).unwrap();
    assert_eq!(r.changed_ranges(&d), vec![o]);
}
