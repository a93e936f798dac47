//! A deterministic model of DINOMO Fig. 3 and of the Fig. 5 setting of issue 12: round trips
//! per read for each policy across cache sizes. A value hit costs 0 RTs, a shortcut hit 1, a
//! miss `miss_rts`. Run with `--nocapture` to see the tables (`CACHE_SIM_DEBUG=1` also prints
//! each cache's final stats):
//!
//! ```text
//! cargo test --release -p dinomo-kv-node --lib cache::sim -- --nocapture --test-threads 1
//! ```
//!
//! * `fig3_*`, `hot_set_*`: reads over a working set of 400 8-byte keys, uniform (the paper's
//!   Fig. 3 workload) or 90% on a 10% hot set, with 64-byte values (the paper's) or 1 KB
//!   values. The 1 KB columns are the cache sizes of `dac-bench --value-bytes 1024` (1, 2, 4,
//!   8, 16% of a data set whose working set is 5%).
//! * `ycsb_*`: the setting of issue 12 (`dinomo bench`, YCSB-C, 50k keys on 4 KNs, scaled to
//!   one KN's share): 12,500 24-byte keys, each written once (the load phase: DAC caches the
//!   first values written, then shortcuts), then zipf 0.99 reads with YCSB's scrambling
//!   (FNV-1a of the rank modulo the key count, as `dinomo bench` does), a short warm-up
//!   (15,000 reads, about what 2 s of warm-up gives each KN there) and 60,000 measured reads;
//!   misses cost 2 RTs (bucket READ + entry READ).
//!
//! Each table also prints DAC with plain access counts instead of LFU-DA ("dac, plain LFU")
//! and DAC with Table 3's promotion as published, which never demotes a value to promote one
//! ("dac, Table 3 promote"; the policy before issue 12), DAC's RTs/op as a share of the best
//! policy's, and the share of DAC's hits that were shortcut hits.

use bytes::Bytes;
use dinomo_layout::index::EntryPtr;

use super::{shortcut_cost, value_cost, Cache, CacheConfig, Lookup, Policy, Shortcut};

