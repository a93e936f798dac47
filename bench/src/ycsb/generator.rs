//! Key-number generators: zipfian (any skew), latest, uniform, and the growing key space.
//!
//! Every generator draws a *key number* in `0..n`, where `n` is the number of keys whose insert
//! has been acknowledged (see [`KeySpace`]); the number becomes a key name in
//! [`super::workload::KeyFormat`].
//!
//! # Zipfian
//!
//! [`Zipfian`] draws a *rank* `r` in `0..n` with `P(r) = (r + 1)^-theta / zeta(n, theta)`,
//! where `zeta(n, theta) = sum_{i=1..n} i^-theta`:
//!
//! - `theta < 1` (including `theta = 0`, which is uniform): the method of Gray et al.
//!   ("Quickly generating billion-record synthetic databases", SIGMOD 1994), the one YCSB's
//!   `ZipfianGenerator` uses. Ranks 0 and 1 are exact; the rest come from inverting a
//!   continuous approximation. It needs `zeta(n, theta)`, which is computed once and then
//!   *incrementally* (only the new terms are added) as inserts grow `n`.
//! - `theta >= 1`: Gray's inversion divides by `1 - theta` and its continuous approximation
//!   degrades past 1, so these skews use rejection-inversion sampling (Hörmann and Derflinger,
//!   "Rejection-inversion to generate variates from monotone discrete distributions", 1996),
//!   which is exact for every positive skew and needs no zeta at all: growing `n` is O(1).
//!
//! Rank 0 is the hottest. [`KeyChooser::Zipfian`] scrambles ranks into key numbers (so hot keys
//! are scattered over the key space, not clustered at its start), as YCSB's
//! `ScrambledZipfianGenerator` does, with a 64-bit FNV-1a hash of the rank taken modulo the
//! number of *loaded* keys. Ranks past the loaded keys (keys inserted during the run, the
//! coldest ones) map to themselves, so the hot set stays put while the key space grows — a
//! modulo over the growing count would move every hot key on each insert.
//!
//! # Latest
//!
//! YCSB's `SkewedLatestGenerator`: a zipfian rank counted back from the newest acknowledged key,
//! so recent inserts are the hottest.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rand::Rng;

/// `sum + sum_{i=from+1..=to} i^-theta`, adding the terms in order, so growing a zeta step by
/// step gives bit for bit the value computed in one go.
fn add_zeta_terms(sum: f64, from: u64, to: u64, theta: f64) -> f64 {
    (from + 1..=to).fold(sum, |acc, i| acc + (i as f64).powf(-theta))
}

/// `zeta(n, theta) = sum_{i=1..=n} i^-theta` (exposed for tests and reports).
pub fn zeta(n: u64, theta: f64) -> f64 {
    add_zeta_terms(0.0, 0, n, theta)
}

/// Gray et al.'s generator (theta < 1), with `zeta(n)` kept up to date incrementally.
#[derive(Debug, Clone)]
struct Gray {
    theta: f64,
    n: u64,
    zetan: f64,
    zeta2: f64,
    alpha: f64,
    eta: f64,
}

impl Gray {
    fn new(theta: f64, n: u64) -> Self {
        let mut g = Gray {
            theta,
            n: 0,
            zetan: 0.0,
            zeta2: zeta(2, theta),
            alpha: 1.0 / (1.0 - theta),
            eta: 0.0,
        };
        g.resize(n);
        g
    }

    fn resize(&mut self, n: u64) {
        if n == self.n {
            return;
        }
        if n > self.n {
            self.zetan = add_zeta_terms(self.zetan, self.n, n, self.theta);
        } else {
            // Key spaces only grow in a run; a smaller count is recomputed from scratch rather
            // than by subtraction, which would accumulate rounding error.
            self.zetan = zeta(n, self.theta);
        }
        self.n = n;
        // eta is only used for ranks >= 2, i.e. when n > 2 (for n = 2 its formula is 0/0).
        self.eta = if n > 2 {
            (1.0 - (2.0 / n as f64).powf(1.0 - self.theta)) / (1.0 - self.zeta2 / self.zetan)
        } else {
            0.0
        };
    }

