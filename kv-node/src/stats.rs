//! Per-shard statistics: operation and hit counters (shared atomics, read by the Stats RPC and
//! /metrics), busy time for occupancy, and a bounded-memory top-K of key access frequencies
//! (Space-Saving: at most `capacity` counters; a new key replaces the smallest counter and
//! inherits its count, so counts over-estimate by at most that count).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bytes::Bytes;
use hashbrown::HashMap;

#[derive(Debug, Default)]
pub struct ShardStats {
    pub gets: AtomicU64,
    pub puts: AtomicU64,
    pub deletes: AtomicU64,
    pub value_hits: AtomicU64,
    pub shortcut_hits: AtomicU64,
    pub unmerged_hits: AtomicU64,
    pub misses: AtomicU64,
    pub batches: AtomicU64,
    pub busy_ns: AtomicU64,
    pub stale_shortcuts: AtomicU64,
    /// Requests for replicated keys (served through their indirect cells).
    pub cell_ops: AtomicU64,
}

impl ShardStats {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }
}

/// Space-Saving heavy hitters.
#[derive(Debug)]
pub struct TopK {
    capacity: usize,
    counts: HashMap<Bytes, u64>,
}

impl TopK {
    pub fn new(capacity: usize) -> Self {
        TopK {
            capacity: capacity.max(1),
            counts: HashMap::new(),
        }
    }

    pub fn record(&mut self, key: &[u8]) {
        if let Some(c) = self.counts.get_mut(key) {
            *c += 1;
            return;
        }
        if self.counts.len() < self.capacity {
            self.counts.insert(Bytes::copy_from_slice(key), 1);
            return;
        }
        // Replace the smallest counter. O(capacity), with a small capacity (128) this is cheap
        // next to a network operation; only keys outside the top set pay it.
        let (victim, min) = self
            .counts
            .iter()
            .min_by_key(|(_, c)| **c)
            .map(|(k, c)| (k.clone(), *c))
            .expect("full");
        self.counts.remove(&victim);
        self.counts.insert(Bytes::copy_from_slice(key), min + 1);
    }

    /// The `n` most frequent keys, most frequent first.
    pub fn top(&self, n: usize) -> Vec<(Bytes, u64)> {
        let mut v: Vec<_> = self.counts.iter().map(|(k, c)| (k.clone(), *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }

    /// Halves every count (called each epoch so the ranking follows the current workload).
    pub fn decay(&mut self) {
        self.counts.retain(|_, c| {
            *c /= 2;
            *c > 0
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_hitters_are_found_in_bounded_memory() {
        let mut t = TopK::new(16);
        for i in 0..10_000u32 {
            t.record(format!("cold{i}").as_bytes());
            if i % 4 == 0 {
                t.record(b"hot");
            }
        }
        let top = t.top(1);
        assert_eq!(&top[0].0[..], b"hot");
        assert!(t.counts.len() <= 16);
        t.decay();
        assert!(t.top(1)[0].1 >= 1000);
    }
}
