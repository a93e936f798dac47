//! The results of a bench run: [`Summary`] (serialised to the `--json` file) and its text
//! rendering (the table printed to stdout).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use dinomo_proto::kv::KnStatsResponse;
use hdrhistogram::Histogram;
use serde::Serialize;

use super::cpu::CpuUse;
use super::driver::Recorder;
use super::target::WriteMode;
use super::workload::{Mix, OpKind};
use crate::{thousands, Align, Table};

/// Latency figures of one operation type (or "ALL"), in microseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpLatency {
    /// "READ", "UPDATE", "INSERT", "READ-MODIFY-WRITE" or "ALL".
    pub op: String,
    /// Completed operations, failures included.
    pub ops: u64,
    /// Of which failed.
    pub errors: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl OpLatency {
    fn from_histogram(op: &str, h: &Histogram<u64>, errors: u64) -> Self {
        let us = |ns: u64| ns as f64 / 1000.0;
        OpLatency {
            op: op.to_string(),
            ops: h.len(),
            errors,
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.value_at_quantile(0.50)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }
}

/// What one phase (the load, or the measured run) did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseSummary {
    /// Completed, measured operations (failures included).
    pub ops: u64,
    /// Of which failed.
    pub errors: u64,
    /// Length of the measured part, in seconds.
    pub duration_s: f64,
    /// `ops / duration_s`.
    pub throughput_ops_per_s: f64,
    /// One row per operation type that ran, then "ALL".
    pub latency: Vec<OpLatency>,
    /// Failed operations by error kind ("not_found", "timeout", ...).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// The first message seen for each error kind.
    pub error_examples: BTreeMap<String, String>,
}

impl PhaseSummary {
    pub fn new(rec: &Recorder, measured: Duration) -> Self {
        let mut latency = Vec::new();
        for kind in OpKind::ALL {
            if let Some(h) = rec.histogram(kind) {
                latency.push(OpLatency::from_histogram(
                    kind.label(),
                    h,
                    rec.errors_of(kind),
                ));
            }
        }
        if let Some(all) = rec.overall() {
            latency.push(OpLatency::from_histogram("ALL", &all, rec.total_errors()));
        }
        let ops = rec.total_ops();
        let secs = measured.as_secs_f64();
        PhaseSummary {
            ops,
            errors: rec.total_errors(),
            duration_s: secs,
            throughput_ops_per_s: if secs > 0.0 { ops as f64 / secs } else { 0.0 },
            latency,
            errors_by_kind: rec.errors_by_kind().clone(),
            error_examples: rec.error_examples().clone(),
        }
    }
}

/// Counter deltas of Dinomo's KV nodes over the measured run (`KvService.Stats` before and
/// after; the "before" snapshot is taken at the end of the warm-up while the clients keep
/// running, so a handful of operations at that edge may fall on either side).
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct DinomoStats {
    /// KV nodes present in both snapshots.
    pub kns: usize,
    pub gets: u64,
    pub puts: u64,
    pub deletes: u64,
    /// Index lookups the KNs made (value, shortcut and unmerged hits plus misses); inserts and
    /// updates in strict mode look up too, so this can exceed `gets`.
    pub lookups: u64,
    pub value_hits: u64,
    pub shortcut_hits: u64,
    pub unmerged_hits: u64,
    pub misses: u64,
    /// Shares of `lookups` (0 when there were none).
    pub value_hit_ratio: f64,
    pub shortcut_hit_ratio: f64,
    pub unmerged_hit_ratio: f64,
    pub miss_ratio: f64,
    /// Fabric round trips the KNs made to the DPM.
    pub round_trips: u64,
    /// `round_trips / (gets + puts + deletes)`: per request a KN served.
    pub rts_per_op: f64,
    /// `round_trips / ops` of the benchmark (a read-modify-write is two KN requests).
    pub rts_per_client_op: f64,
    pub bytes_read_per_op: f64,
    pub bytes_written_per_op: f64,
    pub wrong_owner: u64,
}

