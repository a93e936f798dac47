//! A deterministic reproduction of the trend of DINOMO Fig. 3: RTs per read for each policy
//! across cache sizes, uniform reads over a working set of 8-byte keys and 64-byte values.

use bytes::Bytes;
use dinomo_layout::index::EntryPtr;

use super::{shortcut_cost, value_cost, Cache, CacheConfig, Lookup, Policy, Shortcut};

const KEY_LEN: usize = 8;
const VALUE_LEN: usize = 64;
/// RTs of a miss (index bucket READ(s) + entry READ) in the model.
const MISS_RTS: u32 = 3;
const WORKING_SET: u64 = 1000;
const WARMUP_OPS: u64 = 30 * WORKING_SET;
const MEASURED_OPS: u64 = 30 * WORKING_SET;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn shortcut_of(k: u64) -> Shortcut {
    Shortcut {
        ptr: EntryPtr::new(4096 + 128 * k, 96),
        version: 1,
    }
}

/// RTs/op of uniform reads after a warm-up.
fn run(policy: Policy, budget: usize) -> f64 {
    let mut cache = Cache::new(CacheConfig {
        budget_bytes: budget,
        policy,
    });
    let values: Vec<Bytes> = (0..WORKING_SET)
        .map(|k| Bytes::from(vec![k as u8; VALUE_LEN]))
        .collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rts = 0u64;
    for op in 0..WARMUP_OPS + MEASURED_OPS {
        let k = rng.next() % WORKING_SET;
        let key = k.to_be_bytes();
        let cost = match cache.lookup(&key) {
            Lookup::Value { .. } => 0,
            Lookup::Shortcut(_) => {
                cache.on_shortcut_read(&key, values[k as usize].clone(), 1);
                1
            }
            Lookup::Miss => {
                cache.on_miss_read(&key, shortcut_of(k), values[k as usize].clone(), MISS_RTS);
                MISS_RTS
            }
        };
        if op >= WARMUP_OPS {
            rts += u64::from(cost);
        }
    }
    cache.check();
    rts as f64 / MEASURED_OPS as f64
}

#[test]
fn fig3_trend_dac_tracks_the_best_policy() {
    let raw = WORKING_SET as usize * (KEY_LEN + VALUE_LEN);
    let all_shortcuts = WORKING_SET as usize * shortcut_cost(KEY_LEN);
    let all_values = WORKING_SET as usize * value_cost(KEY_LEN, VALUE_LEN);
    let policies = [
        Policy::Dac,
        Policy::ShortcutOnly,
        Policy::ValueOnly,
        Policy::Static { value_percent: 50 },
    ];
    // Budgets as a multiple of the working set's raw key+value bytes.
    let columns = [0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5];
    println!(
        "working set {WORKING_SET} keys x ({KEY_LEN} B key + {VALUE_LEN} B value) = {raw} B; \
         all as shortcuts {all_shortcuts} B, all as values {all_values} B; miss = {MISS_RTS} RTs"
    );
    print!("{:>16}", "budget/raw");
    for c in columns {
        print!("{c:>8.2}");
    }
    println!();
    let table: Vec<Vec<f64>> = policies
        .iter()
        .map(|&p| {
            columns
                .iter()
                .map(|&c| run(p, (raw as f64 * c) as usize))
                .collect()
        })
        .collect();
    for (p, row) in policies.iter().zip(&table) {
        print!("{:>16}", p.to_string());
        for r in row {
            print!("{r:>8.3}");
        }
        println!();
    }
    for (ci, c) in columns.iter().enumerate() {
        let best = table
            .iter()
            .map(|row| row[ci])
            .fold(f64::INFINITY, f64::min);
        let dac = table[0][ci];
        assert!(
            dac <= best * 1.10 + 1e-9,
            "budget {c}x raw: DAC {dac:.3} RTs/op vs best {best:.3}"
        );
    }
}
