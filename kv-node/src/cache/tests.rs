//! Unit and property tests of the cache rules.

use std::collections::HashMap;

use bytes::Bytes;
use dinomo_layout::index::EntryPtr;
use proptest::prelude::*;

use super::store::Slot;
use super::*;

const K: usize = 8; // key length used by the unit tests
const SC: usize = K + SHORTCUT_OVERHEAD; // a shortcut's cost with an 8-byte key
/// A value length whose value entry costs exactly three shortcuts: promoting a shortcut to
/// it in a full cache of shortcuts needs room for two more shortcuts (N = 2).
const V2: usize = 3 * SC - K - VALUE_OVERHEAD;

fn key(i: u64) -> [u8; 8] {
    i.to_be_bytes()
}

fn sc(i: u64, version: u64) -> Shortcut {
    Shortcut {
        ptr: EntryPtr::new(4096 + 4096 * i, 256),
        version,
    }
}

fn val(len: usize, fill: u8) -> Bytes {
    Bytes::from(vec![fill; len])
}

/// Cost of an 8-byte key with a value of `len` bytes.
fn vc(len: usize) -> usize {
    K + len + VALUE_OVERHEAD
}

fn cache(policy: Policy, budget: usize) -> Cache {
    Cache::new(CacheConfig {
        budget_bytes: budget,
        policy,
    })
}

fn is_value(c: &Cache, k: u64) -> bool {
    matches!(c.peek(&key(k)), Lookup::Value { .. })
}

fn is_shortcut(c: &Cache, k: u64) -> bool {
    matches!(c.peek(&key(k)), Lookup::Shortcut(_))
}

fn cached(c: &Cache, k: u64) -> bool {
    !matches!(c.peek(&key(k)), Lookup::Miss)
}

/// `n` lookups of a shortcut key, each served with 1 RT (so avg shortcut-hit RTs stays 1.0).
fn shortcut_hits(c: &mut Cache, k: u64, n: usize, value: &Bytes) {
    for _ in 0..n {
        assert!(matches!(c.lookup(&key(k)), Lookup::Shortcut(_)));
        c.on_shortcut_read(&key(k), value.clone(), 1);
    }
}

/// A DAC cache of exactly four 8-byte-key shortcuts, keys 0..4 with access counts
/// `counts`, made by writing four `V2`-byte values into a large budget, looking them up
/// (value hits never promote anything) and cutting the budget to four shortcuts (which
/// demotes every value, keeping the counts).
fn dac_four_shortcuts(counts: [u64; 4]) -> Cache {
    let mut c = cache(Policy::Dac, 10 * vc(V2));
    for k in 0..4 {
        c.on_write(&key(k), sc(k, 1), val(V2, k as u8));
        for _ in 1..counts[k as usize] {
            assert!(matches!(c.lookup(&key(k)), Lookup::Value { .. }));
        }
    }
    assert_eq!(c.stats().values, 4);
    c.set_budget(4 * SC);
    let s = c.stats();
    assert_eq!((s.values, s.shortcuts, s.demotions), (0, 4, 4));
    for k in 0..4 {
        assert_eq!(c.hits(&key(k)), Some(counts[k as usize]));
    }
    c.check();
    c
}

// ----- policy names -----

#[test]
fn policy_names_round_trip() {
    for (s, p) in [
        ("dac", Policy::Dac),
        ("shortcut-only", Policy::ShortcutOnly),
        ("value-only", Policy::ValueOnly),
        ("static-0", Policy::Static { value_percent: 0 }),
        ("static-50", Policy::Static { value_percent: 50 }),
        ("static-100", Policy::Static { value_percent: 100 }),
    ] {
        assert_eq!(s.parse::<Policy>().unwrap(), p);
        assert_eq!(p.to_string(), s);
    }
    for bad in [
        "",
        "DAC",
        "static-",
        "static-101",
        "static-+5",
        "static--1",
        "static-5x",
        "lru",
    ] {
        let e = bad.parse::<Policy>().unwrap_err();
        assert!(e.to_string().contains("static-N"), "{e}");
    }
}

// ----- memory accounting -----

#[test]
fn overheads_cover_the_real_structures() {
    if std::mem::size_of::<usize>() != 8 {
        return;
    }
    let slot = std::mem::size_of::<Slot>();
    assert_eq!(slot, 64, "update the constants and the module doc");
    let table = 8; // u32 index + control byte at 7/8 load
    let key_alloc = 16; // allocator header/rounding of the boxed key
    let bucket_share = 24; // one frequency bucket (u64 count -> two u32) per shortcut
    let value_handle = std::mem::size_of::<Bytes>();
    assert_eq!(value_handle, 32);
    let value_alloc = 16;
    let bytes_shared_header = 32;
    assert!(SHORTCUT_OVERHEAD >= slot + table + key_alloc + bucket_share);
    assert!(
        VALUE_OVERHEAD
            >= slot + table + key_alloc + value_handle + value_alloc + bytes_shared_header
    );
}

#[test]
fn cache_is_send() {
    fn send<T: Send>() {}
    send::<Cache>();
}

// ----- lookup, stats, EWMA -----

