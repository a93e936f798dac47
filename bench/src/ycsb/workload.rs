//! Workloads (operation mixes), key names and values.
//!
//! Key names follow YCSB: `"user"` and a zero-padded number. The number is the key number run
//! through a fixed bijection, so consecutive inserts land far apart in the key space (and on
//! different nodes) while every key number still names a distinct key. The bijection does not
//! depend on the seed, so a run with any seed reads the keys a load with any other seed wrote.
//! Values are slices of one pool of random bytes generated from the seed: deterministic, and
//! cheap to hand out (a slice of `Bytes` copies nothing).

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use serde::Serialize;

/// The key prefix YCSB uses.
pub const KEY_PREFIX: &str = "user";

/// One operation type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum OpKind {
    Read,
    Update,
    Insert,
    ReadModifyWrite,
    Delete,
}

impl OpKind {
    pub const ALL: [OpKind; 5] = [
        OpKind::Read,
        OpKind::Update,
        OpKind::Insert,
        OpKind::ReadModifyWrite,
        OpKind::Delete,
    ];

    /// The label used in tables and JSON ("READ", "UPDATE", "INSERT", "READ-MODIFY-WRITE").
    pub fn label(self) -> &'static str {
        match self {
            OpKind::Read => "READ",
            OpKind::Update => "UPDATE",
            OpKind::Insert => "INSERT",
            OpKind::ReadModifyWrite => "READ-MODIFY-WRITE",
            OpKind::Delete => "DELETE",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// How keys of reads, updates and read-modify-writes are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Distribution {
    /// Scrambled zipfian with skew `--zipf-theta`.
    Zipfian,
    /// Uniform over the existing keys.
    Uniform,
    /// Newest keys hottest (zipfian with skew `--zipf-theta` counted back from the newest).
    Latest,
    /// Every key once, in order (key 0, 1, 2, ... over all clients, wrapping around): with
    /// `--operations` equal to `--records`, a workload of reads reads back every loaded key.
    Sequential,
}

impl Distribution {
    pub fn name(self) -> &'static str {
        match self {
            Distribution::Zipfian => "zipfian",
            Distribution::Uniform => "uniform",
            Distribution::Latest => "latest",
            Distribution::Sequential => "sequential",
        }
    }
}

/// A workload: YCSB core workloads and the DINOMO paper's mixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Workload {
    /// YCSB load phase: inserts only, key numbers in order from 0.
    #[value(name = "load")]
    #[serde(rename = "load")]
    Load,
    /// YCSB A: 50% read, 50% update.
    #[value(name = "a")]
    #[serde(rename = "a")]
    A,
    /// YCSB B: 95% read, 5% update.
    #[value(name = "b")]
    #[serde(rename = "b")]
    B,
    /// YCSB C: read only.
    #[value(name = "c")]
    #[serde(rename = "c")]
    C,
    /// YCSB D: 95% read, 5% insert; reads favour the latest inserts.
    #[value(name = "d")]
    #[serde(rename = "d")]
    D,
    /// YCSB F: 50% read, 50% read-modify-write.
    #[value(name = "f")]
    #[serde(rename = "f")]
    F,
    /// DINOMO paper: 95% read, 5% update.
    #[value(name = "read95-update5")]
    #[serde(rename = "read95-update5")]
    Read95Update5,
    /// DINOMO paper: 50% read, 50% update.
    #[value(name = "read50-update50")]
    #[serde(rename = "read50-update50")]
    Read50Update50,
    /// DINOMO paper: 95% read, 5% insert.
    #[value(name = "read95-insert5")]
    #[serde(rename = "read95-insert5")]
    Read95Insert5,
    /// DINOMO paper: 50% read, 50% insert.
    #[value(name = "read50-insert50")]
    #[serde(rename = "read50-insert50")]
    Read50Insert50,
    /// Deletes only (of existing keys, chosen like reads): with `--distribution sequential`
    /// and `--operations`, deletes that many keys from key 0 on, e.g. to free space in a full
    /// pool.
    Delete,
}

