//! The SLO policy engine (DINOMO section 3.5, Table 4): once per decision epoch it turns the
//! epoch's statistics ([`EpochStats`]) into at most one [`Decision`].
//!
//! [`evaluate`] is a pure function of the configuration and the statistics. [`PolicyState`]
//! adds the only memory the policy has: when membership last changed, to enforce the grace
//! period. The monitor carries the decisions out; nothing here talks to the cluster.
//!
//! The rules, in the order they are tried:
//!
//! | SLO       | KN occupancy                                 | key access frequency  | action         |
//! |-----------|----------------------------------------------|-----------------------|----------------|
//! | violated  | high: minimum occupancy > `over_utilized`    | -                     | add a KN       |
//! | violated  | normal: not all KNs over-utilised            | high: hot keys        | replicate them |
//! | satisfied | low: some KN occupancy < `under_utilized`    | -                     | remove that KN |
//! | satisfied | normal: no KN under-utilised                 | low: cold replicated  | de-replicate   |
//!
//! Definitions and choices:
//! - The SLO is violated when the average latency exceeds `avg_latency_slo_us` or the p99
//!   exceeds `tail_latency_slo_us`.
//! - With no client latency report at all this epoch, no data is not a violation: the engine
//!   takes no latency-driven action (no add, no replication), but the SLO is not violated either,
//!   so it may still de-replicate cold keys and remove an under-utilised KN, but only one that
//!   served no request this epoch. Without latency data nothing says the other KNs would absorb
//!   a serving KN's load within the SLO, and low occupancy alone does not make a KN idle: a
//!   steady benchmark whose clients did not report was once taken for an idle cluster.
//! - A key is hot when its count exceeds mean + `hot_key_sigmas` standard deviations of the
//!   reported keys' counts AND it carries at least `min_hot_key_share` of all requests of the
//!   epoch. KNs report only their top keys; the share bound keeps a near-uniform load from
//!   ever replicating. (With n reported keys no key can exceed mean + z·σ for z >= sqrt(n-1),
//!   so at 3σ at least 11 keys must be reported.)
//! - A replicated key is cold when its count is below mean - `cold_key_sigmas` standard
//!   deviations; a replicated key missing from the reports counts 0. When no key is reported
//!   at all, nothing is judged cold (there are no statistics to judge by).
//! - Replication factor of a hot key: R = ceil(latency at its owner KN / average-latency SLO),
//!   falling back to the overall average latency when the owner has no report; at least 2; for
//!   a key already replicated R_old times, max(R_old + 1, R); always capped at the number of
//!   KNs and at `max_replication` (0 = no cap beyond the KN count). Keys already at the cap are
//!   left alone; at most `max_hot_keys_per_epoch` keys per decision, hottest first.
//! - Add: never above `max_kns`. Remove: never below `min_kns`; the least-occupied
//!   under-utilised KN goes. At most one KN is added or removed per decision. When a removal
//!   is impossible only because of `min_kns`, de-replication is still considered (a KN that
//!   cannot leave must not keep useless replicas alive).
//! - An add with every KN over-utilised is not replaced by replication when `max_kns` is
//!   reached: replication would only move load between over-utilised KNs.
//!
//! Grace period ([`PolicyState`]): after a membership change (an add or remove decided here,
//! or a failure recovery the monitor reports through [`PolicyState::note_membership_change`]),
//! every change — membership and replication — is held for `grace_period_ms`, so the system
//! stabilises before the next decision. A held change is returned as [`Decision::None`] whose
//! reason says what would have been done. The grace period starts when the change is decided,
//! whether or not carrying it out later succeeds, so a failing action is not retried each
//! epoch. Replication decisions do not start a grace period: escalating a key's factor by one
//! each epoch while the SLO stays violated is the intended behaviour.
//!
//! Inputs are assumed sane: occupancies in 0..=1 and finite latencies (a NaN compares false
//! and so never triggers an action).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dinomo_placement::KnId;

use crate::config::PolicyConfig;

/// One live KN's statistics for the epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct KnEpoch {
    pub id: KnId,
    /// Share of the epoch the KN was busy, 0..=1.
    pub occupancy: f64,
    /// Requests it served this epoch.
    pub ops: u64,
}

/// One key's access count for the epoch, aggregated across KNs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFreq {
    pub key: Vec<u8>,
    pub count: u64,
    /// The key's owner on the ring (whose latency decides its replication factor).
    pub owner: KnId,
}

/// Everything the policy looks at for one decision.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EpochStats {
    pub epoch: u64,
    /// Live KNs in the current map.
    pub kns: Vec<KnEpoch>,
    /// Average client latency, microseconds; `None`: no client reports this epoch.
    pub avg_latency_us: Option<f64>,
    /// p99 client latency, microseconds.
    pub p99_latency_us: Option<f64>,
    /// Average client latency per KN, microseconds.
    pub kn_latency_us: BTreeMap<KnId, f64>,
    /// Top keys reported by the KNs, one entry per key (duplicates are summed).
    pub keys: Vec<KeyFreq>,
    /// All requests served by all KNs this epoch.
    pub total_ops: u64,
    /// Currently replicated keys and their replication factors.
    pub replicated: BTreeMap<Vec<u8>, u32>,
}

/// What the policy wants done this epoch.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    None {
        reason: String,
    },
    AddKn {
        reason: String,
    },
    RemoveKn {
        kn: KnId,
        reason: String,
    },
    /// Each key with its new replication factor (>= 2).
    Replicate {
        keys: Vec<(Vec<u8>, u32)>,
        reason: String,
    },
    Dereplicate {
        keys: Vec<Vec<u8>>,
        reason: String,
    },
}

