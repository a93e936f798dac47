//! dinomo-bench: shared helpers of the Dinomo benchmark programs (latency summaries, a plain
//! text table, JSON reports).
//!
//! The programs live in `src/bin/`. `fabric-bench` measures each fabric backend (shm, tcp, and
//! verbs with the `rdma` feature): ops/s, p50 and p99 latency and round trips per operation of
//! READ, WRITE, CAS and FAA, with one operation outstanding and pipelined on one handle.
//!
//! Absolute numbers depend heavily on the machine: on a small shared VM (2 cores, where the tcp
//! "NIC" task and the client share those cores) they are noisy from run to run. What is
//! meaningful is the ratio between backends measured in the same run, and the round trips per
//! operation, which are counted, not timed, and so are exact.

pub mod timeline;
pub mod ycsb;

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

/// One measured cell of a benchmark table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    /// Backend name: "shm", "tcp" or "verbs".
    pub backend: String,
    /// Operation label, e.g. "READ", "WRITE", "CAS", "FAA", "READ x8".
    pub op: String,
    /// Payload bytes per operation.
    pub size_bytes: u64,
    /// "single" (one post outstanding) or "pipelined".
    pub mode: String,
    /// Posts in flight at once on the handle (1 for "single").
    pub depth: usize,
    /// Operations measured (warm-up excluded).
    pub ops: u64,
    /// Posts measured (a doorbell-batched post carries several operations).
    pub posts: u64,
    /// Round trips counted by the handle's own stats over the measured posts.
    pub round_trips: u64,
    /// `round_trips / ops`.
    pub rts_per_op: f64,
    /// Measured operations per second of wall-clock time.
    pub ops_per_sec: f64,
    /// Median latency of one post, in microseconds.
    pub p50_us: f64,
    /// 99th percentile latency of one post, in microseconds.
    pub p99_us: f64,
    /// Largest latency of one post, in microseconds.
    pub max_us: f64,
    /// Wall-clock time of the measured part, in milliseconds.
    pub elapsed_ms: f64,
}

/// Latency samples of one cell, in nanoseconds.
#[derive(Debug, Clone, Default)]
pub struct Latencies {
    samples: Vec<u64>,
    sorted: bool,
}

impl Latencies {
    pub fn with_capacity(n: usize) -> Self {
        Latencies {
            samples: Vec::with_capacity(n),
            sorted: true,
        }
    }

    pub fn record(&mut self, d: Duration) {
        self.samples
            .push(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        self.sorted = false;
    }

    /// Adds all samples of `other`.
    pub fn merge(&mut self, other: Latencies) {
        self.samples.extend(other.samples);
        self.sorted = false;
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The `q`-quantile (0.0..=1.0, nearest rank) in microseconds; 0 when there are no samples.
    pub fn quantile_us(&mut self, q: f64) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        if !self.sorted {
            self.samples.sort_unstable();
            self.sorted = true;
        }
        let n = self.samples.len();
        let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
        let idx = rank.clamp(1, n) - 1;
        self.samples[idx] as f64 / 1000.0
    }
}

/// A human size: "64 B", "4 KiB", "1 MiB".
pub fn human_size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        // Units are powers of two: a mask test (`is_multiple_of` is newer than the MSRV).
        if bytes >= unit && bytes & (unit - 1) == 0 {
            return format!("{} {name}", bytes / unit);
        }
    }
    format!("{bytes} B")
}

/// A number with a thousands separator and no decimals ("1,234,567").
pub fn thousands(x: f64) -> String {
    let n = x.round().max(0.0) as u64;
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    // Digits left before the next separator; the first group may be shorter than 3.
    let mut left = (digits.len() + 2) % 3 + 1;
    for ch in digits.chars() {
        if left == 0 {
            out.push(',');
            left = 3;
        }
        out.push(ch);
        left -= 1;
    }
    out
}

/// Column alignment in a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A plain text table: `a | b | c` rows under a header and a rule.
#[derive(Debug, Clone)]
pub struct Table {
    headers: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[(&str, Align)]) -> Self {
        Table {
            headers: headers.iter().map(|(h, a)| (h.to_string(), *a)).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells are blank, extra cells are dropped.
    pub fn row(&mut self, cells: Vec<String>) {
        let mut cells = cells;
        cells.resize(self.headers.len(), String::new());
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let width = |s: &str| s.chars().count();
        let widths: Vec<usize> = self
            .headers
            .iter()
            .enumerate()
            .map(|(i, (h, _))| {
                self.rows
                    .iter()
                    .map(|r| width(&r[i]))
                    .chain([width(h)])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let line = |out: &mut String, cells: &[String]| {
            let parts: Vec<String> = cells
                .iter()
                .zip(&self.headers)
                .zip(&widths)
                .map(|((c, (_, align)), w)| {
                    let pad = " ".repeat(w - width(c));
                    match align {
                        Align::Left => format!("{c}{pad}"),
                        Align::Right => format!("{pad}{c}"),
                    }
                })
                .collect();
            let _ = writeln!(out, "{}", parts.join(" | ").trim_end());
        };
        let headers: Vec<String> = self.headers.iter().map(|(h, _)| h.clone()).collect();
        line(&mut out, &headers);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        let _ = writeln!(out, "{}", rule.join("-+-"));
        for r in &self.rows {
            line(&mut out, r);
        }
        out
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let mut text = serde_json::to_string_pretty(value).context("serialising the report")?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_nearest_rank() {
        let mut l = Latencies::with_capacity(100);
        assert_eq!(l.quantile_us(0.5), 0.0);
        for us in (1..=100).rev() {
            l.record(Duration::from_micros(us));
        }
        assert_eq!(l.quantile_us(0.5), 50.0);
        assert_eq!(l.quantile_us(0.99), 99.0);
        assert_eq!(l.quantile_us(1.0), 100.0);
        assert_eq!(l.quantile_us(0.0), 1.0);
        let mut other = Latencies::default();
        other.record(Duration::from_micros(1000));
        l.merge(other);
        assert_eq!(l.len(), 101);
        assert_eq!(l.quantile_us(1.0), 1000.0);
    }

    #[test]
    fn sizes_and_numbers() {
        assert_eq!(human_size(64), "64 B");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(1 << 20), "1 MiB");
        assert_eq!(human_size(1000), "1000 B");
        assert_eq!(thousands(0.4), "0");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(123456.0), "123,456");
        assert_eq!(thousands(1234567.0), "1,234,567");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&[("name", Align::Left), ("n", Align::Right)]);
        t.row(vec!["a".into(), "1".into()]);
        t.row(vec!["long name".into(), "12345".into()]);
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "name      |     n");
        assert_eq!(lines[1], "----------+------");
        assert_eq!(lines[2], "a         |     1");
        assert_eq!(lines[3], "long name | 12345");
    }
}