/// Proportions of each operation type (they sum to 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Mix {
    pub read: f64,
    pub update: f64,
    pub insert: f64,
    pub read_modify_write: f64,
    pub delete: f64,
}

impl Mix {
    const fn new(read: f64, update: f64, insert: f64, read_modify_write: f64) -> Self {
        Mix {
            read,
            update,
            insert,
            read_modify_write,
            delete: 0.0,
        }
    }

    /// Draws an operation type.
    pub fn pick(&self, rng: &mut impl Rng) -> OpKind {
        let u: f64 = rng.random::<f64>() * self.total();
        let mut acc = self.read;
        if u < acc {
            return OpKind::Read;
        }
        acc += self.update;
        if u < acc {
            return OpKind::Update;
        }
        acc += self.insert;
        if u < acc {
            return OpKind::Insert;
        }
        acc += self.read_modify_write;
        if u < acc {
            return OpKind::ReadModifyWrite;
        }
        if self.delete > 0.0 {
            return OpKind::Delete;
        }
        // Only rounding gets here: fall back to the last type with a share.
        [
            (self.read_modify_write, OpKind::ReadModifyWrite),
            (self.insert, OpKind::Insert),
            (self.update, OpKind::Update),
            (self.read, OpKind::Read),
        ]
        .into_iter()
        .find(|(p, _)| *p > 0.0)
        .map_or(OpKind::Read, |(_, k)| k)
    }

    pub fn total(&self) -> f64 {
        self.read + self.update + self.insert + self.read_modify_write + self.delete
    }

    /// The share of `kind`.
    pub fn share(&self, kind: OpKind) -> f64 {
        match kind {
            OpKind::Read => self.read,
            OpKind::Update => self.update,
            OpKind::Insert => self.insert,
            OpKind::ReadModifyWrite => self.read_modify_write,
            OpKind::Delete => self.delete,
        }
    }

    /// "50% read, 50% update".
    pub fn describe(&self) -> String {
        let parts: Vec<String> = OpKind::ALL
            .iter()
            .filter(|k| self.share(**k) > 0.0)
            .map(|k| {
                let name = match k {
                    OpKind::Read => "read",
                    OpKind::Update => "update",
                    OpKind::Insert => "insert",
                    OpKind::ReadModifyWrite => "read-modify-write",
                    OpKind::Delete => "delete",
                };
                format!("{}% {name}", (self.share(*k) * 100.0).round())
            })
            .collect();
        parts.join(", ")
    }
}

impl Workload {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Load => "load",
            Workload::A => "a",
            Workload::B => "b",
            Workload::C => "c",
            Workload::D => "d",
            Workload::F => "f",
            Workload::Read95Update5 => "read95-update5",
            Workload::Read50Update50 => "read50-update50",
            Workload::Read95Insert5 => "read95-insert5",
            Workload::Read50Insert50 => "read50-insert50",
            Workload::Delete => "delete",
        }
    }

    pub fn mix(self) -> Mix {
        match self {
            Workload::Load => Mix::new(0.0, 0.0, 1.0, 0.0),
            Workload::A | Workload::Read50Update50 => Mix::new(0.5, 0.5, 0.0, 0.0),
            Workload::B | Workload::Read95Update5 => Mix::new(0.95, 0.05, 0.0, 0.0),
            Workload::C => Mix::new(1.0, 0.0, 0.0, 0.0),
            Workload::D | Workload::Read95Insert5 => Mix::new(0.95, 0.0, 0.05, 0.0),
            Workload::F => Mix::new(0.5, 0.0, 0.0, 0.5),
            Workload::Read50Insert50 => Mix::new(0.5, 0.0, 0.5, 0.0),
            Workload::Delete => Mix {
                delete: 1.0,
                ..Mix::new(0.0, 0.0, 0.0, 0.0)
            },
        }
    }

    /// The request distribution the workload is defined with (YCSB D: latest; others zipfian).
    pub fn default_distribution(self) -> Distribution {
        match self {
            Workload::D => Distribution::Latest,
            _ => Distribution::Zipfian,
        }
    }
}