impl Decision {
    /// "none", "add_kn", "remove_kn", "replicate" or "dereplicate" (logs, metrics, Status).
    pub fn action(&self) -> &'static str {
        match self {
            Decision::None { .. } => "none",
            Decision::AddKn { .. } => "add_kn",
            Decision::RemoveKn { .. } => "remove_kn",
            Decision::Replicate { .. } => "replicate",
            Decision::Dereplicate { .. } => "dereplicate",
        }
    }

    /// Why, with the numbers that triggered it.
    pub fn reason(&self) -> &str {
        match self {
            Decision::None { reason }
            | Decision::AddKn { reason }
            | Decision::RemoveKn { reason, .. }
            | Decision::Replicate { reason, .. }
            | Decision::Dereplicate { reason, .. } => reason,
        }
    }

    /// Whether it adds or removes a KN (and so starts a grace period).
    pub fn changes_membership(&self) -> bool {
        matches!(self, Decision::AddKn { .. } | Decision::RemoveKn { .. })
    }
}

/// The policy's memory between epochs: when membership last changed.
#[derive(Debug, Clone, Default)]
pub struct PolicyState {
    last_membership_change: Option<Instant>,
}

impl PolicyState {
    pub fn new() -> Self {
        PolicyState::default()
    }

    /// [`evaluate`], then the grace period: a change decided during it is held (returned as
    /// `None`); an add or remove decided outside it starts a new one.
    pub fn decide(&mut self, cfg: &PolicyConfig, stats: &EpochStats, now: Instant) -> Decision {
        let decision = evaluate(cfg, stats);
        if matches!(decision, Decision::None { .. }) {
            return decision;
        }
        if self.in_grace(cfg, now) {
            return Decision::None {
                reason: format!(
                    "held: {:.1} s of the {} s grace period after the last membership change \
                     remain; would {}: {}",
                    self.grace_left(cfg, now).as_secs_f64(),
                    cfg.grace_period().as_secs_f64(),
                    decision.action(),
                    decision.reason()
                ),
            };
        }
        if decision.changes_membership() {
            self.note_membership_change(now);
        }
        decision
    }

    /// Starts a grace period at `now` (the monitor calls it after a failure recovery too).
    pub fn note_membership_change(&mut self, now: Instant) {
        self.last_membership_change = Some(now);
    }

    pub fn in_grace(&self, cfg: &PolicyConfig, now: Instant) -> bool {
        !self.grace_left(cfg, now).is_zero()
    }

    /// Time until the grace period ends (zero when not in one).
    pub fn grace_left(&self, cfg: &PolicyConfig, now: Instant) -> Duration {
        match self.last_membership_change {
            None => Duration::ZERO,
            Some(at) => cfg
                .grace_period()
                .saturating_sub(now.saturating_duration_since(at)),
        }
    }

    pub fn last_membership_change(&self) -> Option<Instant> {
        self.last_membership_change
    }
}

/// The policy of Table 4 as a pure function (no grace period; see [`PolicyState::decide`]).
pub fn evaluate(cfg: &PolicyConfig, stats: &EpochStats) -> Decision {
    if stats.kns.is_empty() {
        return none("no live KN in the map".to_string());
    }
    match slo(cfg, stats) {
        Slo::Violated(why) => on_violation(cfg, stats, &why),
        Slo::Met(why) => on_slo_met(cfg, stats, &why, true),
        Slo::NoReports => on_slo_met(
            cfg,
            stats,
            "no client latency reports this epoch (so no add or replication)",
            false,
        ),
    }
}

/// Under-utilised KNs (occupancy < `under_utilized`), least occupied first (then fewest
/// requests, then lowest id). A removal decision names the first; an orchestrator that can
/// only remove some KNs may pick another from this list.
pub fn removal_candidates(cfg: &PolicyConfig, stats: &EpochStats) -> Vec<KnId> {
    let mut under: Vec<&KnEpoch> = stats
        .kns
        .iter()
        .filter(|k| k.occupancy < cfg.under_utilized)
        .collect();
    under.sort_by(|a, b| {
        a.occupancy
            .total_cmp(&b.occupancy)
            .then(a.ops.cmp(&b.ops))
            .then(a.id.cmp(&b.id))
    });
    under.iter().map(|k| k.id).collect()
}

enum Slo {
    NoReports,
    Met(String),
    Violated(String),
}

fn slo(cfg: &PolicyConfig, stats: &EpochStats) -> Slo {
    let (avg, p99) = (stats.avg_latency_us, stats.p99_latency_us);
    if avg.is_none() && p99.is_none() {
        return Slo::NoReports;
    }
    let avg_slo = cfg.avg_latency_slo_us as f64;
    let tail_slo = cfg.tail_latency_slo_us as f64;
    let mut violations = Vec::new();
    if let Some(a) = avg.filter(|a| *a > avg_slo) {
        violations.push(format!("avg {} > avg SLO {}", ms(a), ms(avg_slo)));
    }
    if let Some(p) = p99.filter(|p| *p > tail_slo) {
        violations.push(format!("p99 {} > tail SLO {}", ms(p), ms(tail_slo)));
    }
    if violations.is_empty() {
        Slo::Met(format!(
            "SLO met (avg {} <= {}, p99 {} <= {})",
            avg.map_or("n/a".to_string(), ms),
            ms(avg_slo),
            p99.map_or("n/a".to_string(), ms),
            ms(tail_slo)
        ))
    } else {
        Slo::Violated(violations.join(" and "))
    }
}