const POLICIES: [Policy; 4] = [
    Policy::Dac,
    Policy::ShortcutOnly,
    Policy::ValueOnly,
    Policy::Static { value_percent: 50 },
];

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// YCSB's rank scrambling (64-bit FNV-1a of the little-endian rank), as in `dinomo bench`.
fn fnv1a64(x: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in x.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[derive(Clone, Debug)]
enum Workload {
    /// Every key equally likely (the paper's Fig. 3 workload).
    Uniform,
    /// 90% of the reads go to the first 10% of the keys, uniformly; the rest to the others.
    HotSet,
    /// Rank r (0-based) drawn with probability proportional to 1 / (r + 1)^0.99 (the table is
    /// the cumulative distribution), then scrambled into a key number: `fnv1a64(r) % keys`.
    /// Several ranks can land on one key and some keys are never read, as in `dinomo bench`.
    ScrambledZipf(Vec<f64>),
}

impl Workload {
    fn scrambled_zipf(theta: f64, keys: u64) -> Self {
        let mut cdf = Vec::with_capacity(keys as usize);
        let mut sum = 0.0;
        for r in 0..keys {
            sum += 1.0 / ((r + 1) as f64).powf(theta);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Workload::ScrambledZipf(cdf)
    }

    fn key(&self, keys: u64, rng: &mut Rng) -> u64 {
        match self {
            Workload::Uniform => rng.next() % keys,
            Workload::HotSet => {
                let hot = keys / 10;
                if rng.next() % 10 < 9 {
                    rng.next() % hot
                } else {
                    hot + rng.next() % (keys - hot)
                }
            }
            Workload::ScrambledZipf(cdf) => {
                let u = rng.unit();
                let rank = (cdf.partition_point(|&c| c <= u) as u64).min(keys - 1);
                fnv1a64(rank) % keys
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Workload::Uniform => "uniform",
            Workload::HotSet => "hot-set (90% on 10%)",
            Workload::ScrambledZipf(_) => "YCSB zipf 0.99",
        }
    }
}

/// One table: reads over `keys` keys of `key_len` + `value_len` bytes, with budgets of
/// `columns` times the raw key+value bytes.
struct Setup {
    workload: Workload,
    keys: u64,
    key_len: usize,
    value_len: usize,
    miss_rts: u32,
    /// Write every key once, in key order, before the reads (a load phase).
    load: bool,
    warmup_ops: u64,
    measured_ops: u64,
    columns: Vec<f64>,
}

impl Setup {
    /// The Fig. 3 setting: 400 8-byte keys, misses of 3 RTs, an empty cache.
    fn fig3(workload: Workload, value_len: usize) -> Self {
        Setup {
            workload,
            keys: 400,
            key_len: 8,
            value_len,
            miss_rts: 3,
            load: false,
            warmup_ops: 15 * 400,
            measured_ops: 20 * 400,
            columns: if value_len == 64 {
                vec![0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
            } else {
                vec![0.2, 0.4, 0.8, 1.6, 3.2]
            },
        }
    }

    /// The issue 12 setting (see the module doc).
    fn ycsb(value_len: usize, load: bool) -> Self {
        let keys = 12_500;
        Setup {
            workload: Workload::scrambled_zipf(0.99, keys),
            keys,
            key_len: 24,
            value_len,
            miss_rts: 2,
            load,
            warmup_ops: 15_000,
            measured_ops: 60_000,
            columns: vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
        }
    }

    fn key(&self, k: u64) -> Vec<u8> {
        let mut key = vec![b'k'; self.key_len];
        let n = self.key_len.min(8);
        key[self.key_len - n..].copy_from_slice(&k.to_be_bytes()[8 - n..]);
        key
    }

    fn raw(&self) -> usize {
        self.keys as usize * (self.key_len + self.value_len)
    }

    fn budget(&self, column: f64) -> usize {
        (self.raw() as f64 * column) as usize
    }
}

fn shortcut_of(k: u64) -> Shortcut {
    Shortcut {
        ptr: EntryPtr::new(4096 + 8192 * k, 96),
        version: 1,
    }
}

/// DAC variants besides the policy itself.
#[derive(Clone, Copy)]
struct Variant {
    aging: bool,
    demote_to_promote: bool,
}

const AS_BUILT: Variant = Variant {
    aging: true,
    demote_to_promote: true,
};

/// What a run measured (after the warm-up).
#[derive(Clone, Copy, Debug)]
struct Cell {
    rts_per_op: f64,
    /// Share of the hits that were shortcut hits.
    shortcut_share: f64,
}

/// Reads after a warm-up (and the load phase, if any), starting from an empty cache.
fn run(setup: &Setup, policy: Policy, budget: usize, variant: Variant) -> Cell {
    let mut cache = Cache::new(CacheConfig {
        budget_bytes: budget,
        policy,
    });
    cache.set_count_aging(variant.aging);
    cache.set_demote_to_promote(variant.demote_to_promote);
    let keys: Vec<Vec<u8>> = (0..setup.keys).map(|k| setup.key(k)).collect();
    let values: Vec<Bytes> = (0..setup.keys)
        .map(|k| Bytes::from(vec![k as u8; setup.value_len]))
        .collect();
    if setup.load {
        for (k, key) in keys.iter().enumerate() {
            cache.on_write(key, shortcut_of(k as u64), values[k].clone());
        }
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut rts, mut value_hits, mut shortcut_hits) = (0u64, 0u64, 0u64);
    for op in 0..setup.warmup_ops + setup.measured_ops {
        let measured = op >= setup.warmup_ops;
        let k = setup.workload.key(setup.keys, &mut rng) as usize;
        let key = &keys[k];
        let cost = match cache.lookup(key) {
            Lookup::Value { .. } => {
                value_hits += u64::from(measured);
                0
            }
            Lookup::Shortcut(_) => {
                shortcut_hits += u64::from(measured);
                cache.on_shortcut_read(key, values[k].clone(), 1);
                1
            }
            Lookup::Miss => {
                let rts = setup.miss_rts;
                cache.on_miss_read(key, shortcut_of(k as u64), values[k].clone(), rts);
                rts
            }
        };
        if measured {
            rts += u64::from(cost);
        }
    }
    cache.check();
    if std::env::var_os("CACHE_SIM_DEBUG").is_some() {
        println!(
            "  {} {policy} aging={} demote_to_promote={} budget {budget}: {:?}",
            setup.workload.name(),
            variant.aging,
            variant.demote_to_promote,
            cache.stats()
        );
    }
    Cell {
        rts_per_op: rts as f64 / setup.measured_ops as f64,
        shortcut_share: shortcut_hits as f64 / (value_hits + shortcut_hits).max(1) as f64,
    }
}

fn print_row(name: &str, row: impl IntoIterator<Item = String>) {
    print!("{name:>22}");
    for r in row {
        print!("{r:>8}");
    }
    println!();
}

/// Prints the RTs/op table of `setup` and returns it (rows in [`POLICIES`] order).
fn table(setup: &Setup) -> Vec<Vec<Cell>> {
    let (k, v) = (setup.key_len, setup.value_len);
    println!(
        "{} reads{}, RTs/op: {} keys x ({k} B key + {v} B value) = {} B raw; all as shortcuts \
         {} B, all as values {} B; miss = {} RTs",
        setup.workload.name(),
        if setup.load { " after a load" } else { "" },
        setup.keys,
        setup.raw(),
        setup.keys as usize * shortcut_cost(k),
        setup.keys as usize * value_cost(k, v),
        setup.miss_rts,
    );
    print_row(
        "budget/raw",
        setup.columns.iter().map(|c| format!("{c:.2}")),
    );
    let row = |policy: Policy, variant: Variant| -> Vec<Cell> {
        setup
            .columns
            .iter()
            .map(|&c| run(setup, policy, setup.budget(c), variant))
            .collect()
    };
    let fmt = |cells: &[Cell]| -> Vec<String> {
        cells
            .iter()
            .map(|c| format!("{:.3}", c.rts_per_op))
            .collect()
    };
    let rows: Vec<Vec<Cell>> = POLICIES.iter().map(|&p| row(p, AS_BUILT)).collect();
    for (p, r) in POLICIES.iter().zip(&rows) {
        print_row(&p.to_string(), fmt(r));
    }
    // For the record (not asserted): DAC without LFU-DA, and DAC as before issue 12.
    let plain = row(
        Policy::Dac,
        Variant {
            aging: false,
            ..AS_BUILT
        },
    );
    print_row("dac, plain LFU", fmt(&plain));
    let table3 = row(
        Policy::Dac,
        Variant {
            demote_to_promote: false,
            ..AS_BUILT
        },
    );
    print_row("dac, Table 3 promote", fmt(&table3));
    let best = |ci: usize| {
        rows.iter()
            .map(|r| r[ci].rts_per_op)
            .fold(f64::INFINITY, f64::min)
    };
    let share = |dac: &[Cell]| -> Vec<String> {
        (0..setup.columns.len())
            .map(|ci| {
                let (b, d) = (best(ci), dac[ci].rts_per_op);
                if b == 0.0 {
                    format!("+{d:.3}")
                } else {
                    format!("{:.0}%", 100.0 * d / b)
                }
            })
            .collect()
    };
    print_row("dac % of best", share(&rows[0]));
    print_row("Table 3 dac % of best", share(&table3));
    print_row(
        "dac shortcut hits",
        rows[0]
            .iter()
            .map(|c| format!("{:.0}%", 100.0 * c.shortcut_share)),
    );
    print_row(
        "Table 3 shortcut hits",
        table3
            .iter()
            .map(|c| format!("{:.0}%", 100.0 * c.shortcut_share)),
    );
    println!();
    rows
}

/// DAC's RTs/op at most `factor` times the best policy's, in every column.
fn assert_dac_within(setup: &Setup, rows: &[Vec<Cell>], factor: f64) {
    for (ci, c) in setup.columns.iter().enumerate() {
        let best = rows
            .iter()
            .map(|row| row[ci].rts_per_op)
            .fold(f64::INFINITY, f64::min);
        let dac = rows[0][ci].rts_per_op;
        assert!(
            dac <= best * factor + 1e-9,
            "{} {} B values, budget {c}x raw: DAC {dac:.3} RTs/op vs best {best:.3}",
            setup.workload.name(),
            setup.value_len
        );
    }
}

#[test]
fn fig3_uniform_dac_tracks_the_best_policy() {
    let setup = Setup::fig3(Workload::Uniform, 64);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.10);
    // The Fig. 3 trend itself: shortcuts win small caches, values win large ones.
    let rts = |p: usize, c: usize| rows[p][c].rts_per_op;
    assert!(
        rts(1, 1) < rts(2, 1),
        "small cache: shortcut-only beats value-only"
    );
    assert!(
        rts(2, 7) < rts(1, 7),
        "large cache: value-only beats shortcut-only"
    );
}

/// Not part of Fig. 3: a skewed workload, where values pay off early. Table 3 demotes the
/// LRU value on every miss that needs room, and here the values are the hot keys, so DAC
/// pays some demote/re-promote churn: it is asserted within 25% of the best policy, not 10%.
#[test]
fn hot_set_dac_stays_near_the_best_policy() {
    let setup = Setup::fig3(Workload::HotSet, 64);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.25);
    for (dac, shortcut_only) in rows[0].iter().zip(&rows[1]) {
        assert!(
            dac.rts_per_op < shortcut_only.rts_per_op,
            "values pay off: DAC beats shortcut-only"
        );
    }
}

/// Fig. 3 with 1 KB values (the `dac-bench --value-bytes 1024` grid): a value costs about ten
/// shortcuts, so the policies differ by far more than with 64-byte values.
#[test]
fn fig3_uniform_1kb_dac_tracks_the_best_policy() {
    let setup = Setup::fig3(Workload::Uniform, 1024);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.05);
}

#[test]
fn hot_set_1kb_dac_tracks_the_best_policy() {
    let setup = Setup::fig3(Workload::HotSet, 1024);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.05);
}

/// Issue 12: after a load phase the cache holds the values written first, not the hot ones,
/// and every key fits as a shortcut from about 12% of the data on, so reads hardly miss and
/// Table 3's miss-time demotion never clears the cold values; the promotion must.
#[test]
fn ycsb_1kb_after_load_dac_within_5_percent_of_the_best() {
    let setup = Setup::ycsb(1024, true);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.05);
}

#[test]
fn ycsb_1kb_cold_cache_dac_within_5_percent_of_the_best() {
    let setup = Setup::ycsb(1024, false);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.05);
}

/// With 64-byte values. At 10% of the data (6% of the keys fit, even as shortcuts) static-50
/// beats DAC by 11%, as it did before issue 12: with 2-RT misses a 64-byte value saves about
/// as many RTs per byte as a shortcut, and Table 3 caches a missed key as a shortcut.
#[test]
fn ycsb_64b_after_load_dac_stays_near_the_best_policy() {
    let setup = Setup::ycsb(64, true);
    let rows = table(&setup);
    assert_dac_within(&setup, &rows, 1.15);
}