    fn sample(&self, rng: &mut impl Rng) -> u64 {
        let u: f64 = rng.random();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1.min(self.n - 1);
        }
        let r = self.n as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha);
        (r as u64).min(self.n - 1)
    }
}

/// `ln(1 + x) / x`, accurate near 0.
fn ln1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, accurate near 0.
fn expm1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

/// Rejection-inversion sampling of ranks `1..=n` with weights `k^-s` (any `s > 0`).
///
/// The hat is the continuous density `h(x) = x^-s` on `[1.5, n + 0.5]` plus a unit-area block
/// for rank 1; a uniform point of the hat's integral is inverted to `x`, rounded to `k`, and
/// accepted when it falls in the sub-interval of length `h(k)` that belongs to `k` (the
/// `k - x <= squeeze` test accepts most draws without evaluating `H`).
#[derive(Debug, Clone)]
struct RejectionInversion {
    s: f64,
    n: u64,
    h_integral_x1: f64,
    h_integral_n: f64,
    squeeze: f64,
}

impl RejectionInversion {
    fn new(s: f64, n: u64) -> Self {
        let mut r = RejectionInversion {
            s,
            n: 0,
            h_integral_x1: 0.0,
            h_integral_n: 0.0,
            squeeze: 0.0,
        };
        r.h_integral_x1 = r.big_h(1.5) - 1.0;
        r.squeeze = 2.0 - r.big_h_inv(r.big_h(2.5) - r.h(2.0));
        r.resize(n);
        r
    }

    fn resize(&mut self, n: u64) {
        self.n = n;
        self.h_integral_n = self.big_h(n as f64 + 0.5);
    }

    /// `h(x) = x^-s`.
    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// An antiderivative of `h`: `(x^(1-s) - 1) / (1 - s)`, or `ln x` when `s = 1`.
    fn big_h(&self, x: f64) -> f64 {
        let lx = x.ln();
        expm1_over_x((1.0 - self.s) * lx) * lx
    }

    /// The inverse of [`Self::big_h`].
    fn big_h_inv(&self, y: f64) -> f64 {
        // Rounding can push the argument of ln(1 + t) just below -1 when s > 1.
        let t = (y * (1.0 - self.s)).max(-1.0);
        (ln1p_over_x(t) * y).exp()
    }

    /// A rank in `1..=n`.
    fn sample(&self, rng: &mut impl Rng) -> u64 {
        loop {
            let r: f64 = rng.random();
            let u = self.h_integral_n + r * (self.h_integral_x1 - self.h_integral_n);
            let x = self.big_h_inv(u);
            let k = ((x + 0.5).floor() as u64).clamp(1, self.n);
            let kf = k as f64;
            if kf - x <= self.squeeze || u >= self.big_h(kf + 0.5) - self.h(kf) {
                return k;
            }
        }
    }
}

#[derive(Debug, Clone)]
enum ZipfImpl {
    Gray(Gray),
    RejectionInversion(RejectionInversion),
}

/// Zipfian ranks `0..n` (0 = hottest) for any skew `theta >= 0`, over a count that can grow.
#[derive(Debug, Clone)]
pub struct Zipfian {
    n: u64,
    imp: ZipfImpl,
}

impl Zipfian {
    /// A generator over `n` items (`n >= 1`). For `theta < 1` this computes `zeta(n, theta)`:
    /// O(n) once; clone the result rather than building one per client.
    pub fn new(theta: f64, n: u64) -> Self {
        assert!(
            theta.is_finite() && theta >= 0.0,
            "zipfian theta must be >= 0, got {theta}"
        );
        let n = n.max(1);
        let imp = if theta < 1.0 {
            ZipfImpl::Gray(Gray::new(theta, n))
        } else {
            ZipfImpl::RejectionInversion(RejectionInversion::new(theta, n))
        };
        Zipfian { n, imp }
    }

    /// The current item count.
    pub fn items(&self) -> u64 {
        self.n
    }