fn on_violation(cfg: &PolicyConfig, stats: &EpochStats, why: &str) -> Decision {
    let n = stats.kns.len();
    let min_occ = min_occupancy(stats);
    if min_occ > cfg.over_utilized {
        let high = format!(
            "{why} and min occupancy {min_occ:.2} > {:.2}: all KNs over-utilised",
            cfg.over_utilized
        );
        if n >= cfg.max_kns as usize {
            return none(format!("{high}, but already at max_kns = {}", cfg.max_kns));
        }
        return Decision::AddKn {
            reason: format!("{high}; adding a KN ({n} -> {})", n + 1),
        };
    }
    let normal = format!(
        "{why}, min occupancy {min_occ:.2} <= {:.2} (not all KNs over-utilised)",
        cfg.over_utilized
    );
    let counts = key_counts(stats);
    let (mean, sigma) = mean_sigma(&counts);
    let bound = mean + cfg.hot_key_sigmas * sigma;
    let total = stats.total_ops.max(counts.values().map(|c| c.0).sum());
    let share = |count: u64| {
        if total == 0 {
            0.0
        } else {
            count as f64 / total as f64
        }
    };
    let mut hot: Vec<(&[u8], u64, KnId)> = counts
        .iter()
        .filter(|(_, (count, _))| *count as f64 > bound && share(*count) >= cfg.min_hot_key_share)
        .map(|(key, (count, owner))| (*key, *count, *owner))
        .collect();
    let hot_rule = format!(
        "count > mean {mean:.1} + {}σ = {bound:.1} and share >= {}",
        cfg.hot_key_sigmas, cfg.min_hot_key_share
    );
    if hot.is_empty() {
        return none(format!("{normal}, and no hot key ({hot_rule})"));
    }
    // Hottest first; ties by key so the decision is deterministic.
    hot.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let cap = replication_cap(cfg, n);
    let avg_slo = cfg.avg_latency_slo_us as f64;
    let mut keys = Vec::new();
    let mut details = Vec::new();
    let mut at_cap = 0;
    for (key, count, owner) in &hot {
        if keys.len() == cfg.max_hot_keys_per_epoch {
            break;
        }
        let latency = stats
            .kn_latency_us
            .get(owner)
            .copied()
            .or(stats.avg_latency_us);
        // `as` saturates, so an absurd latency gives u32::MAX, then the cap.
        let from_latency = latency.map_or(0, |l| (l / avg_slo).ceil() as u32);
        let old = stats.replicated.get(*key).copied();
        let wanted = match old {
            None => from_latency.max(2),
            Some(r) => from_latency.max(r.saturating_add(1)).max(2),
        };
        let new = wanted.min(cap);
        if new < 2 || new <= old.unwrap_or(1) {
            at_cap += 1;
            continue;
        }
        keys.push((key.to_vec(), new));
        details.push(format!(
            "{} R {} -> {new} (count {count}, share {:.3}, latency {} at owner KN {owner})",
            show_key(key),
            old.unwrap_or(1),
            share(*count),
            latency.map_or("n/a".to_string(), ms),
        ));
    }
    if keys.is_empty() {
        return none(format!(
            "{normal}; {} hot key(s) ({hot_rule}) already at the highest replication factor {cap}",
            hot.len()
        ));
    }
    let mut reason = format!(
        "{normal}; {} hot key(s) ({hot_rule}): {}",
        hot.len(),
        list(&details)
    );
    if at_cap > 0 {
        reason.push_str(&format!("; {at_cap} already at the cap {cap}"));
    }
    Decision::Replicate { keys, reason }
}

/// `reports`: clients reported latencies this epoch. Without them only an idle KN (no
/// request this epoch) may be removed (module doc).
fn on_slo_met(cfg: &PolicyConfig, stats: &EpochStats, why: &str, reports: bool) -> Decision {
    let n = stats.kns.len();
    let mut candidates = removal_candidates(cfg, stats);
    let serving = if reports {
        None
    } else {
        let ops = |id: KnId| stats.kns.iter().find(|k| k.id == id).map_or(0, |k| k.ops);
        let first = candidates.first().map(|&kn| (kn, ops(kn)));
        candidates.retain(|&kn| ops(kn) == 0);
        first.filter(|&(_, ops)| ops > 0 && candidates.is_empty())
    };
    let occupancy_of = |kn: KnId| {
        stats
            .kns
            .iter()
            .find(|k| k.id == kn)
            .map_or(0.0, |k| k.occupancy)
    };
    let occupancy = match (serving, candidates.first()) {
        (Some((kn, ops)), _) => format!(
            "KN {kn} occupancy {:.2} < {:.2}, but it served {ops} requests this epoch and \
             without latency reports its removal cannot be judged safe (only an idle KN goes)",
            occupancy_of(kn),
            cfg.under_utilized
        ),
        (None, Some(&kn)) => {
            let low = format!(
                "KN {kn} occupancy {:.2} < {:.2} (least occupied of {} under-utilised KN(s))",
                occupancy_of(kn),
                cfg.under_utilized,
                candidates.len()
            );
            if n > cfg.min_kns as usize {
                return Decision::RemoveKn {
                    kn,
                    reason: format!("{why} and {low}; removing it ({n} -> {})", n - 1),
                };
            }
            format!("{low}, but already at min_kns = {}", cfg.min_kns)
        }
        (None, None) => format!(
            "no KN under-utilised (min occupancy {:.2} >= {:.2})",
            min_occupancy(stats),
            cfg.under_utilized
        ),
    };
    if stats.replicated.is_empty() {
        return none(format!("{why}; {occupancy}; no replicated key"));
    }
    let counts = key_counts(stats);
    if counts.is_empty() {
        return none(format!(
            "{why}; {occupancy}; no key statistics this epoch to judge the {} replicated key(s)",
            stats.replicated.len()
        ));
    }
    let (mean, sigma) = mean_sigma(&counts);
    let bound = mean - cfg.cold_key_sigmas * sigma;
    let cold_rule = format!(
        "count < mean {mean:.1} - {}σ = {bound:.1}",
        cfg.cold_key_sigmas
    );
    let mut keys = Vec::new();
    let mut details = Vec::new();
    for key in stats.replicated.keys() {
        // A replicated key missing from the top-key reports was barely accessed: count 0.
        let count = counts.get(key.as_slice()).map_or(0, |c| c.0);
        if (count as f64) < bound {
            keys.push(key.clone());
            details.push(format!("{} (count {count})", show_key(key)));
        }
    }
    if keys.is_empty() {
        return none(format!(
            "{why}; {occupancy}; no cold replicated key ({cold_rule})"
        ));
    }
    Decision::Dereplicate {
        keys,
        reason: format!(
            "{why}; {occupancy}; {} replicated key(s) cold ({cold_rule}): {}",
            details.len(),
            list(&details)
        ),
    }
}