#[test]
fn lookup_counts_hits_and_value_hits_carry_the_shortcut() {
    let mut c = cache(Policy::Dac, 10_000);
    assert_eq!(c.lookup(&key(1)), Lookup::Miss);
    c.on_miss_read(&key(1), sc(1, 7), val(64, 1), 3);
    assert_eq!(
        c.lookup(&key(1)),
        Lookup::Value {
            value: val(64, 1),
            shortcut: sc(1, 7)
        }
    );
    assert_eq!(c.hits(&key(1)), Some(2));
    let s = c.stats();
    assert_eq!((s.misses, s.value_hits, s.shortcut_hits), (1, 1, 0));
    assert_eq!((s.values, s.value_bytes), (1, vc(64)));
    c.check();
}

#[test]
fn rts_averages_are_ewma_from_their_initial_values() {
    let mut c = cache(Policy::Dac, 0);
    assert_eq!(c.avg_miss_rts(), INITIAL_MISS_RTS);
    assert_eq!(c.avg_shortcut_hit_rts(), INITIAL_SHORTCUT_HIT_RTS);
    c.on_miss_read(&key(1), sc(1, 1), val(1, 1), 4);
    assert!((c.avg_miss_rts() - (2.0 + RTS_EWMA_ALPHA * 2.0)).abs() < 1e-12);
    c.on_shortcut_read(&key(1), val(1, 1), 3);
    assert!((c.avg_shortcut_hit_rts() - (1.0 + RTS_EWMA_ALPHA * 2.0)).abs() < 1e-12);
    for _ in 0..500 {
        c.on_miss_read(&key(1), sc(1, 1), val(1, 1), 5);
    }
    assert!((c.avg_miss_rts() - 5.0).abs() < 1e-6);
    // Budget 0: nothing was ever cached.
    assert_eq!(c.stats().values + c.stats().shortcuts, 0);
}

// ----- DAC: BEGIN, miss, demotion, eviction -----

#[test]
fn dac_begins_with_values_then_demotes_the_lru_value_on_a_miss() {
    // Room for exactly three values; one demotion frees enough for a shortcut.
    let mut c = cache(Policy::Dac, 3 * vc(V2));
    assert!(vc(V2) - SC >= SC);
    for k in 0..3 {
        c.on_miss_read(&key(k), sc(k, 1), val(V2, k as u8), 2);
    }
    assert!((0..3).all(|k| is_value(&c, k)));
    // Key 0 becomes the most recently used; key 1 is now the LRU value.
    assert!(matches!(c.lookup(&key(0)), Lookup::Value { .. }));
    c.on_miss_read(&key(3), sc(3, 1), val(V2, 3), 2);
    // The cache was full: key 3 is cached as a shortcut, made room for by demoting key 1.
    assert!(is_shortcut(&c, 3));
    assert!(is_shortcut(&c, 1));
    assert!(is_value(&c, 0) && is_value(&c, 2));
    assert_eq!(c.peek(&key(1)), Lookup::Shortcut(sc(1, 1)));
    let s = c.stats();
    assert_eq!(
        (s.demotions, s.evictions, s.values, s.shortcuts),
        (1, 0, 2, 2)
    );
    c.check();
}

#[test]
fn dac_demotes_as_many_values_as_needed_before_evicting() {
    // Two values of 32 B with no slack; a miss needs one shortcut's room. One demotion
    // frees vc(32) - SC bytes < SC, so both values are demoted and nothing is evicted.
    let mut c = cache(Policy::Dac, 2 * vc(32));
    for k in 0..2 {
        c.on_write(&key(k), sc(k, 1), val(32, 0));
    }
    assert!(SC > vc(32) - SC && SC <= 2 * (vc(32) - SC));
    c.on_miss_read(&key(9), sc(9, 1), val(32, 0), 2);
    let s = c.stats();
    assert_eq!(
        (s.demotions, s.evictions, s.values, s.shortcuts),
        (2, 0, 0, 3)
    );
    c.check();
}

#[test]
fn dac_evicts_the_lfu_shortcut_when_no_value_is_left() {
    let mut c = dac_four_shortcuts([3, 1, 2, 4]);
    c.on_miss_read(&key(10), sc(10, 1), val(V2, 10), 2);
    assert!(!cached(&c, 1), "the LFU shortcut (count 1) is evicted");
    assert!(is_shortcut(&c, 10));
    assert_eq!(c.hits(&key(10)), Some(1));
    c.on_miss_read(&key(11), sc(11, 1), val(V2, 11), 2);
    // Key 10 (count 1) is now the LFU.
    assert!(!cached(&c, 10));
    assert!(is_shortcut(&c, 11) && is_shortcut(&c, 0) && is_shortcut(&c, 2));
    assert_eq!(c.stats().evictions, 2);
    c.check();
}

// ----- DAC: promotion (Eq. 1) -----

