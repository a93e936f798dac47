//! YCSB-style load generator behind `dinomo bench`: the one driver for Dinomo and for the
//! peers it is compared with (Redis), so both see the same workload from the same code.
//!
//! - [`workload`]: the operation mixes (YCSB core workloads load, A, B, C, D, F and the DINOMO
//!   paper's read/update and read/insert mixes), key names and values.
//! - [`generator`]: key choosers — scrambled zipfian of any skew (Gray et al. for theta < 1,
//!   rejection-inversion for theta >= 1), latest, uniform — over a key space that inserts grow.
//! - [`target`]: the [`Target`] trait and its Dinomo and Redis implementations.
//! - [`driver`]: client tasks with a fixed number of requests in flight, warm-up, bounds.
//! - [`report`]: the [`Summary`] printed as a table and written as JSON.
//! - [`cpu`]: CPU time per operation of the client and of the local Dinomo processes.
//!
//! A run: connect one [`Target`] per client; with `--load`, insert `--records` keys (key
//! numbers `0..records`, in parallel, with a progress bar); then run the workload until
//! `--operations` or `--duration` (whichever comes first) after `--warmup`; print the summary.
//! Against Dinomo it also reads every KV node's counters (`KvService.Stats`) at the end of the
//! warm-up and at the end of the run, and reports cache hit ratios and fabric round trips per
//! operation from the difference: the machine-independent figures (DESIGN.md section 8).
//! Throughput and latency on a small shared machine are only meaningful as a ratio against a
//! peer measured the same way in the same session.
//!
//! Nothing here asserts on time: the unit tests check distributions and bookkeeping only.

pub mod cpu;
pub mod driver;
pub mod generator;
pub mod report;
pub mod target;
pub mod workload;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use indicatif::{ProgressBar, ProgressStyle};

pub use driver::{PhaseEnv, PhaseOutcome, PhaseSpec, Recorder};
pub use generator::{KeyChooser, KeySpace, Zipfian};
pub use report::{DinomoStats, OpLatency, PhaseSummary, Summary};
pub use target::{DinomoTarget, OpError, RedisTarget, Target, TargetSpec, WriteMode};
pub use workload::{Distribution, KeyFormat, Mix, OpKind, ValuePool, Workload};

/// How long a run lasts when neither `--operations` nor `--duration` is given.
pub const DEFAULT_DURATION_S: f64 = 10.0;

/// Flags of `dinomo bench`.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct BenchArgs {
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    /// System under test: dinomo://HOST:PORT[,HOST:PORT...] (routing nodes) or
    /// redis://HOST:PORT[/DB].
    #[arg(long, default_value = "dinomo://127.0.0.1:7900")]
    pub target: String,

    /// Workload: YCSB core (load, a, b, c, d, f) or a DINOMO paper mix.
    #[arg(long, value_enum, default_value_t = Workload::A)]
    pub workload: Workload,

    /// Keys loaded (or assumed loaded) before the run: key numbers 0..records.
    #[arg(long, default_value_t = 100_000)]
    pub records: u64,

    /// Measured operations to issue (over all clients). With --duration, whichever is reached
    /// first ends the run. Workload "load" defaults to --records.
    #[arg(long)]
    pub operations: Option<u64>,

    /// Measured run length in seconds ("30", "30s", "500ms", "2m"). Without --operations and
    /// --duration a run lasts 10 s.
    #[arg(long, value_parser = parse_secs)]
    pub duration: Option<f64>,

    /// Seconds of unmeasured warm-up before the measured run.
    #[arg(long, value_parser = parse_secs, default_value = "0")]
    pub warmup: f64,

    /// Client tasks (each keeps --outstanding requests in flight).
    #[arg(long, default_value_t = 4)]
    pub clients: usize,

    /// Connections the client tasks share, round robin: Dinomo SDK clients (each with one
    /// stream per KV node) or multiplexed Redis connections. Fewer connections carry more
    /// operations each, which both systems coalesce into fewer frames and system calls.
    /// Default: one per client task.
    #[arg(long)]
    pub connections: Option<usize>,

    /// Runtime threads of the bench process (default: one per core). The same for every
    /// target, so that a comparison runs both systems' clients alike; on a small machine
    /// shared with the servers, fewer threads spend less CPU per operation on wakeups.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// How the Dinomo SDK reaches the KV nodes: `wire` (the binary KV wire, the SDK's
    /// default) or `grpc` (KvService.Pipeline over HTTP/2). Default: $DINOMO_KV_TRANSPORT, else
    /// wire.
    #[arg(long, value_parser = clap::value_parser!(dinomo_client::KvTransport))]
    pub kv_transport: Option<dinomo_client::KvTransport>,

    /// Requests each client keeps in flight.
    #[arg(long, default_value_t = 1)]
    pub outstanding: usize,

    /// Key length in bytes: "user" and key-size - 4 zero-padded digits.
    #[arg(long, default_value_t = 24)]
    pub key_size: usize,

    /// Value length in bytes.
    #[arg(long, default_value_t = 1000)]
    pub value_size: usize,

    /// Request distribution (default: the workload's own: latest for d, zipfian otherwise).
    #[arg(long, value_enum)]
    pub distribution: Option<Distribution>,

    /// Zipfian skew for zipfian and latest: 0 is uniform, 0.99 is YCSB's, 2 is very skewed.
    #[arg(long, default_value_t = 0.99)]
    pub zipf_theta: f64,

    /// Seed of the operation sequence and of the values.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Insert --records keys first (not part of the measured run).
    #[arg(long)]
    pub load: bool,

    /// upsert: updates and inserts create or replace (Redis SET). strict: updates need the key
    /// (Dinomo update, SET XX), inserts need it absent (Dinomo insert, SET NX).
    #[arg(long, value_enum, default_value_t = WriteMode::Upsert)]
    pub write_mode: WriteMode,

    /// Stop the run (and the --load phase) at the first RESOURCE_EXHAUSTED, i.e. when the
    /// cluster's pool is full, instead of counting errors: with --workload load and a large
    /// --records this measures how many keys the pool holds (the summary's successful inserts).
    #[arg(long)]
    pub until_full: bool,

    /// Also write the summary as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,

    /// Do not report client latencies to the cluster's monitor (by default the SDK reports
    /// them to the monitor the routing nodes name: without them the monitor's policy takes a
    /// loaded cluster for an idle one and may remove KNs in the middle of the run).
    #[arg(long)]
    pub no_latency_reports: bool,
}