fn none(reason: String) -> Decision {
    Decision::None { reason }
}

fn min_occupancy(stats: &EpochStats) -> f64 {
    stats
        .kns
        .iter()
        .map(|k| k.occupancy)
        .fold(f64::INFINITY, f64::min)
}

/// The highest replication factor allowed with `n` KNs: a key cannot have more replicas than
/// there are KNs.
fn replication_cap(cfg: &PolicyConfig, n: usize) -> u32 {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    if cfg.max_replication == 0 {
        n
    } else {
        cfg.max_replication.min(n)
    }
}

/// Reported keys -> (count, owner), summing duplicates (the first owner wins).
fn key_counts(stats: &EpochStats) -> BTreeMap<&[u8], (u64, KnId)> {
    let mut counts: BTreeMap<&[u8], (u64, KnId)> = BTreeMap::new();
    for k in &stats.keys {
        let entry = counts.entry(k.key.as_slice()).or_insert((0, k.owner));
        entry.0 = entry.0.saturating_add(k.count);
    }
    counts
}

/// Mean and population standard deviation of the counts (0, 0 when empty).
fn mean_sigma(counts: &BTreeMap<&[u8], (u64, KnId)>) -> (f64, f64) {
    if counts.is_empty() {
        return (0.0, 0.0);
    }
    let n = counts.len() as f64;
    let mean = counts.values().map(|c| c.0 as f64).sum::<f64>() / n;
    let variance = counts
        .values()
        .map(|c| (c.0 as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, variance.sqrt())
}

/// Microseconds as milliseconds, to 0.01 ms, without trailing zeros ("16 ms", "18.2 ms").
fn ms(us: f64) -> String {
    format!("{} ms", (us / 10.0).round() / 100.0)
}

/// A key for a reason string: quoted and escaped, cut after 32 bytes.
fn show_key(key: &[u8]) -> String {
    const SHOWN: usize = 32;
    let mut s = format!(
        "{:?}",
        String::from_utf8_lossy(&key[..key.len().min(SHOWN)])
    );
    if key.len() > SHOWN {
        s.push_str("...");
    }
    s
}

/// At most 8 items, comma-separated, then how many were left out.
fn list(items: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = items
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > SHOWN {
        s.push_str(&format!(" and {} more", items.len() - SHOWN));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PolicyConfig {
        PolicyConfig::default()
    }

    /// Live KNs with these occupancies (ids 0..), SLO met (0.5 ms avg, 5 ms p99), no keys.
    fn stats(occupancies: &[f64]) -> EpochStats {
        EpochStats {
            epoch: 7,
            kns: occupancies
                .iter()
                .enumerate()
                .map(|(i, &occupancy)| KnEpoch {
                    id: i as KnId,
                    occupancy,
                    ops: 1000,
                })
                .collect(),
            avg_latency_us: Some(500.0),
            p99_latency_us: Some(5000.0),
            ..EpochStats::default()
        }
    }

    fn violated(mut s: EpochStats) -> EpochStats {
        s.avg_latency_us = Some(900.0);
        s.p99_latency_us = Some(18_200.0);
        s
    }

    fn key(name: &str, count: u64, owner: KnId) -> KeyFreq {
        KeyFreq {
            key: name.as_bytes().to_vec(),
            count,
            owner,
        }
    }

    /// 30 background keys of count 100 on KN 0 plus a key "hot" of count 5000 owned by
    /// `owner`: mean 258, σ 865, so the 3σ bound is about 2854 and "hot" has share 0.62.
    fn with_hot_key(mut s: EpochStats, owner: KnId) -> EpochStats {
        s.keys = (0..30).map(|i| key(&format!("bg{i:02}"), 100, 0)).collect();
        s.keys.push(key("hot", 5000, owner));
        s.total_ops = 8000;
        s
    }

    fn replicated(keys: &[(&str, u32)]) -> BTreeMap<Vec<u8>, u32> {
        keys.iter()
            .map(|(k, r)| (k.as_bytes().to_vec(), *r))
            .collect()
    }

    fn expect_replicate(d: &Decision) -> &[(Vec<u8>, u32)] {
        match d {
            Decision::Replicate { keys, .. } => keys,
            other => panic!("expected replicate, got {other:?}"),
        }
    }

    fn expect_none(d: &Decision) -> &str {
        match d {
            Decision::None { reason } => reason,
            other => panic!("expected none, got {other:?}"),
        }
    }

    // Row 1: SLO satisfied, a KN under-utilised -> remove it.

    #[test]
    fn slo_met_and_an_under_utilised_kn_removes_the_least_occupied_one() {
        let s = stats(&[0.30, 0.08, 0.05, 0.09]);
        let d = evaluate(&cfg(), &s);
        assert_eq!(d.action(), "remove_kn");
        let Decision::RemoveKn { kn, reason } = &d else {
            panic!("{d:?}")
        };
        // Three KNs are under-utilised; exactly one, the least occupied, goes.
        assert_eq!(*kn, 2);
        assert!(reason.contains("KN 2 occupancy 0.05 < 0.10"), "{reason}");
        assert!(reason.contains("of 3 under-utilised"), "{reason}");
        assert!(reason.contains("4 -> 3"), "{reason}");
        assert_eq!(removal_candidates(&cfg(), &s), vec![2, 1, 3]);
    }

    #[test]
    fn removal_ties_go_to_fewer_requests_then_lower_id() {
        let mut s = stats(&[0.05, 0.05, 0.05]);
        s.kns[0].ops = 10;
        s.kns[1].ops = 5;
        s.kns[2].ops = 5;
        assert_eq!(removal_candidates(&cfg(), &s), vec![1, 2, 0]);
    }

    #[test]
    fn slo_met_without_under_utilised_kn_or_replicas_does_nothing() {
        let d = evaluate(&cfg(), &stats(&[0.15, 0.10, 0.50]));
        let reason = expect_none(&d);
        assert!(reason.contains("SLO met (avg 0.5 ms <= 1.2 ms"), "{reason}");
        assert!(reason.contains("min occupancy 0.10 >= 0.10"), "{reason}");
    }

    #[test]
    fn slo_violated_does_not_remove_an_under_utilised_kn() {
        // Under-utilised KN 1 but the SLO is violated and no key is hot: no removal.
        let d = evaluate(&cfg(), &violated(stats(&[0.30, 0.02])));
        expect_none(&d);
    }

    #[test]
    fn removal_never_goes_below_min_kns() {
        let d = evaluate(&cfg(), &stats(&[0.01]));
        let reason = expect_none(&d);
        assert!(reason.contains("already at min_kns = 1"), "{reason}");
        let c = PolicyConfig {
            min_kns: 3,
            ..cfg()
        };
        expect_none(&evaluate(&c, &stats(&[0.01, 0.02, 0.5])));
        assert_eq!(
            evaluate(&c, &stats(&[0.01, 0.02, 0.5, 0.5])).action(),
            "remove_kn"
        );
    }

    // Row 2: SLO violated, every KN over-utilised -> add a KN.

    #[test]
    fn slo_violated_and_all_kns_over_utilised_adds_a_kn() {
        let d = evaluate(&cfg(), &violated(stats(&[0.35, 0.60, 0.90])));
        assert_eq!(d.action(), "add_kn");
        assert_eq!(
            d.reason(),
            "p99 18.2 ms > tail SLO 16 ms and min occupancy 0.35 > 0.20: all KNs \
             over-utilised; adding a KN (3 -> 4)"
        );
    }

    #[test]
    fn average_latency_alone_can_violate_the_slo() {
        let mut s = stats(&[0.5, 0.5]);
        s.avg_latency_us = Some(1500.0);
        let d = evaluate(&cfg(), &s);
        assert_eq!(d.action(), "add_kn");
        assert!(
            d.reason().starts_with("avg 1.5 ms > avg SLO 1.2 ms"),
            "{}",
            d.reason()
        );
    }

    #[test]
    fn slo_violated_but_not_all_over_utilised_and_no_hot_key_does_nothing() {
        // One KN at exactly the bound is not over-utilised (strictly above is).
        let mut s = violated(stats(&[0.20, 0.90, 0.90]));
        s.keys = (0..40).map(|i| key(&format!("k{i:02}"), 100, 0)).collect();
        s.total_ops = 4000;
        let d = evaluate(&cfg(), &s);
        let reason = expect_none(&d);
        assert!(reason.contains("min occupancy 0.20 <= 0.20"), "{reason}");
        assert!(reason.contains("no hot key"), "{reason}");
    }

    #[test]
    fn add_never_goes_above_max_kns() {
        let c = PolicyConfig {
            max_kns: 3,
            ..cfg()
        };
        let d = evaluate(&c, &violated(stats(&[0.5, 0.5, 0.5])));
        assert!(expect_none(&d).contains("already at max_kns = 3"), "{d:?}");
        assert_eq!(
            evaluate(&c, &violated(stats(&[0.5, 0.5]))).action(),
            "add_kn"
        );
    }

    #[test]
    fn no_latency_reports_never_add_or_replicate() {
        let mut s = with_hot_key(stats(&[0.9, 0.9, 0.9]), 1);
        s.avg_latency_us = None;
        s.p99_latency_us = None;
        let reason = expect_none(&evaluate(&cfg(), &s)).to_string();
        assert!(reason.contains("no client latency reports"), "{reason}");
        // Not all over-utilised, a hot key, still no reports: no replication either.
        s.kns[0].occupancy = 0.15;
        expect_none(&evaluate(&cfg(), &s));
    }

    /// Issue 12: during a steady `dinomo bench` whose clients did not report latencies, the
    /// monitor removed a KN at occupancy 0.08 that was serving thousands of requests an epoch.
    /// With no SLO data the engine cannot tell that the others would absorb its load.
    #[test]
    fn no_latency_reports_never_remove_a_serving_kn() {
        let mut s = stats(&[0.5, 0.08]);
        s.avg_latency_us = None;
        s.p99_latency_us = None;
        let reason = expect_none(&evaluate(&cfg(), &s)).to_string();
        assert!(
            reason.contains("KN 1 occupancy 0.08 < 0.10, but it served 1000 requests"),
            "{reason}"
        );
        // Occupancy alone does not make it idle; having served nothing does.
        s.kns[1].ops = 0;
        assert_eq!(evaluate(&cfg(), &s).action(), "remove_kn");
    }

    #[test]
    fn no_latency_reports_may_still_remove_and_dereplicate() {
        let mut s = stats(&[0.5, 0.01]);
        s.avg_latency_us = None;
        s.p99_latency_us = None;
        // Only an idle KN may go without latency data (see the test above).
        s.kns[1].ops = 0;
        let d = evaluate(&cfg(), &s);
        assert_eq!(
            d,
            Decision::RemoveKn {
                kn: 1,
                reason: d.reason().to_string()
            }
        );
        assert!(d.reason().starts_with("no client latency reports"), "{d:?}");

        let mut s = stats(&[0.5, 0.5]);
        s.avg_latency_us = None;
        s.p99_latency_us = None;
        s.keys = (0..20).map(|i| key(&format!("k{i:02}"), 100, 0)).collect();
        s.replicated = replicated(&[("gone", 2)]);
        assert_eq!(evaluate(&cfg(), &s).action(), "dereplicate");
    }

    #[test]
    fn no_live_kn_does_nothing() {
        let d = evaluate(&cfg(), &violated(stats(&[])));
        assert_eq!(d.action(), "none");
    }

    // Row 3: SLO violated, occupancy normal, hot keys -> replicate them.

    #[test]
    fn hot_key_is_replicated_by_its_owner_latency_over_the_slo() {
        let mut s = with_hot_key(violated(stats(&[0.30, 0.50, 0.10, 0.15])), 1);
        s.kn_latency_us.insert(1, 3500.0);
        s.kn_latency_us.insert(0, 400.0);
        let d = evaluate(&cfg(), &s);
        // ceil(3.5 ms / 1.2 ms) = 3.
        assert_eq!(expect_replicate(&d), &[(b"hot".to_vec(), 3)]);
        let reason = d.reason();
        assert!(reason.contains("min occupancy 0.10 <= 0.20"), "{reason}");
        assert!(reason.contains("\"hot\" R 1 -> 3"), "{reason}");
        assert!(reason.contains("count 5000, share 0.625"), "{reason}");
        assert!(reason.contains("3.5 ms at owner KN 1"), "{reason}");
    }

    #[test]
    fn replication_factor_is_at_least_two() {
        let mut s = with_hot_key(violated(stats(&[0.3, 0.5, 0.1])), 1);
        s.kn_latency_us.insert(1, 300.0);
        assert_eq!(
            expect_replicate(&evaluate(&cfg(), &s)),
            &[(b"hot".to_vec(), 2)]
        );
    }

    #[test]
    fn replication_factor_falls_back_to_the_average_latency() {
        // The owner KN 2 has no latency report: the overall 5 ms average gives ceil(4.17) = 5.
        let mut s = with_hot_key(violated(stats(&[0.3; 8])), 2);
        s.kns[0].occupancy = 0.1;
        s.avg_latency_us = Some(5000.0);
        s.kn_latency_us.insert(1, 100.0);
        assert_eq!(
            expect_replicate(&evaluate(&cfg(), &s)),
            &[(b"hot".to_vec(), 5)]
        );
    }

    #[test]
    fn replication_factor_is_capped_by_kns_and_max_replication() {
        let mut s = with_hot_key(violated(stats(&[0.3, 0.1])), 1);
        s.kn_latency_us.insert(1, 10_000.0);
        // ceil(10 / 1.2) = 9, but there are 2 KNs.
        assert_eq!(
            expect_replicate(&evaluate(&cfg(), &s)),
            &[(b"hot".to_vec(), 2)]
        );
        let mut s = with_hot_key(violated(stats(&[0.3, 0.1, 0.3, 0.3, 0.3, 0.3])), 1);
        s.kn_latency_us.insert(1, 10_000.0);
        assert_eq!(
            expect_replicate(&evaluate(&cfg(), &s)),
            &[(b"hot".to_vec(), 6)]
        );
        let c = PolicyConfig {
            max_replication: 4,
            ..cfg()
        };
        assert_eq!(expect_replicate(&evaluate(&c, &s)), &[(b"hot".to_vec(), 4)]);
    }

    #[test]
    fn a_single_kn_cannot_replicate() {
        let s = with_hot_key(violated(stats(&[0.1])), 0);
        let d = evaluate(&cfg(), &s);
        assert!(
            expect_none(&d).contains("already at the highest replication factor 1"),
            "{d:?}"
        );
    }

    #[test]
    fn still_hot_replicated_key_escalates() {
        let mut s = with_hot_key(violated(stats(&[0.3, 0.1, 0.3, 0.3, 0.3, 0.3])), 1);
        s.kn_latency_us.insert(1, 3500.0);
        s.replicated = replicated(&[("hot", 3)]);
        // Computed 3, already 3: one more.
        let d = evaluate(&cfg(), &s);
        assert_eq!(expect_replicate(&d), &[(b"hot".to_vec(), 4)]);
        assert!(d.reason().contains("R 3 -> 4"), "{d:?}");
        // The latency asks for more than R_old + 1: the latency wins.
        s.kn_latency_us.insert(1, 6000.0);
        assert_eq!(
            expect_replicate(&evaluate(&cfg(), &s)),
            &[(b"hot".to_vec(), 5)]
        );
        // At the cap (6 KNs): nothing more to do.
        s.replicated = replicated(&[("hot", 6)]);
        let d = evaluate(&cfg(), &s);
        assert!(
            expect_none(&d).contains("already at the highest replication factor 6"),
            "{d:?}"
        );
    }

    #[test]
    fn at_most_max_hot_keys_per_epoch_hottest_first() {
        // 988 keys of count 10 and 12 of counts 10000..10011: mean 130, σ about 1090.
        let mut s = violated(stats(&[0.3, 0.1, 0.3]));
        s.keys = (0..988).map(|i| key(&format!("bg{i:03}"), 10, 0)).collect();
        for i in 0..12u64 {
            s.keys.push(key(&format!("hot{i:02}"), 10_000 + i, 1));
        }
        s.total_ops = s.keys.iter().map(|k| k.count).sum();
        let d = evaluate(&cfg(), &s);
        let keys = expect_replicate(&d);
        assert_eq!(keys.len(), 8);
        let names: Vec<String> = keys
            .iter()
            .map(|(k, _)| String::from_utf8(k.clone()).unwrap())
            .collect();
        assert_eq!(names[0], "hot11");
        assert_eq!(names[7], "hot04");
        assert!(d.reason().contains("12 hot key(s)"), "{d:?}");
        assert!(!d.reason().contains(" more"), "{d:?}");
    }

    #[test]
    fn mild_skew_never_replicates() {
        // 200 near-uniform keys (count 95..=105) and one at 140: above mean + 3σ, but only
        // 0.7% of the requests, below min_hot_key_share.
        let mut s = violated(stats(&[0.3, 0.1, 0.3]));
        s.keys = (0..200u64)
            .map(|i| key(&format!("k{i:03}"), 95 + i % 11, 0))
            .collect();
        s.keys.push(key("warm", 140, 1));
        s.total_ops = s.keys.iter().map(|k| k.count).sum();
        let reason = expect_none(&evaluate(&cfg(), &s)).to_string();
        assert!(reason.contains("no hot key"), "{reason}");
        // Without the share bound the sigma bound alone would have replicated it.
        let no_share = PolicyConfig {
            min_hot_key_share: 0.0,
            ..cfg()
        };
        assert_eq!(evaluate(&no_share, &s).action(), "replicate");

        // 20 near-uniform keys, each about 5% of the load: the share bound passes, the sigma
        // bound does not.
        let mut s = violated(stats(&[0.3, 0.1, 0.3]));
        s.keys = (0..20u64)
            .map(|i| key(&format!("k{i:02}"), 95 + i % 11, 0))
            .collect();
        s.total_ops = s.keys.iter().map(|k| k.count).sum();
        expect_none(&evaluate(&cfg(), &s));
    }

    // Row 4: SLO satisfied, occupancy normal, cold replicated keys -> de-replicate.

    #[test]
    fn cold_replicated_key_is_dereplicated() {
        let mut s = stats(&[0.3, 0.3, 0.3]);
        s.keys = (0..20).map(|i| key(&format!("k{i:02}"), 100, 0)).collect();
        s.keys.push(key("was-hot", 2, 1));
        s.replicated = replicated(&[("was-hot", 3)]);
        let d = evaluate(&cfg(), &s);
        assert_eq!(
            d,
            Decision::Dereplicate {
                keys: vec![b"was-hot".to_vec()],
                reason: d.reason().to_string()
            }
        );
        assert!(d.reason().contains("\"was-hot\" (count 2)"), "{d:?}");
        assert!(d.reason().contains("SLO met"), "{d:?}");
    }

    #[test]
    fn replicated_key_missing_from_the_reports_counts_zero() {
        let mut s = stats(&[0.3, 0.3]);
        s.keys = (0..20).map(|i| key(&format!("k{i:02}"), 100, 0)).collect();
        s.replicated = replicated(&[("gone", 2), ("k03", 2)]);
        let d = evaluate(&cfg(), &s);
        // "k03" is as busy as any reported key: it stays replicated.
        assert_eq!(
            d,
            Decision::Dereplicate {
                keys: vec![b"gone".to_vec()],
                reason: d.reason().to_string()
            }
        );
        assert!(d.reason().contains("\"gone\" (count 0)"), "{d:?}");
    }

    #[test]
    fn still_busy_replicated_key_is_kept() {
        let mut s = with_hot_key(stats(&[0.3, 0.3]), 1);
        s.replicated = replicated(&[("hot", 2)]);
        let reason = expect_none(&evaluate(&cfg(), &s)).to_string();
        assert!(reason.contains("no cold replicated key"), "{reason}");
    }

    #[test]
    fn slo_violated_never_dereplicates() {
        let mut s = violated(stats(&[0.3, 0.1]));
        s.keys = (0..20).map(|i| key(&format!("k{i:02}"), 100, 0)).collect();
        s.replicated = replicated(&[("gone", 2)]);
        expect_none(&evaluate(&cfg(), &s));
    }

    #[test]
    fn removal_comes_before_dereplication() {
        let mut s = stats(&[0.3, 0.05]);
        s.keys = (0..20).map(|i| key(&format!("k{i:02}"), 100, 0)).collect();
        s.replicated = replicated(&[("gone", 2)]);
        assert_eq!(evaluate(&cfg(), &s).action(), "remove_kn");
        // With removal blocked by min_kns, de-replication still happens.
        let c = PolicyConfig {
            min_kns: 2,
            ..cfg()
        };
        let d = evaluate(&c, &s);
        assert_eq!(d.action(), "dereplicate");
        assert!(d.reason().contains("already at min_kns = 2"), "{d:?}");
    }

    #[test]
    fn no_key_statistics_keeps_replicas() {
        let mut s = stats(&[0.3, 0.3]);
        s.replicated = replicated(&[("gone", 2)]);
        let reason = expect_none(&evaluate(&cfg(), &s)).to_string();
        assert!(reason.contains("no key statistics"), "{reason}");
    }

    // Grace period.

    #[test]
    fn grace_period_holds_membership_changes_then_releases_them() {
        let c = cfg();
        let mut state = PolicyState::new();
        let t0 = Instant::now();
        assert!(!state.in_grace(&c, t0));
        let over = violated(stats(&[0.5, 0.5]));
        assert_eq!(state.decide(&c, &over, t0).action(), "add_kn");
        assert!(state.in_grace(&c, t0 + Duration::from_secs(1)));

        // One second later, still overloaded (the new KN is not in the map yet): held.
        let d = state.decide(&c, &over, t0 + Duration::from_secs(1));
        let reason = expect_none(&d);
        assert!(
            reason.contains("89.0 s of the 90 s grace period"),
            "{reason}"
        );
        assert!(reason.contains("would add_kn"), "{reason}");
        // A removal is held too.
        let low = stats(&[0.5, 0.5, 0.01]);
        expect_none(&state.decide(&c, &low, t0 + Duration::from_secs(89)));

        // Once the grace period is over the removal goes ahead and starts a new one.
        let t1 = t0 + Duration::from_secs(90);
        assert!(!state.in_grace(&c, t1));
        assert_eq!(state.decide(&c, &low, t1).action(), "remove_kn");
        assert_eq!(state.last_membership_change(), Some(t1));
        expect_none(&state.decide(&c, &low, t1 + Duration::from_secs(1)));
    }

    #[test]
    fn grace_period_holds_replication_too() {
        let c = cfg();
        let mut state = PolicyState::new();
        let t0 = Instant::now();
        state.note_membership_change(t0); // e.g. a failure recovery
        let mut s = with_hot_key(violated(stats(&[0.3, 0.1, 0.3])), 1);
        s.kn_latency_us.insert(1, 3500.0);
        let d = state.decide(&c, &s, t0 + Duration::from_secs(30));
        assert!(expect_none(&d).contains("would replicate"), "{d:?}");
        let later = t0 + c.grace_period();
        assert_eq!(state.decide(&c, &s, later).action(), "replicate");
        // A replication decision does not start a grace period: it may escalate next epoch.
        assert!(!state.in_grace(&c, later + c.epoch()));
        assert_eq!(state.last_membership_change(), Some(t0));
    }

    #[test]
    fn a_zero_grace_period_holds_nothing() {
        let c = PolicyConfig {
            grace_period_ms: 0,
            ..cfg()
        };
        let mut state = PolicyState::new();
        let t0 = Instant::now();
        let over = violated(stats(&[0.5, 0.5]));
        assert_eq!(state.decide(&c, &over, t0).action(), "add_kn");
        assert!(!state.in_grace(&c, t0));
        assert_eq!(state.decide(&c, &over, t0).action(), "add_kn");
    }

    #[test]
    fn decisions_that_change_nothing_do_not_start_a_grace_period() {
        let c = cfg();
        let mut state = PolicyState::new();
        let t0 = Instant::now();
        expect_none(&state.decide(&c, &stats(&[0.5, 0.5]), t0));
        assert!(!state.in_grace(&c, t0));
        assert_eq!(state.grace_left(&c, t0), Duration::ZERO);
    }

    #[test]
    fn actions_and_reasons() {
        let cases = [
            (Decision::None { reason: "a".into() }, "none"),
            (Decision::AddKn { reason: "a".into() }, "add_kn"),
            (
                Decision::RemoveKn {
                    kn: 1,
                    reason: "a".into(),
                },
                "remove_kn",
            ),
            (
                Decision::Replicate {
                    keys: vec![],
                    reason: "a".into(),
                },
                "replicate",
            ),
            (
                Decision::Dereplicate {
                    keys: vec![],
                    reason: "a".into(),
                },
                "dereplicate",
            ),
        ];
        for (d, action) in cases {
            assert_eq!(d.action(), action);
            assert_eq!(d.reason(), "a");
            assert_eq!(
                d.changes_membership(),
                action == "add_kn" || action == "remove_kn"
            );
        }
    }

    #[test]
    fn reason_helpers() {
        assert_eq!(ms(16_000.0), "16 ms");
        assert_eq!(ms(18_200.0), "18.2 ms");
        assert_eq!(ms(50.0), "0.05 ms");
        assert_eq!(show_key(b"k\n"), "\"k\\n\"");
        assert_eq!(show_key(&[b'x'; 40]), format!("\"{}\"...", "x".repeat(32)));
        let items: Vec<String> = (0..10).map(|i| i.to_string()).collect();
        assert_eq!(list(&items), "0, 1, 2, 3, 4, 5, 6, 7 and 2 more");
    }
}