#[test]
fn dac_promotes_exactly_when_eq1_holds() {
    // P = key 3. Counts: A = key 0: 1, B = key 1: 2, C = key 2: 5.
    let mut c = dac_four_shortcuts([1, 2, 5, 1]);
    let v = val(V2, 3);
    // P's value costs vc(V2) = 3 SC; free 0 + P's own shortcut SC -> 2 SC more are needed:
    // N = 2 shortcuts, the LFU ones: A (1) and B (2).
    // RHS = (1 + 2) * avg_miss_rts 2.0 = 6.0; LHS = hits(P) * 1.0.
    assert_eq!(vc(V2) - SC, 2 * SC);
    // hits(P) = 1 + 4 = 5 -> 5 < 6: no promotion at any of these hits.
    shortcut_hits(&mut c, 3, 4, &v);
    assert_eq!(c.hits(&key(3)), Some(5));
    assert!(is_shortcut(&c, 3));
    assert_eq!(c.stats().promotions, 0);
    assert_eq!(c.stats().shortcuts, 4);
    // hits(P) = 6 -> 6 >= 6: promote, evicting A and B; C stays.
    shortcut_hits(&mut c, 3, 1, &v);
    assert_eq!(
        c.peek(&key(3)),
        Lookup::Value {
            value: v.clone(),
            shortcut: sc(3, 1)
        }
    );
    assert!(!cached(&c, 0) && !cached(&c, 1) && is_shortcut(&c, 2));
    assert_eq!(c.hits(&key(3)), Some(6), "the count survives promotion");
    let s = c.stats();
    assert_eq!(
        (s.promotions, s.evictions, s.values, s.shortcuts),
        (1, 2, 1, 1)
    );
    assert_eq!(s.value_bytes + s.shortcut_bytes, vc(V2) + SC);
    c.check();
}

#[test]
fn dac_promotion_uses_the_measured_shortcut_hit_rts() {
    // Same shape: A = 1, B = 2 -> RHS 6.0. P has 5 hits but its reads took 21 RTs once:
    // avg shortcut-hit RTs = 1 + 0.05 * 20 = 2.0 -> LHS = 10 >= 6.
    let mut c = dac_four_shortcuts([1, 2, 5, 1]);
    shortcut_hits(&mut c, 3, 3, &val(V2, 3));
    assert!(matches!(c.lookup(&key(3)), Lookup::Shortcut(_)));
    c.on_shortcut_read(&key(3), val(V2, 3), 21);
    assert!((c.avg_shortcut_hit_rts() - 2.0).abs() < 1e-12);
    assert!(is_value(&c, 3));
    c.check();
}

#[test]
fn dac_promotion_uses_the_measured_miss_rts() {
    let mut c = dac_four_shortcuts([1, 2, 5, 1]);
    // Misses measured at 4 RTs, of a key too long to be cached at all (its shortcut alone
    // exceeds the budget), so the cache's contents do not change.
    let long_key = vec![7u8; 4 * SC];
    for _ in 0..2000 {
        c.on_miss_read(&long_key, sc(99, 1), val(1, 0), 4);
    }
    assert!((c.avg_miss_rts() - 4.0).abs() < 1e-9);
    assert_eq!(c.stats().shortcuts, 4);
    // A = 1, B = 2 -> RHS = 3 * 4.0 = 12 (it was 6 with the initial 2.0).
    shortcut_hits(&mut c, 3, 10, &val(V2, 3));
    assert_eq!(c.hits(&key(3)), Some(11));
    assert!(is_shortcut(&c, 3), "11 < 12");
    shortcut_hits(&mut c, 3, 1, &val(V2, 3));
    assert!(is_value(&c, 3), "12 >= 12");
    c.check();
}

#[test]
fn dac_promotes_into_free_space_without_evicting() {
    // Free space (after P's shortcut bytes are released) holds P's value: N = 0.
    let mut c = dac_four_shortcuts([1; 4]);
    c.set_budget(4 * SC + (vc(V2) - SC));
    shortcut_hits(&mut c, 0, 1, &val(V2, 0));
    assert!(is_value(&c, 0));
    let s = c.stats();
    assert_eq!((s.promotions, s.evictions, s.shortcuts), (1, 0, 3));
    c.check();
}

#[test]
fn dac_does_not_promote_what_cannot_fit_even_after_evicting_every_shortcut() {
    // V is a value; P and Q are shortcuts. P's 400-byte value needs vc(400) bytes; with V
    // demoted (its shortcut stays) only 4 SC (free space + V's value bytes beyond its
    // shortcut + P's own shortcut + Q) can be had.
    let budget = vc(V2) + 2 * SC;
    let mut c = cache(Policy::Dac, budget);
    c.on_write(&key(0), sc(0, 1), val(V2, 0));
    c.on_write(&key(1), sc(1, 1), val(400, 1));
    c.on_write(&key(2), sc(2, 1), val(V2, 2));
    assert!(is_value(&c, 0) && is_shortcut(&c, 1) && is_shortcut(&c, 2));
    assert!(vc(400) > budget - SC);
    shortcut_hits(&mut c, 1, 100, &val(400, 1));
    assert!(
        is_value(&c, 0) && is_shortcut(&c, 1) && is_shortcut(&c, 2),
        "nothing demoted or evicted in vain"
    );
    let s = c.stats();
    assert_eq!((s.promotions, s.evictions, s.demotions), (0, 0, 0));
    // A value larger than the whole budget is never promoted either.
    let mut c = dac_four_shortcuts([1; 4]);
    shortcut_hits(&mut c, 0, 100, &val(4 * SC, 0));
    assert!(is_shortcut(&c, 0));
    assert_eq!(c.stats().shortcuts, 4);
    c.check();
}