/// Turns key numbers into key names of a fixed length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyFormat {
    digits: usize,
    /// Distinct key numbers the digits can hold (`10^digits`), or `None` for all of `u64`.
    capacity: Option<u64>,
    /// Bits of the permutation domain when `capacity` is `Some` (`2^bits >= capacity`).
    bits: u32,
}

/// Digits of `u64::MAX`: with this many digits every `u64` fits.
const U64_DIGITS: usize = 20;

impl KeyFormat {
    /// Keys of exactly `key_size` bytes: `"user"` and `key_size - 4` digits.
    pub fn new(key_size: usize) -> Result<Self, String> {
        if key_size <= KEY_PREFIX.len() {
            return Err(format!(
                "--key-size {key_size} leaves no room for digits after {KEY_PREFIX:?}: use at least {}",
                KEY_PREFIX.len() + 1
            ));
        }
        let digits = key_size - KEY_PREFIX.len();
        if digits >= U64_DIGITS {
            return Ok(KeyFormat {
                digits,
                capacity: None,
                bits: 64,
            });
        }
        let capacity = 10u64.pow(digits as u32);
        let bits = 64 - (capacity - 1).leading_zeros();
        Ok(KeyFormat {
            digits,
            capacity: Some(capacity),
            bits,
        })
    }

    /// How many distinct keys this size can name (`None`: more than `u64` can count).
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// The length of every key.
    pub fn key_size(&self) -> usize {
        KEY_PREFIX.len() + self.digits
    }

    /// The scrambled number of key number `keynum`: a bijection on `0..capacity` (key numbers
    /// past the capacity wrap around and so reuse names).
    pub fn scramble(&self, keynum: u64) -> u64 {
        match self.capacity {
            None => mix64(keynum),
            Some(cap) => {
                // Cycle-walking: a bijection of 0..2^bits, applied until the value is below
                // the capacity, is a bijection of 0..capacity (2^bits < 2 * capacity, so this
                // takes two steps on average).
                let mut x = mix_bits(keynum % cap, self.bits);
                while x >= cap {
                    x = mix_bits(x, self.bits);
                }
                x
            }
        }
    }

    /// The key name of key number `keynum`.
    pub fn key(&self, keynum: u64) -> String {
        format!(
            "{KEY_PREFIX}{:0width$}",
            self.scramble(keynum),
            width = self.digits
        )
    }
}

/// A bijection of `u64` that spreads neighbours far apart (xor-shift and odd-multiply steps,
/// each invertible).
fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A bijection of `0..2^bits` (`4 <= bits <= 64`) built from the same invertible steps as
/// [`mix64`], each reduced modulo `2^bits`.
fn mix_bits(mut x: u64, bits: u32) -> u64 {
    let mask = u64::MAX >> (64 - bits);
    let shift = bits.div_ceil(2);
    for mul in [0xbf58_476d_1ce4_e5b9u64, 0x94d0_49bb_1331_11eb] {
        x ^= x >> shift;
        x = x.wrapping_mul(mul) & mask;
    }
    x ^ (x >> shift)
}

/// Values of one size, sliced from a pool of random bytes made from the seed.
#[derive(Debug, Clone)]
pub struct ValuePool {
    pool: Bytes,
    size: usize,
}

/// Distinct offsets into the pool: enough that consecutive values differ.
const POOL_SLACK: usize = 1 << 20;