    /// Changes the item count (growing adds only the new zeta terms).
    pub fn resize(&mut self, n: u64) {
        let n = n.max(1);
        if n == self.n {
            return;
        }
        self.n = n;
        match &mut self.imp {
            ZipfImpl::Gray(g) => g.resize(n),
            ZipfImpl::RejectionInversion(r) => r.resize(n),
        }
    }

    /// A rank in `0..n` over the current count.
    pub fn sample(&self, rng: &mut impl Rng) -> u64 {
        match &self.imp {
            ZipfImpl::Gray(g) => g.sample(rng),
            ZipfImpl::RejectionInversion(r) => r.sample(rng) - 1,
        }
    }

    /// Grows (or shrinks) to `n` items, then samples.
    pub fn sample_n(&mut self, rng: &mut impl Rng, n: u64) -> u64 {
        self.resize(n);
        self.sample(rng)
    }
}

/// 64-bit FNV-1a over the little-endian bytes of `x` (YCSB scrambles ranks with FNV too).
pub fn fnv1a64(x: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in x.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// How read (and update) key numbers are chosen.
#[derive(Debug, Clone)]
pub enum KeyChooser {
    /// Uniform over the acknowledged keys.
    Uniform,
    /// Scrambled zipfian: hot ranks spread over the `loaded` keys (see the module doc).
    Zipfian { zipf: Zipfian, loaded: u64 },
    /// Newest keys hottest (zipfian distance back from the newest acknowledged key).
    Latest { zipf: Zipfian },
    /// Key 0, 1, 2, ... in turn, shared by every client (clones share the counter).
    Sequential { next: std::sync::Arc<AtomicU64> },
}

impl KeyChooser {
    /// A key number in `0..n` (`n >= 1` acknowledged keys).
    pub fn next(&mut self, rng: &mut impl Rng, n: u64) -> u64 {
        let n = n.max(1);
        match self {
            KeyChooser::Uniform => rng.random_range(0..n),
            KeyChooser::Zipfian { zipf, loaded } => {
                let rank = zipf.sample_n(rng, n);
                let base = (*loaded).min(n);
                if rank < base {
                    fnv1a64(rank) % base
                } else {
                    rank
                }
            }
            KeyChooser::Latest { zipf } => n - 1 - zipf.sample_n(rng, n),
            KeyChooser::Sequential { next } => next.fetch_add(1, Ordering::Relaxed) % n,
        }
    }
}

/// The key numbers of a run: `0..limit` are acknowledged (safe to read); inserts take the next
/// number from a shared sequence.
///
/// Inserts complete out of order, so `limit` only advances over a contiguous prefix of
/// completed inserts (YCSB's acknowledged counter): readers never pick a key whose insert may
/// still be in flight. A failed insert still counts as completed, so one error cannot stall
/// the key space; reading that key later shows up as a not-found read.
#[derive(Debug)]
pub struct KeySpace {
    next: AtomicU64,
    limit: AtomicU64,
    done: Mutex<BTreeSet<u64>>,
}

impl KeySpace {
    /// `acknowledged` keys exist; the next insert takes number `acknowledged`.
    pub fn new(acknowledged: u64) -> Self {
        Self::with_next(acknowledged, acknowledged)
    }

    /// Keys `0..acknowledged` are readable; inserts start at `next_insert` (>= acknowledged).
    pub fn with_next(acknowledged: u64, next_insert: u64) -> Self {
        KeySpace {
            next: AtomicU64::new(next_insert.max(acknowledged)),
            limit: AtomicU64::new(acknowledged),
            done: Mutex::new(BTreeSet::new()),
        }
    }

    /// Number of keys safe to read (`0..limit`).
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// The key number the next insert should use.
    pub fn next_insert(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The next number [`Self::next_insert`] would hand out.
    pub fn peek_next_insert(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    /// Records that the insert of `keynum` finished (successfully or not).
    pub fn complete(&self, keynum: u64) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let mut limit = self.limit.load(Ordering::Acquire);
        if keynum < limit {
            return;
        }
        done.insert(keynum);
        while done.remove(&limit) {
            limit += 1;
        }
        self.limit.store(limit, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    const DRAWS: usize = 200_000;

    fn counts(theta: f64, n: u64, seed: u64) -> Vec<u64> {
        let z = Zipfian::new(theta, n);
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut c = vec![0u64; n as usize];
        for _ in 0..DRAWS {
            let r = z.sample(&mut rng);
            assert!(r < n, "rank {r} out of 0..{n}");
            c[r as usize] += 1;
        }
        c
    }

    #[test]
    fn theta_zero_is_uniform() {
        let n = 100;
        let c = counts(0.0, n, 7);
        let expected = DRAWS as f64 / n as f64; // 2000 per item, sd ~ 44
        for (i, &k) in c.iter().enumerate() {
            assert!(
                (k as f64 - expected).abs() < 0.15 * expected,
                "item {i}: {k} draws, expected ~{expected}"
            );
        }
    }

    #[test]
    fn theta_099_top_item_share_matches_zeta() {
        let n = 1000;
        let c = counts(0.99, n, 42);
        let expect = |rank: u64| ((rank + 1) as f64).powf(-0.99) / zeta(n, 0.99);
        // Gray's method is exact for ranks 0 and 1 ...
        for rank in [0u64, 1] {
            let share = c[rank as usize] as f64 / DRAWS as f64;
            let want = expect(rank);
            assert!(
                (share - want).abs() < 0.05 * want,
                "rank {rank}: share {share:.4}, expected {want:.4}"
            );
        }
        // ... and approximate past them (rank 2 comes out ~15% heavy, as in YCSB), close
        // enough over the head of the distribution.
        for head in [10u64, 100] {
            let share = c[..head as usize].iter().sum::<u64>() as f64 / DRAWS as f64;
            let want: f64 = (0..head).map(expect).sum();
            assert!(
                (share - want).abs() < 0.05 * want,
                "top {head}: share {share:.4}, expected {want:.4}"
            );
        }
        // The top item holds ~13.4% of 1000 items at theta 0.99.
        let top = c[0] as f64 / DRAWS as f64;
        assert!((0.12..0.15).contains(&top), "top share {top}");
    }

    #[test]
    fn theta_two_is_heavily_skewed() {
        let n = 10_000;
        let c = counts(2.0, n, 3);
        let top = c[0] as f64 / DRAWS as f64;
        let want = 1.0 / zeta(n, 2.0); // ~0.608
        assert!(
            (top - want).abs() < 0.02,
            "top share {top}, expected {want}"
        );
        let second = c[1] as f64 / DRAWS as f64;
        assert!((second - want / 4.0).abs() < 0.02, "second share {second}");
        let top10: u64 = c[..10].iter().sum();
        assert!(top10 as f64 / DRAWS as f64 > 0.9);
    }

    #[test]
    fn theta_one_and_above_match_the_exact_pmf() {
        for theta in [1.0, 1.2, 3.5] {
            let n = 50;
            let c = counts(theta, n, 11);
            let z = zeta(n, theta);
            for rank in 0..5u64 {
                let want = ((rank + 1) as f64).powf(-theta) / z;
                let share = c[rank as usize] as f64 / DRAWS as f64;
                assert!(
                    (share - want).abs() < 0.01 + 0.05 * want,
                    "theta {theta} rank {rank}: {share:.4} vs {want:.4}"
                );
            }
        }
    }

    #[test]
    fn growing_zeta_incrementally_equals_recomputing() {
        for theta in [0.5, 0.99, 2.0] {
            let mut grown = Zipfian::new(theta, 10);
            grown.resize(5_000);
            grown.resize(12_345);
            let fresh = Zipfian::new(theta, 12_345);
            let (mut a, mut b) = (SmallRng::seed_from_u64(5), SmallRng::seed_from_u64(5));
            for _ in 0..1000 {
                assert_eq!(grown.sample(&mut a), fresh.sample(&mut b));
            }
        }
        let mut g = Gray::new(0.99, 100);
        g.resize(100_000);
        assert_eq!(g.zetan, zeta(100_000, 0.99));
    }

    #[test]
    fn tiny_key_spaces_stay_in_range() {
        for theta in [0.0, 0.5, 0.99, 1.0, 2.0] {
            for n in 1..=4 {
                let c = counts(theta, n, 1);
                assert_eq!(c.iter().sum::<u64>(), DRAWS as u64);
            }
        }
    }

    #[test]
    fn scrambled_zipfian_spreads_hot_keys_and_stays_in_range() {
        let mut ch = KeyChooser::Zipfian {
            zipf: Zipfian::new(0.99, 1000),
            loaded: 1000,
        };
        let mut rng = SmallRng::seed_from_u64(9);
        let mut c = vec![0u64; 1200];
        for _ in 0..50_000 {
            let k = ch.next(&mut rng, 1000);
            assert!(k < 1000);
            c[k as usize] += 1;
        }
        // The hottest key is rank 0's scrambled position, not key 0.
        let hottest = (0..1000).max_by_key(|&i| c[i]).unwrap() as u64;
        assert_eq!(hottest, fnv1a64(0) % 1000);
        // With more acknowledged keys the hot key keeps its number.
        for _ in 0..50_000 {
            let k = ch.next(&mut rng, 1200);
            assert!(k < 1200);
        }
        assert_eq!(fnv1a64(0) % 1000, hottest);
    }

    #[test]
    fn sequential_visits_every_key_once_across_clones() {
        let a = KeyChooser::Sequential {
            next: std::sync::Arc::default(),
        };
        let (mut a, mut b) = (a.clone(), a);
        let mut rng = SmallRng::seed_from_u64(1);
        let mut seen: Vec<u64> = (0..10)
            .flat_map(|_| [a.next(&mut rng, 20), b.next(&mut rng, 20)])
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..20).collect::<Vec<_>>());
        assert_eq!(a.next(&mut rng, 20), 0, "wraps around");
    }

    #[test]
    fn latest_prefers_recent_keys() {
        let mut ch = KeyChooser::Latest {
            zipf: Zipfian::new(0.99, 1000),
        };
        let mut rng = SmallRng::seed_from_u64(4);
        let n = 1000;
        let mut newest_tenth = 0;
        let mut newest = 0;
        for _ in 0..10_000 {
            let k = ch.next(&mut rng, n);
            assert!(k < n);
            if k >= 900 {
                newest_tenth += 1;
            }
            if k == n - 1 {
                newest += 1;
            }
        }
        assert!(
            newest_tenth > 5_000,
            "only {newest_tenth} of 10k draws in the newest 10%"
        );
        assert!(newest > 1_000, "the newest key drawn only {newest} times");
        // After an insert is acknowledged, the new key becomes the hottest.
        let mut newest_after = 0;
        for _ in 0..10_000 {
            if ch.next(&mut rng, n + 1) == n {
                newest_after += 1;
            }
        }
        assert!(newest_after > 1_000);
    }

    #[test]
    fn uniform_chooser_covers_the_key_space() {
        let mut ch = KeyChooser::Uniform;
        let mut rng = SmallRng::seed_from_u64(2);
        let mut c = [0u32; 10];
        for _ in 0..10_000 {
            c[ch.next(&mut rng, 10) as usize] += 1;
        }
        assert!(c.iter().all(|&k| (800..1200).contains(&k)), "{c:?}");
    }

    #[test]
    fn key_space_acknowledges_contiguous_prefixes() {
        let ks = KeySpace::new(10);
        assert_eq!(ks.limit(), 10);
        let a = ks.next_insert();
        let b = ks.next_insert();
        let c = ks.next_insert();
        assert_eq!((a, b, c), (10, 11, 12));
        ks.complete(c);
        assert_eq!(ks.limit(), 10, "12 done but 10 and 11 still in flight");
        ks.complete(a);
        assert_eq!(ks.limit(), 11);
        ks.complete(b);
        assert_eq!(ks.limit(), 13);
        ks.complete(5); // an old number: no effect
        assert_eq!(ks.limit(), 13);
        let loading = KeySpace::with_next(0, 0);
        assert_eq!(loading.next_insert(), 0);
    }
}