/// Four shortcuts (keys 0..4, counts `counts`) and one value, key 9, written last (count 1,
/// the initial count), in a full cache: budget 4 SC + vc(V2) = 7 SC.
fn dac_four_shortcuts_and_a_value(counts: [u64; 4]) -> Cache {
    let mut c = dac_four_shortcuts(counts);
    c.set_budget(4 * SC + vc(V2));
    c.on_write(&key(9), sc(9, 1), val(V2, 9));
    assert!(is_value(&c, 9));
    assert_eq!(c.hits(&key(9)), Some(1));
    assert_eq!(
        c.stats().value_bytes + c.stats().shortcut_bytes,
        4 * SC + vc(V2)
    );
    c
}

#[test]
fn dac_promotion_demotes_a_colder_lru_value_rather_than_evicting_shortcuts() {
    // P = key 3 (count 1). Making room for P's value (3 SC; P's own shortcut gives 1 SC)
    // takes evicting two of keys 0..2 (count 5 each: penalty 2 * 5 * avg_miss_rts 2.0 = 20)
    // or demoting V = key 9 (count 1, frees 2 SC: penalty 1 * avg_shortcut_hit_rts 1.0 = 1).
    let mut c = dac_four_shortcuts_and_a_value([5, 5, 5, 1]);
    shortcut_hits(&mut c, 3, 1, &val(V2, 3));
    assert!(is_value(&c, 3), "hits(P) = 2 >= 1");
    assert!(is_shortcut(&c, 9), "V is demoted, not dropped");
    assert!((0..3).all(|k| is_shortcut(&c, k)), "no shortcut evicted");
    let s = c.stats();
    assert_eq!(
        (
            s.promotions,
            s.demotions,
            s.evictions,
            s.values,
            s.shortcuts
        ),
        (1, 4 + 1, 0, 1, 4)
    );
    assert_eq!(c.hits(&key(9)), Some(1), "the count survives demotion");
    c.check();

    // As published (Table 3), promotion only evicts shortcuts: P needs 20 hits.
    let mut c = dac_four_shortcuts_and_a_value([5, 5, 5, 1]);
    c.set_demote_to_promote(false);
    shortcut_hits(&mut c, 3, 18, &val(V2, 3));
    assert!(is_shortcut(&c, 3) && is_value(&c, 9));
    shortcut_hits(&mut c, 3, 1, &val(V2, 3));
    assert!(is_value(&c, 3) && is_value(&c, 9));
    assert!(!cached(&c, 0) && !cached(&c, 1) && is_shortcut(&c, 2));
    c.check();
}

#[test]
fn dac_promotion_keeps_a_value_hit_more_often_than_the_candidate() {
    let mut c = dac_four_shortcuts_and_a_value([9, 9, 9, 1]);
    // V = key 9 reaches count 4: demoting it costs 4 (per byte the cheapest candidate:
    // 4 / 2 SC against 9 * 2.0 / SC for a shortcut).
    for _ in 0..3 {
        assert!(matches!(c.lookup(&key(9)), Lookup::Value { .. }));
    }
    assert_eq!(c.hits(&key(9)), Some(4));
    shortcut_hits(&mut c, 3, 2, &val(V2, 3));
    assert!(is_shortcut(&c, 3) && is_value(&c, 9), "hits(P) = 3 < 4");
    assert_eq!(c.stats().promotions, 0);
    shortcut_hits(&mut c, 3, 1, &val(V2, 3));
    assert!(is_value(&c, 3) && is_shortcut(&c, 9), "hits(P) = 4 >= 4");
    assert_eq!(c.stats().evictions, 0);
    c.check();
}

#[test]
fn dac_counts_survive_promotion_and_demotion() {
    // As in dac_promotes_exactly_when_eq1_holds: P = key 3 promotes at its 6th hit.
    let mut c = dac_four_shortcuts([1, 2, 5, 1]);
    shortcut_hits(&mut c, 3, 5, &val(V2, 3));
    assert!(is_value(&c, 3));
    assert_eq!(c.hits(&key(3)), Some(6));
    assert!(matches!(c.lookup(&key(3)), Lookup::Value { .. }));
    assert_eq!(c.hits(&key(3)), Some(7));
    // A miss needs room for a shortcut: the (only) value is demoted, its count kept.
    c.on_miss_read(&key(20), sc(20, 1), val(V2, 20), 2);
    assert!(is_shortcut(&c, 3));
    assert_eq!(c.hits(&key(3)), Some(7));
    assert_eq!(c.stats().demotions, 4 + 1);
    // A write of a cached key keeps its count too.
    c.on_write(&key(3), sc(3, 2), val(V2, 33));
    assert_eq!(c.hits(&key(3)), Some(7));
    assert_eq!(c.peek(&key(3)), Lookup::Shortcut(sc(3, 2)));
    c.check();
}

