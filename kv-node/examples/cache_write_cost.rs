//! What a KN's cache spends on a write of a cached key (`Cache::on_write` under DAC, 16-byte
//! keys, 1,000-byte values, every key cached as a value): N writes after a warm-up, in the
//! function `measured`, for an instruction count that does not depend on the machine's load:
//!
//! ```text
//! cargo build --release -p dinomo-kv-node --example cache_write_cost
//! valgrind --tool=callgrind --toggle-collect='*measured*' \
//!     target/release/examples/cache_write_cost 100000
//! ```
//!
//! Divide the `Collected` count by N. It prints the cache's counters, so two builds can be
//! checked to have done the same.
use bytes::Bytes;
use dinomo_kv_node::cache::{Cache, CacheConfig, Policy, Shortcut};
use dinomo_layout::index::EntryPtr;

#[inline(never)]
fn writes(c: &mut Cache, keys: &[Vec<u8>], values: &[Bytes], n: usize) {
    let mut x: u64 = 88172645463325252;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = (x % keys.len() as u64) as usize;
        let s = Shortcut {
            ptr: EntryPtr::new(4096 * (i as u64 + 1), 1024 + 64),
            version: i as u64,
        };
        c.on_write(&keys[k], s, values[i % values.len()].clone());
    }
}

fn main() {
    let keys: Vec<Vec<u8>> = (0..10_000u64)
        .map(|i| format!("user{i:012}").into_bytes())
        .collect();
    let values: Vec<Bytes> = (0..64u8).map(|i| Bytes::from(vec![i; 1000])).collect();
    let mut c = Cache::new(CacheConfig {
        budget_bytes: 64 << 20,
        policy: Policy::Dac,
    });
    for (i, k) in keys.iter().enumerate() {
        // Warm: every key cached once, so each measured write finds its key.
        let s = Shortcut {
            ptr: EntryPtr::new(4096, 1024 + 64),
            version: 0,
        };
        c.on_write(k, s, values[i % values.len()].clone());
    }
    let n: usize = std::env::args()
        .nth(1)
        .map_or(100_000, |a| a.parse().unwrap());
    measured(&mut c, &keys, &values, n);
    println!("{:?}", c.stats());
}

#[inline(never)]
fn measured(c: &mut Cache, keys: &[Vec<u8>], values: &[Bytes], n: usize) {
    writes(c, keys, values, n);
}