impl Default for BenchArgs {
    /// The flag defaults.
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: BenchArgs,
        }
        <Wrapper as clap::Parser>::parse_from(["bench"]).args
    }
}

/// Parses seconds: "1.5", "30s", "500ms", "2m".
pub fn parse_secs(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| {
        format!("{s:?} is not a duration: use seconds (\"5\", \"5s\", \"500ms\", \"2m\")")
    })?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!(
            "{s:?}: a duration must be a finite, non-negative number"
        ));
    }
    Ok(v * scale)
}

/// The checked, resolved form of [`BenchArgs`].
#[derive(Debug, Clone)]
struct Plan {
    target: TargetSpec,
    distribution: Distribution,
    keys: KeyFormat,
    op_limit: Option<u64>,
    time_limit: Option<Duration>,
}

fn plan(args: &BenchArgs) -> anyhow::Result<Plan> {
    let target = TargetSpec::parse(&args.target)?;
    if args.clients == 0 || args.outstanding == 0 {
        bail!("--clients and --outstanding must be at least 1");
    }
    if args.connections == Some(0) {
        bail!("--connections must be at least 1");
    }
    if args.records == 0 {
        bail!("--records must be at least 1");
    }
    if args.value_size == 0 {
        bail!("--value-size must be at least 1");
    }
    if !args.zipf_theta.is_finite() || args.zipf_theta < 0.0 {
        bail!("--zipf-theta must be a finite number >= 0 (0 is uniform)");
    }
    let keys = KeyFormat::new(args.key_size).map_err(anyhow::Error::msg)?;
    if let Some(cap) = keys.capacity() {
        if cap < args.records {
            bail!(
                "--key-size {} names at most {cap} distinct keys, fewer than --records {}: use --key-size {} or more",
                args.key_size,
                args.records,
                workload::KEY_PREFIX.len() + (args.records - 1).to_string().len()
            );
        }
    }
    if args.operations == Some(0) {
        bail!("--operations must be at least 1");
    }
    let (mut op_limit, mut time_limit) =
        (args.operations, args.duration.map(Duration::from_secs_f64));
    if op_limit.is_none() && time_limit.is_none() {
        if args.workload == Workload::Load {
            op_limit = Some(args.records);
        } else {
            time_limit = Some(Duration::from_secs_f64(DEFAULT_DURATION_S));
        }
    }
    Ok(Plan {
        target,
        distribution: args
            .distribution
            .unwrap_or(args.workload.default_distribution()),
        keys,
        op_limit,
        time_limit,
    })
}

impl BenchArgs {
    /// The runtime the bench runs on (see `--threads`).
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        dinomo_node_common::runtime(self.threads)
    }
}

/// The connections of a run: one target per client, plus a Dinomo handle for KN counters.
struct Connections {
    targets: Vec<Arc<dyn Target>>,
    dinomo: Option<DinomoTarget>,
}