#[test]
fn dac_write_caches_the_value_only_if_it_fits_in_free_space() {
    let mut c = cache(Policy::Dac, vc(64) + SC);
    c.on_write(&key(0), sc(0, 1), val(64, 0));
    assert!(is_value(&c, 0));
    // No room for another value: the write is cached as a shortcut, no demotion needed.
    c.on_write(&key(1), sc(1, 1), val(64, 1));
    assert!(is_shortcut(&c, 1) && is_value(&c, 0));
    // Rewriting key 0 releases its old value first, so the new one fits again.
    c.on_write(&key(0), sc(0, 2), val(64, 2));
    assert_eq!(
        c.peek(&key(0)),
        Lookup::Value {
            value: val(64, 2),
            shortcut: sc(0, 2)
        }
    );
    // A bigger value no longer fits: cached as a shortcut (never both).
    c.on_write(&key(0), sc(0, 3), val(65, 3));
    assert_eq!(c.peek(&key(0)), Lookup::Shortcut(sc(0, 3)));
    assert_eq!(c.stats().values, 0);
    c.check();
}

#[test]
fn invalidate_drops_either_kind() {
    let mut c = cache(Policy::Dac, vc(64) + SC);
    c.on_write(&key(0), sc(0, 1), val(64, 0));
    c.on_write(&key(1), sc(1, 1), val(64, 1));
    c.invalidate(&key(0));
    c.invalidate(&key(1));
    c.invalidate(&key(2));
    assert!(!cached(&c, 0) && !cached(&c, 1));
    let s = c.stats();
    assert_eq!(
        (
            s.values,
            s.shortcuts,
            s.value_bytes,
            s.shortcut_bytes,
            s.evictions
        ),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(c.lookup(&key(0)), Lookup::Miss);
    c.check();
}

// ----- other policies -----

#[test]
fn shortcut_only_evicts_in_lfu_order_oldest_first_and_newcomers_start_at_the_aging_base() {
    let mut c = cache(Policy::ShortcutOnly, 3 * SC);
    for k in 0..3 {
        c.on_miss_read(&key(k), sc(k, 1), val(64, 0), 2);
    }
    assert!((0..3).all(|k| is_shortcut(&c, k)));
    // Counts: 0 -> 3, 1 -> 2, 2 -> 2 (key 2 reached 2 after key 1).
    shortcut_hits(&mut c, 0, 2, &val(64, 0));
    shortcut_hits(&mut c, 1, 1, &val(64, 0));
    shortcut_hits(&mut c, 2, 1, &val(64, 0));
    assert_eq!(c.stats().promotions, 0);
    c.on_miss_read(&key(3), sc(3, 1), val(64, 0), 2);
    assert!(!cached(&c, 1), "count 2, reached first");
    // LFU-DA: the newcomer starts at the evicted count (2), behind key 2 in that bucket.
    assert_eq!(c.hits(&key(3)), Some(2));
    c.on_miss_read(&key(4), sc(4, 1), val(64, 0), 2);
    assert!(!cached(&c, 2));
    c.on_miss_read(&key(5), sc(5, 1), val(64, 0), 2);
    assert!(!cached(&c, 3));
    assert!(is_shortcut(&c, 0) && is_shortcut(&c, 4) && is_shortcut(&c, 5));
    assert_eq!(c.hits(&key(0)), Some(3));
    assert_eq!(c.hits(&key(5)), Some(2));
    assert_eq!(c.stats().evictions, 3);
    assert_eq!(c.stats().values, 0);
    // With plain counts, the same sequence keeps evicting each newcomer (count 1).
    let mut p = cache(Policy::ShortcutOnly, 3 * SC);
    p.set_count_aging(false);
    for k in 0..3 {
        p.on_miss_read(&key(k), sc(k, 1), val(64, 0), 2);
    }
    shortcut_hits(&mut p, 0, 2, &val(64, 0));
    shortcut_hits(&mut p, 1, 1, &val(64, 0));
    shortcut_hits(&mut p, 2, 1, &val(64, 0));
    for k in 3..6 {
        p.on_miss_read(&key(k), sc(k, 1), val(64, 0), 2);
    }
    assert!(is_shortcut(&p, 0) && is_shortcut(&p, 2) && is_shortcut(&p, 5));
    c.check();
    p.check();
}

#[test]
fn value_only_evicts_in_lru_order() {
    let mut c = cache(Policy::ValueOnly, 3 * vc(64));
    for k in 0..3 {
        c.on_miss_read(&key(k), sc(k, 1), val(64, k as u8), 2);
    }
    assert!(matches!(c.lookup(&key(0)), Lookup::Value { .. }));
    c.on_miss_read(&key(3), sc(3, 1), val(64, 3), 2);
    assert!(!cached(&c, 1));
    c.on_write(&key(4), sc(4, 1), val(64, 4));
    assert!(!cached(&c, 2));
    assert!(is_value(&c, 0) && is_value(&c, 3) && is_value(&c, 4));
    // A value larger than the budget is not cached, and evicts nothing.
    c.on_miss_read(&key(5), sc(5, 1), val(1000, 5), 2);
    assert!(!cached(&c, 5));
    let s = c.stats();
    assert_eq!(
        (s.evictions, s.values, s.shortcuts, s.demotions),
        (2, 3, 0, 0)
    );
    c.check();
}

#[test]
fn static_split_demotes_lru_values_into_the_shortcut_area() {
    // Value area: 2 values of 64 B; shortcut area: 2 shortcuts. 50/50 by construction.
    let half = 2 * vc(64);
    assert!(2 * SC <= half);
    let mut c = cache(Policy::Static { value_percent: 50 }, 2 * half);
    for k in 0..2 {
        c.on_miss_read(&key(k), sc(k, 1), val(64, k as u8), 2);
    }
    assert!(is_value(&c, 0) && is_value(&c, 1));
    c.on_miss_read(&key(2), sc(2, 1), val(64, 2), 2);
    assert!(
        is_shortcut(&c, 0),
        "the LRU value moves to the shortcut area"
    );
    assert!(is_value(&c, 1) && is_value(&c, 2));
    // A shortcut hit moves the key back to the value area (demoting the LRU value, key 1).
    shortcut_hits(&mut c, 0, 1, &val(64, 0));
    assert!(is_value(&c, 0) && is_shortcut(&c, 1) && is_value(&c, 2));
    assert_eq!(c.hits(&key(0)), Some(2));
    // A value larger than the value area is cached as a shortcut.
    c.on_miss_read(&key(3), sc(3, 1), val(half, 3), 2);
    assert!(is_shortcut(&c, 3));
    let s = c.stats();
    assert_eq!((s.values, s.shortcuts, s.promotions), (2, 2, 1));
    assert!(s.value_bytes <= half && s.shortcut_bytes <= half);
    c.check();
}

#[test]
fn static_extremes_behave_like_the_pure_policies() {
    let mut s0 = cache(Policy::Static { value_percent: 0 }, 3 * SC);
    let mut s100 = cache(Policy::Static { value_percent: 100 }, 3 * vc(64));
    for k in 0..10 {
        s0.on_miss_read(&key(k), sc(k, 1), val(64, 0), 2);
        s100.on_miss_read(&key(k), sc(k, 1), val(64, 0), 2);
    }
    assert_eq!((s0.stats().values, s0.stats().shortcuts), (0, 3));
    assert_eq!((s100.stats().values, s100.stats().shortcuts), (3, 0));
    s0.check();
    s100.check();
}

#[test]
fn set_budget_shrinks_per_policy_and_grows() {
    // DAC: values are demoted first, then LFU shortcuts evicted.
    let mut c = cache(Policy::Dac, 3 * vc(64));
    for k in 0..3 {
        c.on_write(&key(k), sc(k, 1), val(64, 0));
    }
    c.set_budget(3 * SC);
    assert_eq!((c.stats().values, c.stats().shortcuts), (0, 3));
    c.set_budget(2 * SC);
    assert_eq!((c.stats().shortcuts, c.stats().evictions), (2, 1));
    c.check();
    c.set_budget(0);
    assert_eq!(c.stats().shortcuts, 0);
    c.check();
    // Growing: the next miss caches a value again (BEGIN).
    c.set_budget(10 * vc(64));
    c.on_miss_read(&key(7), sc(7, 1), val(64, 0), 2);
    assert!(is_value(&c, 7));
    c.check();

    // Value-only: LRU values evicted.
    let mut c = cache(Policy::ValueOnly, 3 * vc(64));
    for k in 0..3 {
        c.on_write(&key(k), sc(k, 1), val(64, 0));
    }
    assert!(matches!(c.lookup(&key(0)), Lookup::Value { .. }));
    c.set_budget(vc(64));
    assert!(is_value(&c, 0) && !cached(&c, 1) && !cached(&c, 2));
    c.check();

    // Shortcut-only: LFU shortcuts evicted.
    let mut c = cache(Policy::ShortcutOnly, 3 * SC);
    for k in 0..3 {
        c.on_write(&key(k), sc(k, 1), val(64, 0));
    }
    shortcut_hits(&mut c, 0, 1, &val(64, 0));
    c.set_budget(SC);
    assert!(is_shortcut(&c, 0) && c.stats().shortcuts == 1);
    c.check();

    // Static: both areas shrink; values demote into the (new) shortcut area.
    let mut c = cache(Policy::Static { value_percent: 50 }, 4 * vc(64));
    for k in 0..2 {
        c.on_write(&key(k), sc(k, 1), val(64, 0));
    }
    c.set_budget(2 * vc(64));
    assert_eq!(
        (c.stats().values, c.stats().shortcuts, c.stats().demotions),
        (1, 1, 1)
    );
    c.check();
}

// ----- property test against a model of the truth -----

#[derive(Debug, Clone)]
enum Op {
    /// A client read: lookup, then the follow-up call the KN would make.
    Read(u8, u32),
    /// The KN wrote a new version of the key.
    Write(u8, usize),
    Delete(u8),
    /// The entry moved (cleaner); the KN found the shortcut stale.
    Move(u8),
    /// on_miss_read for a key whatever its state (re-reading a cached key).
    Refresh(u8, u32),
    /// on_shortcut_read without a preceding shortcut hit (must not invent entries).
    StrayShortcutRead(u8),
    SetBudget(usize),
}

const KEYS: u8 = 12;

/// Keys of different lengths so that costs differ per key.
fn pkey(k: u8) -> Vec<u8> {
    vec![k; 1 + (k as usize * 7) % 23]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..KEYS, 1..6u32).prop_map(|(k, r)| Op::Read(k, r)),
        3 => (0..KEYS, 0..300usize).prop_map(|(k, l)| Op::Write(k, l)),
        1 => (0..KEYS).prop_map(Op::Delete),
        1 => (0..KEYS).prop_map(Op::Move),
        1 => (0..KEYS, 1..6u32).prop_map(|(k, r)| Op::Refresh(k, r)),
        1 => (0..KEYS).prop_map(Op::StrayShortcutRead),
        1 => prop_oneof![Just(0usize), Just(150), Just(400), 0..3000usize, Just(20_000)]
            .prop_map(Op::SetBudget),
    ]
}

