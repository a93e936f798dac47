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
    /// Keys that had the smallest count, `min`, when the counters were last scanned: the next
    /// victims. Counts only grow between decays, so a key still at `min` is still a smallest
    /// counter; one that grew is skipped. Under a skewed workload most keys outside the top set
    /// sit at the same smallest count, so one O(capacity) scan serves many replacements (a scan
    /// per replacement was measured at up to 3 % of a KV node's CPU).
    victims: Vec<Bytes>,
    min: u64,
}

impl TopK {
    pub fn new(capacity: usize) -> Self {
        TopK {
            capacity: capacity.max(1),
            counts: HashMap::new(),
            victims: Vec::new(),
            min: 0,
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
        // Replace a smallest counter; the new key inherits its count.
        let (victim, min) = loop {
            match self.victims.pop() {
                Some(v) if self.counts.get(&v) == Some(&self.min) => break (v, self.min),
                Some(_) => continue,
                None => self.scan_victims(),
            }
        };
        self.counts.remove(&victim);
        self.counts.insert(Bytes::copy_from_slice(key), min + 1);
    }

    /// Finds every key with the smallest count (the table is full, so there is one).
    fn scan_victims(&mut self) {
        self.min = self.counts.values().copied().min().expect("full");
        let min = self.min;
        self.victims = self
            .counts
            .iter()
            .filter(|(_, c)| **c == min)
            .map(|(k, _)| k.clone())
            .collect();
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
        self.victims.clear();
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

    /// The Space-Saving guarantees hold with the victim list: counters sum to the stream's
    /// length, never under-estimate a tracked key, and over-estimate by at most N / capacity.
    #[test]
    fn counts_keep_the_space_saving_bounds() {
        let mut t = TopK::new(32);
        let mut truth: std::collections::HashMap<Vec<u8>, u64> = Default::default();
        let mut x = 12345u64;
        const N: u64 = 50_000;
        for _ in 0..N {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Skewed: key i with probability about 1/(i+1).
            let k = (x % 1000).pow(2) / 1000;
            let key = format!("k{k}").into_bytes();
            t.record(&key);
            *truth.entry(key).or_default() += 1;
        }
        assert_eq!(t.counts.values().sum::<u64>(), N);
        for (k, c) in &t.counts {
            let real = truth[&k[..]];
            assert!(*c >= real, "{k:?}: counted {c} < real {real}");
            assert!(*c - real <= N / 32, "{k:?}: over-estimate {}", c - real);
        }
    }
}