async fn connect(plan: &Plan, args: &BenchArgs) -> anyhow::Result<Connections> {
    let connections = args.connections.unwrap_or(args.clients).min(args.clients);
    let mut targets: Vec<Arc<dyn Target>> = Vec::with_capacity(args.clients);
    let mut dinomo = None;
    for _ in 0..connections {
        match &plan.target {
            TargetSpec::Dinomo(routing) => {
                let t = DinomoTarget::connect(
                    routing,
                    args.write_mode,
                    !args.no_latency_reports,
                    args.kv_transport,
                )
                .await?;
                dinomo.get_or_insert_with(|| t.clone());
                targets.push(Arc::new(t));
            }
            TargetSpec::Redis(url) => {
                targets.push(Arc::new(RedisTarget::connect(url, args.write_mode).await?));
            }
        }
    }
    // Client task i uses connection i mod --connections.
    for i in connections..args.clients {
        let shared = targets[i % connections].clone();
        targets.push(shared);
    }
    Ok(Connections { targets, dinomo })
}

fn chooser(dist: Distribution, theta: f64, records: u64, acked: u64) -> KeyChooser {
    match dist {
        Distribution::Uniform => KeyChooser::Uniform,
        Distribution::Zipfian => KeyChooser::Zipfian {
            zipf: Zipfian::new(theta, acked.max(1)),
            loaded: records,
        },
        Distribution::Latest => KeyChooser::Latest {
            zipf: Zipfian::new(theta, acked.max(1)),
        },
        Distribution::Sequential => KeyChooser::Sequential {
            next: Arc::default(),
        },
    }
}

fn progress_bar(len: u64) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("load {bar:40} {pos}/{len} keys ({per_sec}, eta {eta})")
    {
        pb.set_style(style);
    }
    pb
}