fn any_policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Dac),
        Just(Policy::ShortcutOnly),
        Just(Policy::ValueOnly),
        (0..=100u8).prop_map(|value_percent| Policy::Static { value_percent }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn cache_never_returns_stale_or_foreign_entries(
        policy in any_policy(),
        budget in 0..4000usize,
        ops in prop::collection::vec(op(), 1..300),
    ) {
        let mut c = cache(policy, budget);
        let mut budget = budget;
        // The truth: the key's latest value and where it lies.
        let mut truth: HashMap<u8, (Bytes, Shortcut)> = HashMap::new();
        let mut next_offset = 4096u64;
        let mut place = |len: usize| {
            let p = EntryPtr::new(next_offset, len + 64);
            next_offset += 8 * (1 + len as u64 / 8) + 64;
            p
        };
        let mut version = 0u64;
        let mut lookups = 0u64;
        for op in ops {
            match op {
                Op::Read(k, rts) => {
                    lookups += 1;
                    let got = c.lookup(&pkey(k));
                    match (&got, truth.get(&k)) {
                        (Lookup::Value { value, shortcut }, Some((v, s))) => {
                            prop_assert_eq!(value, v);
                            prop_assert_eq!(shortcut, s);
                        }
                        (Lookup::Shortcut(shortcut), Some((v, s))) => {
                            prop_assert_eq!(shortcut, s);
                            c.on_shortcut_read(&pkey(k), v.clone(), rts);
                        }
                        (Lookup::Miss, Some((v, s))) => {
                            c.on_miss_read(&pkey(k), *s, v.clone(), rts);
                        }
                        (Lookup::Miss, None) => {}
                        (hit, None) => prop_assert!(false, "hit {:?} for absent key {}", hit, k),
                    }
                }
                Op::Write(k, len) => {
                    version += 1;
                    let mut v = vec![k; len];
                    if let Some(b) = v.first_mut() {
                        *b = version as u8;
                    }
                    let s = Shortcut { ptr: place(len), version };
                    truth.insert(k, (Bytes::from(v.clone()), s));
                    c.on_write(&pkey(k), s, Bytes::from(v));
                }
                Op::Delete(k) => {
                    truth.remove(&k);
                    c.invalidate(&pkey(k));
                }
                Op::Move(k) => {
                    if let Some((v, s)) = truth.get_mut(&k) {
                        s.ptr = place(v.len());
                    }
                    c.invalidate(&pkey(k));
                }
                Op::Refresh(k, rts) => {
                    if let Some((v, s)) = truth.get(&k) {
                        c.on_miss_read(&pkey(k), *s, v.clone(), rts);
                    }
                }
                Op::StrayShortcutRead(k) => {
                    if let Some((v, _)) = truth.get(&k) {
                        c.on_shortcut_read(&pkey(k), v.clone(), 1);
                    }
                }
                Op::SetBudget(b) => {
                    budget = b;
                    c.set_budget(b);
                }
            }
            c.check();
            let s = c.stats();
            prop_assert!(s.value_bytes + s.shortcut_bytes <= budget);
            prop_assert_eq!(s.value_hits + s.shortcut_hits + s.misses, lookups);
            let (mut nv, mut ns, mut vb, mut sb) = (0, 0, 0, 0);
            for k in 0..KEYS {
                let key = pkey(k);
                match (c.peek(&key), truth.get(&k)) {
                    (Lookup::Miss, _) => {}
                    (Lookup::Value { value, shortcut }, Some((v, sc))) => {
                        prop_assert_eq!(&value, v);
                        prop_assert_eq!(&shortcut, sc);
                        nv += 1;
                        vb += key.len() + value.len() + VALUE_OVERHEAD;
                    }
                    (Lookup::Shortcut(shortcut), Some((_, sc))) => {
                        prop_assert_eq!(&shortcut, sc);
                        ns += 1;
                        sb += key.len() + SHORTCUT_OVERHEAD;
                    }
                    (hit, None) => prop_assert!(false, "{:?} cached for absent key {}", hit, k),
                }
            }
            prop_assert_eq!((nv, ns, vb, sb), (s.values, s.shortcuts, s.value_bytes, s.shortcut_bytes));
            match policy {
                Policy::ShortcutOnly => prop_assert_eq!(s.values, 0),
                Policy::ValueOnly => prop_assert_eq!(s.shortcuts, 0),
                _ => {}
            }
        }
    }
}