impl DinomoStats {
    /// Sums `after - before` over the KNs present in both (matched by id).
    pub fn delta(before: &[KnStatsResponse], after: &[KnStatsResponse], client_ops: u64) -> Self {
        let mut s = DinomoStats::default();
        let (mut bytes_read, mut bytes_written) = (0u64, 0u64);
        for a in after {
            let Some(b) = before.iter().find(|b| b.kn_id == a.kn_id) else {
                continue;
            };
            let d = |x: u64, y: u64| x.saturating_sub(y);
            s.kns += 1;
            s.gets += d(a.gets, b.gets);
            s.puts += d(a.puts, b.puts);
            s.deletes += d(a.deletes, b.deletes);
            s.value_hits += d(a.value_hits, b.value_hits);
            s.shortcut_hits += d(a.shortcut_hits, b.shortcut_hits);
            s.unmerged_hits += d(a.unmerged_hits, b.unmerged_hits);
            s.misses += d(a.misses, b.misses);
            s.round_trips += d(a.round_trips, b.round_trips);
            s.wrong_owner += d(a.wrong_owner, b.wrong_owner);
            bytes_read += d(a.bytes_read, b.bytes_read);
            bytes_written += d(a.bytes_written, b.bytes_written);
        }
        s.lookups = s.value_hits + s.shortcut_hits + s.unmerged_hits + s.misses;
        let ratio = |x: u64, y: u64| if y > 0 { x as f64 / y as f64 } else { 0.0 };
        s.value_hit_ratio = ratio(s.value_hits, s.lookups);
        s.shortcut_hit_ratio = ratio(s.shortcut_hits, s.lookups);
        s.unmerged_hit_ratio = ratio(s.unmerged_hits, s.lookups);
        s.miss_ratio = ratio(s.misses, s.lookups);
        let kn_ops = s.gets + s.puts + s.deletes;
        s.rts_per_op = ratio(s.round_trips, kn_ops);
        s.rts_per_client_op = ratio(s.round_trips, client_ops);
        s.bytes_read_per_op = ratio(bytes_read, kn_ops);
        s.bytes_written_per_op = ratio(bytes_written, kn_ops);
        s
    }
}

/// Everything a bench run measured; printed as a table and written as JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Workload name ("a", "read95-insert5", ...).
    pub workload: String,
    /// Its operation mix.
    pub mix: Mix,
    /// The `--target` as given.
    pub target: String,
    /// "dinomo" or "redis".
    pub system: String,
    /// "zipfian", "uniform" or "latest".
    pub distribution: String,
    pub zipf_theta: f64,
    pub write_mode: WriteMode,
    pub records: u64,
    pub clients: usize,
    /// Connections the clients shared (`--connections`).
    pub connections: usize,
    /// Dinomo only: how the SDK reached the KV nodes (`wire` or `grpc`).
    pub kv_transport: Option<String>,
    /// Runtime threads of the bench process (`--threads`).
    pub threads: usize,
    pub outstanding: usize,
    pub key_size: usize,
    pub value_size: usize,
    pub seed: u64,
    pub warmup_s: f64,
    /// The `--operations` bound, if any.
    pub operations_limit: Option<u64>,
    /// The `--duration` bound in seconds, if any.
    pub duration_limit_s: Option<f64>,
    /// The load phase (`--load`).
    pub load: Option<PhaseSummary>,
    /// The measured run.
    pub run: PhaseSummary,
    /// Dinomo only: KV node counters over the measured run.
    pub dinomo: Option<DinomoStats>,
    /// Dinomo only: why the KV node counters could not be read.
    pub dinomo_stats_error: Option<String>,
    /// CPU per operation of the measured run: this process ("client") and every Dinomo node
    /// process on this machine ([`super::cpu`]); empty without /proc.
    pub cpu: Vec<CpuUse>,
}