/// Runs a benchmark as `args` say, prints the summary to stdout and, with `--json`, writes it.
pub async fn run(args: BenchArgs) -> anyhow::Result<Summary> {
    let plan = plan(&args)?;
    let conns = connect(&plan, &args).await?;
    let values = ValuePool::new(args.value_size, args.seed);

    let load = if args.load && args.records > 0 {
        let env = Arc::new(PhaseEnv {
            keys: plan.keys,
            values: values.clone(),
            keyspace: KeySpace::with_next(0, 0),
            chooser: KeyChooser::Uniform,
            progress: Some(progress_bar(args.records)),
            full: AtomicBool::new(false),
        });
        let spec = PhaseSpec {
            mix: Workload::Load.mix(),
            op_limit: Some(args.records),
            time_limit: None,
            warmup: Duration::ZERO,
            outstanding: args.outstanding,
            seed: args.seed ^ 0x4c4f_4144,
            stop_on_full: args.until_full,
        };
        let out = driver::run_phase(&conns.targets, env.clone(), spec, Instant::now()).await?;
        if let Some(pb) = &env.progress {
            pb.finish_and_clear();
        }
        Some(PhaseSummary::new(&out.recorder, out.measured))
    } else {
        None
    };

    // Workload "load" without --load is the load itself (key numbers from 0); otherwise keys
    // 0..records exist and inserts continue after them.
    let (acked, next_insert) = if args.workload == Workload::Load && !args.load {
        (0, 0)
    } else {
        (args.records, args.records)
    };
    let env = Arc::new(PhaseEnv {
        keys: plan.keys,
        values,
        keyspace: KeySpace::with_next(acked, next_insert),
        chooser: chooser(plan.distribution, args.zipf_theta, args.records, acked),
        progress: None,
        full: AtomicBool::new(false),
    });
    let spec = PhaseSpec {
        mix: args.workload.mix(),
        op_limit: plan.op_limit,
        time_limit: plan.time_limit,
        warmup: Duration::from_secs_f64(args.warmup),
        outstanding: args.outstanding,
        seed: args.seed,
        stop_on_full: args.until_full,
    };
    // Without a warm-up the "before" snapshot is taken before any client starts; with one,
    // at its end while the clients keep running.
    let warmup = spec.warmup;
    let early = match (&conns.dinomo, warmup.is_zero()) {
        (Some(d), true) => Some(d.kn_stats().await),
        _ => None,
    };
    // CPU time is read at the same two moments (at the start of the measured run, and when it
    // ends).
    let cpu_early = warmup.is_zero().then(cpu::CpuSnapshot::take);
    let start = Instant::now();
    let cpu_before = async {
        match cpu_early {
            Some(s) => s,
            None => {
                tokio::time::sleep_until((start + warmup).into()).await;
                cpu::CpuSnapshot::take()
            }
        }
    };
    let snapshot_before = async {
        if early.is_some() {
            return early;
        }
        let d = conns.dinomo.as_ref()?;
        tokio::time::sleep_until((start + warmup).into()).await;
        Some(d.kn_stats().await)
    };
    let (outcome, before, cpu_before) = tokio::join!(
        driver::run_phase(&conns.targets, env, spec, start),
        snapshot_before,
        cpu_before
    );
    let cpu_after = cpu::CpuSnapshot::take();
    let outcome = outcome?;
    let run = PhaseSummary::new(&outcome.recorder, outcome.measured);
    let cpu = cpu_before.per_op(&cpu_after, run.ops);

    let (dinomo, dinomo_stats_error) = match (&conns.dinomo, before) {
        (Some(d), Some(Ok(before))) => match d.kn_stats().await {
            Ok(after) => (Some(DinomoStats::delta(&before, &after, run.ops)), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        },
        (_, Some(Err(e))) => (None, Some(format!("{e:#}"))),
        _ => (None, None),
    };

    let summary = Summary {
        workload: args.workload.name().to_string(),
        mix: args.workload.mix(),
        target: plan.target.to_string(),
        system: plan.target.system().to_string(),
        distribution: plan.distribution.name().to_string(),
        zipf_theta: args.zipf_theta,
        write_mode: args.write_mode,
        records: args.records,
        clients: args.clients,
        connections: args.connections.unwrap_or(args.clients).min(args.clients),
        kv_transport: matches!(plan.target, TargetSpec::Dinomo(_)).then(|| {
            args.kv_transport
                .unwrap_or_else(dinomo_client::KvTransport::from_env)
                .name()
                .to_string()
        }),
        threads: args.threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            usize::from,
        ),
        outstanding: args.outstanding,
        key_size: args.key_size,
        value_size: args.value_size,
        seed: args.seed,
        warmup_s: args.warmup,
        operations_limit: plan.op_limit,
        duration_limit_s: plan.time_limit.map(|d| d.as_secs_f64()),
        load,
        run,
        dinomo,
        dinomo_stats_error,
        cpu,
    };
    print!("{}", summary.render());
    if let Some(path) = &args.json {
        crate::write_json(path, &summary).with_context(|| format!("--json {}", path.display()))?;
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(extra: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("bench").chain(extra.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn flags_parse() {
        let a = parse(&[
            "--target",
            "redis://127.0.0.1:6399",
            "--workload",
            "read95-insert5",
            "--records",
            "10000",
            "--duration",
            "5s",
            "--warmup",
            "500ms",
            "--clients",
            "8",
            "--outstanding",
            "4",
            "--distribution",
            "latest",
            "--zipf-theta",
            "2",
            "--load",
            "--write-mode",
            "strict",
            "--json",
            "/tmp/x.json",
        ]);
        assert_eq!(a.workload, Workload::Read95Insert5);
        assert_eq!(a.duration, Some(5.0));
        assert_eq!(a.warmup, 0.5);
        assert_eq!(a.distribution, Some(Distribution::Latest));
        assert_eq!(a.write_mode, WriteMode::Strict);
        assert!(a.load);
        let d = BenchArgs::default();
        assert_eq!(d.target, "dinomo://127.0.0.1:7900");
        assert_eq!(d.zipf_theta, 0.99);
        assert_eq!(d.workload, Workload::A);
        assert!(Cli::try_parse_from(["bench", "--workload", "e"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--duration", "soon"]).is_err());
    }

    #[test]
    fn plans_resolve_defaults_and_reject_bad_flags() {
        let p = plan(&BenchArgs::default()).unwrap();
        assert_eq!(p.time_limit, Some(Duration::from_secs(10)));
        assert_eq!(p.op_limit, None);
        assert_eq!(p.distribution, Distribution::Zipfian);
        let load = BenchArgs {
            workload: Workload::Load,
            records: 77,
            ..BenchArgs::default()
        };
        assert_eq!(plan(&load).unwrap().op_limit, Some(77));
        let d = BenchArgs {
            workload: Workload::D,
            ..BenchArgs::default()
        };
        assert_eq!(plan(&d).unwrap().distribution, Distribution::Latest);
        let small_keys = BenchArgs {
            key_size: 8,
            records: 100_000,
            ..BenchArgs::default()
        };
        let e = plan(&small_keys).unwrap_err().to_string();
        assert!(e.contains("--key-size 9 "), "{e}");
        for bad in [
            BenchArgs {
                clients: 0,
                ..BenchArgs::default()
            },
            BenchArgs {
                zipf_theta: -1.0,
                ..BenchArgs::default()
            },
            BenchArgs {
                target: "tcp://x".into(),
                ..BenchArgs::default()
            },
            BenchArgs {
                operations: Some(0),
                ..BenchArgs::default()
            },
        ] {
            assert!(plan(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn seconds_parse() {
        assert_eq!(parse_secs("5"), Ok(5.0));
        assert_eq!(parse_secs("2.5s"), Ok(2.5));
        assert_eq!(parse_secs("250ms"), Ok(0.25));
        assert_eq!(parse_secs("2m"), Ok(120.0));
        assert!(parse_secs("-1").is_err());
        assert!(parse_secs("x").is_err());
    }
}