/// Everything a caller or a later decision of the cache can see: each key's entry and count,
/// the counters, the LRU order of values and the LFU order of shortcuts.
fn snapshot(c: &Cache) -> String {
    let keys = |it: &mut dyn Iterator<Item = u32>| -> Vec<Vec<u8>> {
        it.map(|i| c.store.slot(i).key.to_vec()).collect()
    };
    let entries: Vec<_> = (0..KEYS)
        .map(|k| {
            let key = pkey(k);
            let hits = c.store.find(&key).map(|i| c.store.slot(i).hits);
            (format!("{:?}", c.peek(&key)), hits)
        })
        .collect();
    format!(
        "{entries:?}\n{:?}\nlru {:?}\nlfu {:?}",
        c.stats(),
        keys(&mut c.store.lru_iter()),
        keys(&mut c.store.lfu_iter())
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The in-place write path (DAC's) leaves the cache exactly as taking the key out and
    /// placing it again did, for any sequence of operations.
    #[test]
    fn a_write_in_place_is_the_same_as_replacing_the_entry(
        budget in 0..4000usize,
        ops in prop::collection::vec(op(), 1..300),
    ) {
        let policy = Policy::Dac;
        let mut in_place = cache(policy, budget);
        let mut replaced = cache(policy, budget);
        for (version, op) in (0u64..).zip(ops) {
            for (c, by_replacing) in [(&mut in_place, false), (&mut replaced, true)] {
                match &op {
                    Op::Read(k, rts) => match c.lookup(&pkey(*k)) {
                        Lookup::Shortcut(_) => c.on_shortcut_read(&pkey(*k), val(10, *k), *rts),
                        Lookup::Miss => c.on_miss_read(&pkey(*k), sc(u64::from(*k), version), val(10, *k), *rts),
                        Lookup::Value { .. } => {}
                    },
                    Op::Write(k, len) => {
                        let s = sc(u64::from(*k), version + 1);
                        if by_replacing {
                            c.on_write_by_replacing(&pkey(*k), s, val(*len, *k));
                        } else {
                            c.on_write(&pkey(*k), s, val(*len, *k));
                        }
                    }
                    Op::Delete(k) | Op::Move(k) => c.invalidate(&pkey(*k)),
                    Op::Refresh(k, rts) => c.on_miss_read(&pkey(*k), sc(u64::from(*k), version), val(10, *k), *rts),
                    Op::StrayShortcutRead(k) => c.on_shortcut_read(&pkey(*k), val(10, *k), 1),
                    Op::SetBudget(b) => c.set_budget(*b),
                }
                c.check();
            }
            prop_assert_eq!(snapshot(&in_place), snapshot(&replaced), "after {:?}", op);
        }
    }
}

/// The two cases of a write in place the random sequences may rarely reach: a cached shortcut
/// written with a value that now fits becomes a value with its count kept, and the only key
/// of the cache is rewritten (the old path emptied the store and built it again).
#[test]
fn a_cached_shortcut_or_the_only_key_written_in_place() {
    let twins = || {
        (
            cache(Policy::Dac, vc(100) + SC),
            cache(Policy::Dac, vc(100) + SC),
        )
    };
    let (mut a, mut b) = twins();
    for c in [&mut a, &mut b] {
        c.on_write(&key(2), sc(2, 1), val(100, 2));
        c.on_miss_read(&key(1), sc(1, 1), val(100, 1), 2);
        assert!(is_shortcut(c, 1) && is_value(c, 2));
        for _ in 0..3 {
            // Counted hits, without the read that could promote it.
            assert!(matches!(c.lookup(&key(1)), Lookup::Shortcut(_)));
        }
        c.invalidate(&key(2));
    }
    let hits = |c: &Cache| c.store.slot(c.store.find(&key(1)).unwrap()).hits;
    let before = hits(&a);
    a.on_write(&key(1), sc(1, 2), val(50, 1));
    b.on_write_by_replacing(&key(1), sc(1, 2), val(50, 1));
    assert!(is_value(&a, 1), "{}", snapshot(&a));
    assert_eq!(hits(&a), before);
    assert_eq!(snapshot(&a), snapshot(&b));
    a.check();

    let (mut a, mut b) = twins();
    for c in [&mut a, &mut b] {
        c.on_write(&key(1), sc(1, 1), val(100, 1));
    }
    a.on_write(&key(1), sc(1, 2), val(80, 1));
    b.on_write_by_replacing(&key(1), sc(1, 2), val(80, 1));
    assert_eq!(snapshot(&a), snapshot(&b));
    a.check();
    assert!(matches!(a.peek(&key(1)), Lookup::Value { value, .. } if value.len() == 80));
}

/// A write's value is a buffer of its own and is kept as it is (no second copy); a value READ
/// from the DPM is a view into the READ's buffer and is copied, so the cache never keeps that
/// larger buffer alive.
#[test]
fn a_written_value_is_kept_as_is_and_a_read_one_is_copied() {
    for policy in [Policy::Dac, Policy::ValueOnly] {
        let mut c = cache(policy, 1 << 20);
        let written = val(100, 1);
        c.on_write(&key(1), sc(1, 1), written.clone());
        let Lookup::Value { value, .. } = c.peek(&key(1)) else {
            panic!("{policy:?}: the written value is not cached");
        };
        assert_eq!(value.as_ptr(), written.as_ptr(), "{policy:?}: copied");

        let read_buffer = val(4096, 2);
        let read = read_buffer.slice(64..164);
        c.on_miss_read(&key(2), sc(2, 1), read.clone(), 2);
        let Lookup::Value { value, .. } = c.peek(&key(2)) else {
            panic!("{policy:?}: the read value is not cached");
        };
        assert_eq!(value, read);
        assert_ne!(value.as_ptr(), read.as_ptr(), "{policy:?}: a view kept");
    }
}