fn us(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

impl Summary {
    /// Did keys go missing in a run that did not load them itself, more than a stray insert
    /// that failed (and is read later) explains? The likeliest cause for a new user is a
    /// cluster nobody loaded: a run reads keys it assumes exist (workload a on 5,000 keys not
    /// loaded: 7 % of its operations found none, the upserts creating the rest).
    fn may_have_skipped_the_load(&self) -> bool {
        let missing = self
            .run
            .errors_by_kind
            .get("not_found")
            .copied()
            .unwrap_or(0);
        self.load.is_none() && missing > 0 && missing * 100 >= self.run.ops
    }

    /// The text printed at the end of a run.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "workload {} ({}) against {}",
            self.workload,
            self.mix.describe(),
            self.target
        );
        let dist = if self.distribution == "uniform" {
            "uniform".to_string()
        } else {
            format!("{} theta {}", self.distribution, self.zipf_theta)
        };
        let _ = writeln!(
            out,
            "{dist}; {} records; key {} B, value {} B; {} clients x {} outstanding over {} connections{}, {} threads; {} writes; seed {}; warm-up {} s",
            thousands(self.records as f64),
            self.key_size,
            self.value_size,
            self.clients,
            self.outstanding,
            self.connections,
            self.kv_transport
                .as_ref()
                .map_or(String::new(), |t| format!(" (KV {t})")),
            self.threads,
            self.write_mode.name(),
            self.seed,
            self.warmup_s
        );
        out.push('\n');

        let mut phases = Table::new(&[
            ("phase", Align::Left),
            ("ops", Align::Right),
            ("duration s", Align::Right),
            ("ops/s", Align::Right),
            ("errors", Align::Right),
        ]);
        let phase_row = |name: &str, p: &PhaseSummary| {
            vec![
                name.to_string(),
                thousands(p.ops as f64),
                format!("{:.3}", p.duration_s),
                thousands(p.throughput_ops_per_s),
                thousands(p.errors as f64),
            ]
        };
        if let Some(load) = &self.load {
            phases.row(phase_row("load", load));
        }
        phases.row(phase_row("run", &self.run));
        out.push_str(&phases.render());
        out.push('\n');

        let mut lat = Table::new(&[
            ("op", Align::Left),
            ("ops", Align::Right),
            ("errors", Align::Right),
            ("mean us", Align::Right),
            ("p50 us", Align::Right),
            ("p99 us", Align::Right),
            ("p99.9 us", Align::Right),
            ("max us", Align::Right),
        ]);
        let mut lat_rows = |phase: &str, p: &PhaseSummary| {
            // "ALL" repeats the only row when one operation type ran.
            let shown = if p.latency.len() == 2 {
                1
            } else {
                p.latency.len()
            };
            for l in &p.latency[..shown] {
                lat.row(vec![
                    format!("{phase}{}", l.op),
                    thousands(l.ops as f64),
                    thousands(l.errors as f64),
                    us(l.mean_us),
                    us(l.p50_us),
                    us(l.p99_us),
                    us(l.p999_us),
                    us(l.max_us),
                ]);
            }
        };
        if let Some(load) = &self.load {
            lat_rows("load ", load);
        }
        lat_rows("", &self.run);
        out.push_str(&lat.render());

        for (name, p) in self
            .load
            .iter()
            .map(|l| ("load", l))
            .chain([("run", &self.run)])
        {
            if p.errors_by_kind.is_empty() {
                continue;
            }
            let _ = writeln!(out, "\nerrors ({name}):");
            for (kind, n) in &p.errors_by_kind {
                let example = p.error_examples.get(kind).map(String::as_str).unwrap_or("");
                let _ = writeln!(out, "  {kind}: {} (e.g. {example})", thousands(*n as f64));
            }
            if name == "run" && self.may_have_skipped_the_load() {
                let _ = writeln!(
                    out,
                    "  hint: the run uses keys 0..{} (--records {}), and keys never inserted are \
                     not found: add --load, or run --workload load first",
                    self.records, self.records
                );
            }
        }

        if let Some(d) = &self.dinomo {
            let _ = writeln!(
                out,
                "\nDinomo KV nodes over the run ({} KNs): {} gets, {} puts, {} lookups",
                d.kns,
                thousands(d.gets as f64),
                thousands(d.puts as f64),
                thousands(d.lookups as f64)
            );
            let mut t = Table::new(&[
                ("value hits", Align::Right),
                ("shortcut hits", Align::Right),
                ("unmerged hits", Align::Right),
                ("misses", Align::Right),
                ("RTs/op", Align::Right),
                ("RTs/client op", Align::Right),
                ("bytes read/op", Align::Right),
            ]);
            t.row(vec![
                pct(d.value_hit_ratio),
                pct(d.shortcut_hit_ratio),
                pct(d.unmerged_hit_ratio),
                pct(d.miss_ratio),
                format!("{:.3}", d.rts_per_op),
                format!("{:.3}", d.rts_per_client_op),
                format!("{:.0}", d.bytes_read_per_op),
            ]);
            out.push_str(&t.render());
        }
        if let Some(e) = &self.dinomo_stats_error {
            let _ = writeln!(out, "\nDinomo KV node counters unavailable: {e}");
        }
        if !self.cpu.is_empty() {
            let _ = writeln!(
                out,
                "\nCPU over the run (from /proc: this client and the Dinomo processes on this machine)"
            );
            let mut t = Table::new(&[
                ("process", Align::Left),
                ("pid", Align::Right),
                ("CPU s", Align::Right),
                ("CPU us/op", Align::Right),
            ]);
            for c in &self.cpu {
                t.row(vec![
                    c.name.clone(),
                    c.pid.to_string(),
                    format!("{:.2}", c.cpu_s),
                    format!("{:.1}", c.us_per_op),
                ]);
            }
            out.push_str(&t.render());
        }
        out
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ycsb::target::OpError;
    use crate::ycsb::workload::Workload;

    fn kn(id: u32, gets: u64, value_hits: u64, misses: u64, rts: u64) -> KnStatsResponse {
        KnStatsResponse {
            kn_id: id,
            gets,
            value_hits,
            misses,
            round_trips: rts,
            ..Default::default()
        }
    }

    #[test]
    fn dinomo_deltas() {
        let before = vec![kn(1, 100, 50, 50, 1000), kn(2, 0, 0, 0, 0)];
        let after = vec![
            kn(1, 200, 125, 75, 1100),
            kn(2, 100, 75, 25, 100),
            kn(3, 5, 5, 0, 9),
        ];
        let d = DinomoStats::delta(&before, &after, 100);
        assert_eq!(d.kns, 2);
        assert_eq!(d.gets, 200);
        assert_eq!(d.lookups, 200);
        assert!((d.value_hit_ratio - 0.75).abs() < 1e-12);
        assert!((d.miss_ratio - 0.25).abs() < 1e-12);
        assert!((d.rts_per_op - 1.0).abs() < 1e-12);
        assert!((d.rts_per_client_op - 2.0).abs() < 1e-12);
    }

    #[test]
    fn summary_renders_and_serialises() {
        let mut rec = Recorder::default();
        for i in 1..=100u64 {
            rec.record(OpKind::Read, Duration::from_micros(i), Ok(()));
        }
        let e = OpError::not_found();
        rec.record(OpKind::Update, Duration::from_micros(5), Err(&e));
        let run = PhaseSummary::new(&rec, Duration::from_secs(2));
        assert_eq!(run.ops, 101);
        assert!((run.throughput_ops_per_s - 50.5).abs() < 1e-9);
        assert_eq!(run.latency.len(), 3);
        assert_eq!(run.latency[2].op, "ALL");
        assert!(
            (run.latency[0].p50_us - 50.0).abs() < 0.1,
            "{:?}",
            run.latency[0]
        );
        let s = Summary {
            workload: "a".into(),
            mix: Workload::A.mix(),
            target: "redis://127.0.0.1:1".into(),
            system: "redis".into(),
            distribution: "zipfian".into(),
            zipf_theta: 0.99,
            write_mode: WriteMode::Upsert,
            records: 10,
            clients: 1,
            connections: 1,
            kv_transport: None,
            threads: 1,
            outstanding: 1,
            key_size: 24,
            value_size: 10,
            seed: 1,
            warmup_s: 0.0,
            operations_limit: Some(101),
            duration_limit_s: None,
            load: None,
            run,
            dinomo: Some(DinomoStats::default()),
            dinomo_stats_error: None,
            cpu: vec![CpuUse {
                name: "kv-node 1".into(),
                pid: 42,
                cpu_s: 1.5,
                us_per_op: 35.25,
            }],
        };
        let text = s.render();
        assert!(text.contains("READ"), "{text}");
        assert!(
            text.contains("kv-node 1") && text.contains("35.2"),
            "{text}"
        );
        assert!(text.contains("not_found: 1"), "{text}");
        // One key of 20 operations not found, no --load: a cluster nobody loaded.
        let mut unloaded = s.clone();
        unloaded.run.ops = 20;
        let hint = "add --load, or run --workload load first";
        assert!(unloaded.render().contains(hint), "{}", unloaded.render());
        let loaded = Summary {
            load: Some(s.run.clone()),
            ..unloaded.clone()
        };
        assert!(
            !loaded.render().contains(hint),
            "a run that loaded its keys gives no load hint"
        );
        let mut stray = unloaded.clone();
        stray.run.ops = 1000;
        assert!(
            !stray.render().contains(hint),
            "one key not found in 1,000 operations (an insert that failed) gives no load hint"
        );
        assert!(text.contains("RTs/op"), "{text}");
        let json: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(json["run"]["ops"], 101);
        assert_eq!(json["run"]["errors_by_kind"]["not_found"], 1);
        assert_eq!(json["write_mode"], "upsert");
    }
}