impl ValuePool {
    pub fn new(size: usize, seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5641_4c55_4553_0000);
        let mut buf = vec![0u8; size + POOL_SLACK];
        rng.fill_bytes(&mut buf);
        ValuePool {
            pool: Bytes::from(buf),
            size,
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// A value of the pool's size starting at a random offset.
    pub fn value(&self, rng: &mut impl Rng) -> Bytes {
        let off = rng.random_range(0..=POOL_SLACK);
        self.pool.slice(off..off + self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum as _;
    use std::collections::HashSet;

    #[test]
    fn op_mix_proportions_over_10k_draws() {
        let mut rng = SmallRng::seed_from_u64(1234);
        for w in Workload::value_variants() {
            let mix = w.mix();
            assert!((mix.total() - 1.0).abs() < 1e-12, "{}", w.name());
            let mut c = [0u32; OpKind::ALL.len()];
            for _ in 0..10_000 {
                c[mix.pick(&mut rng).index()] += 1;
            }
            for k in OpKind::ALL {
                let share = f64::from(c[k.index()]) / 10_000.0;
                let want = mix.share(k);
                // 5 standard deviations of a binomial share over 10k draws is at most 0.025.
                assert!(
                    (share - want).abs() < 0.025,
                    "workload {}: {} share {share}, expected {want}",
                    w.name(),
                    k.label()
                );
                if want == 0.0 {
                    assert_eq!(c[k.index()], 0, "workload {} drew {}", w.name(), k.label());
                }
            }
        }
    }

    #[test]
    fn workload_definitions() {
        assert_eq!(Workload::A.mix(), Workload::Read50Update50.mix());
        assert_eq!(Workload::B.mix(), Workload::Read95Update5.mix());
        assert_eq!(Workload::D.default_distribution(), Distribution::Latest);
        assert_eq!(
            Workload::Read95Insert5.default_distribution(),
            Distribution::Zipfian
        );
        assert_eq!(
            Workload::F.mix().describe(),
            "50% read, 50% read-modify-write"
        );
        for w in Workload::value_variants() {
            let parsed = Workload::from_str(w.name(), false).unwrap();
            assert_eq!(parsed, *w);
        }
    }

    #[test]
    fn keys_have_the_requested_length_and_are_distinct() {
        for size in [5usize, 8, 12, 16, 23, 24, 25, 32, 100] {
            let f = KeyFormat::new(size).unwrap();
            assert_eq!(f.key_size(), size);
            let n = f.capacity().unwrap_or(u64::MAX).min(5_000);
            let mut seen = HashSet::new();
            for k in 0..n {
                let key = f.key(k);
                assert_eq!(key.len(), size, "{key}");
                assert!(key.starts_with("user"));
                assert!(key[4..].bytes().all(|b| b.is_ascii_digit()), "{key}");
                assert!(seen.insert(key), "duplicate key for {k} at size {size}");
            }
        }
        assert_eq!(KeyFormat::new(24).unwrap().key(0).len(), 24);
        assert!(KeyFormat::new(4).is_err());
        assert_eq!(KeyFormat::new(6).unwrap().capacity(), Some(100));
        assert_eq!(KeyFormat::new(24).unwrap().capacity(), None);
    }

    #[test]
    fn small_key_spaces_are_permuted_fully() {
        // 3 digits: every number 0..1000 names a different key, all of them used.
        let f = KeyFormat::new(7).unwrap();
        let all: HashSet<u64> = (0..1000).map(|k| f.scramble(k)).collect();
        assert_eq!(all.len(), 1000);
        assert!(all.iter().all(|&x| x < 1000));
        // Neighbours land apart.
        assert_ne!(f.scramble(1), f.scramble(0) + 1);
        // The same numbers always give the same keys.
        assert_eq!(
            KeyFormat::new(24).unwrap().key(77),
            KeyFormat::new(24).unwrap().key(77)
        );
    }

    #[test]
    fn values_are_deterministic_per_seed() {
        let a = ValuePool::new(100, 7);
        let b = ValuePool::new(100, 7);
        let c = ValuePool::new(100, 8);
        let (mut r1, mut r2) = (SmallRng::seed_from_u64(1), SmallRng::seed_from_u64(1));
        let (va, vb) = (a.value(&mut r1), b.value(&mut r2));
        assert_eq!(va.len(), 100);
        assert_eq!(va, vb);
        assert_ne!(
            a.value(&mut SmallRng::seed_from_u64(1)),
            c.value(&mut SmallRng::seed_from_u64(1))
        );
    }
}
