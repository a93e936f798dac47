//! The load generator: client tasks that keep a fixed number of requests in flight.
//!
//! A phase runs `clients` tokio tasks; each owns one [`Target`] connection, its own random
//! generator (seeded from the run's seed and its index) and its own key chooser, and keeps
//! `outstanding` operations in flight in a `FuturesUnordered`: when one completes, the next is
//! drawn and issued (a closed loop per slot). Every completion is recorded by the task itself,
//! so nothing is shared on the hot path except the insert sequence and, with `--operations`,
//! one counter of issued operations.
//!
//! Operations issued during the warm-up are executed but not recorded. The measured part ends
//! when `--operations` have been issued or `--duration` has passed, whichever comes first; the
//! operations then in flight complete and are recorded. Its length is from the end of the
//! warm-up to the last recorded completion. A latency runs from the moment the operation is
//! issued to its completion, failures included (a timed-out request did cost that long).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt as _};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::generator::{KeyChooser, KeySpace};
use super::target::{OpError, Target};
use super::workload::{KeyFormat, Mix, OpKind, ValuePool};

/// Largest latency a histogram holds (larger ones are clamped): 100 s, in nanoseconds.
const MAX_LATENCY_NS: u64 = 100_000_000_000;

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid histogram bounds")
}

/// Latencies and errors of one phase (one client's, or merged).
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    hist: [Option<Histogram<u64>>; OpKind::ALL.len()],
    ops: [u64; OpKind::ALL.len()],
    errors_by_op: [u64; OpKind::ALL.len()],
    errors: BTreeMap<String, u64>,
    examples: BTreeMap<String, String>,
    last_completion: Option<Instant>,
}

impl Recorder {
    pub fn record(&mut self, kind: OpKind, latency: Duration, result: Result<(), &OpError>) {
        let i = kind.index();
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.hist[i]
            .get_or_insert_with(new_histogram)
            .saturating_record(ns);
        self.ops[i] += 1;
        if let Err(e) = result {
            self.errors_by_op[i] += 1;
            *self.errors.entry(e.kind.clone()).or_default() += 1;
            self.examples
                .entry(e.kind.clone())
                .or_insert_with(|| e.message.clone());
        }
    }

    fn completed_at(&mut self, t: Instant) {
        if self.last_completion.is_none_or(|l| t > l) {
            self.last_completion = Some(t);
        }
    }

    pub fn merge(&mut self, other: Recorder) {
        for (i, h) in other.hist.into_iter().enumerate() {
            if let Some(h) = h {
                match &mut self.hist[i] {
                    Some(mine) => mine.add(&h).expect("histograms with equal bounds"),
                    slot @ None => *slot = Some(h),
                }
            }
            self.ops[i] += other.ops[i];
            self.errors_by_op[i] += other.errors_by_op[i];
        }
        for (k, n) in other.errors {
            *self.errors.entry(k).or_default() += n;
        }
        for (k, m) in other.examples {
            self.examples.entry(k).or_insert(m);
        }
        if let Some(t) = other.last_completion {
            self.completed_at(t);
        }
    }

    /// Operations of `kind` recorded.
    pub fn ops(&self, kind: OpKind) -> u64 {
        self.ops[kind.index()]
    }

    pub fn total_ops(&self) -> u64 {
        self.ops.iter().sum()
    }

    pub fn errors_of(&self, kind: OpKind) -> u64 {
        self.errors_by_op[kind.index()]
    }

    pub fn total_errors(&self) -> u64 {
        self.errors_by_op.iter().sum()
    }

    pub fn histogram(&self, kind: OpKind) -> Option<&Histogram<u64>> {
        self.hist[kind.index()].as_ref()
    }

    /// All operation types together.
    pub fn overall(&self) -> Option<Histogram<u64>> {
        let mut all: Option<Histogram<u64>> = None;
        for h in self.hist.iter().flatten() {
            match &mut all {
                Some(a) => a.add(h).expect("histograms with equal bounds"),
                None => all = Some(h.clone()),
            }
        }
        all
    }

    pub fn errors_by_kind(&self) -> &BTreeMap<String, u64> {
        &self.errors
    }

    /// One message per error kind (the first seen).
    pub fn error_examples(&self) -> &BTreeMap<String, String> {
        &self.examples
    }

    pub fn last_completion(&self) -> Option<Instant> {
        self.last_completion
    }
}

/// What a phase does.
#[derive(Debug, Clone)]
pub struct PhaseSpec {
    pub mix: Mix,
    /// Stop issuing after this many measured operations (over all clients).
    pub op_limit: Option<u64>,
    /// Stop issuing this long after the warm-up.
    pub time_limit: Option<Duration>,
    pub warmup: Duration,
    /// Requests in flight per client.
    pub outstanding: usize,
    pub seed: u64,
    /// Stop issuing at the first `resource_exhausted` error (the cluster's pool is full).
    pub stop_on_full: bool,
}

/// What every client of a phase shares.
#[derive(Debug)]
pub struct PhaseEnv {
    pub keys: KeyFormat,
    pub values: ValuePool,
    pub keyspace: KeySpace,
    /// Cloned into every client (its zeta is precomputed once).
    pub chooser: KeyChooser,
    /// Advanced by one per completed operation (the load's progress bar).
    pub progress: Option<ProgressBar>,
    /// Set when a client saw the pool full and the phase stops on that
    /// ([`PhaseSpec::stop_on_full`]).
    pub full: AtomicBool,
}

/// What a phase measured.
#[derive(Debug)]
pub struct PhaseOutcome {
    pub recorder: Recorder,
    /// End of the warm-up: the start of the measured part.
    pub measured_start: Instant,
    /// Length of the measured part (zero when nothing was recorded).
    pub measured: Duration,
}

/// One operation ready to issue.
#[derive(Debug)]
struct Op {
    kind: OpKind,
    keynum: u64,
    key: Bytes,
    value: Bytes,
}

#[derive(Debug)]
struct Done {
    kind: OpKind,
    keynum: u64,
    measured: bool,
    latency: Duration,
    end: Instant,
    result: Result<(), OpError>,
}

fn issue(target: Arc<dyn Target>, op: Op, measured: bool) -> BoxFuture<'static, Done> {
    let t0 = Instant::now();
    Box::pin(async move {
        let Op {
            kind,
            keynum,
            key,
            value,
        } = op;
        let result = match kind {
            OpKind::Read => match target.get(key).await {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err(OpError::not_found()),
                Err(e) => Err(e),
            },
            OpKind::Update => target.update(key, value).await,
            OpKind::Insert => target.insert(key, value).await,
            OpKind::ReadModifyWrite => target.read_modify_write(key, value).await,
            OpKind::Delete => target.delete(key).await,
        };
        let end = Instant::now();
        Done {
            kind,
            keynum,
            measured,
            latency: end.saturating_duration_since(t0),
            end,
            result,
        }
    })
}

/// The seed of client `index`: distinct, well-mixed streams from one run seed.
fn client_seed(seed: u64, index: usize) -> u64 {
    let mut x = seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 33)
}

async fn client_loop(
    index: usize,
    target: Arc<dyn Target>,
    env: Arc<PhaseEnv>,
    spec: Arc<PhaseSpec>,
    issued: Arc<AtomicU64>,
    start: Instant,
) -> Recorder {
    let mut rng = SmallRng::seed_from_u64(client_seed(spec.seed, index));
    let mut chooser = env.chooser.clone();
    let warmup_end = start + spec.warmup;
    let deadline = spec.time_limit.map(|d| warmup_end + d);
    let mut rec = Recorder::default();
    let mut inflight = FuturesUnordered::new();
    let mut stopping = false;
    loop {
        while !stopping && inflight.len() < spec.outstanding.max(1) {
            if env.full.load(Ordering::Relaxed) {
                stopping = true;
                break;
            }
            let now = Instant::now();
            let measured = now >= warmup_end;
            if measured {
                let timed_out = deadline.is_some_and(|d| now >= d);
                let counted_out = !timed_out
                    && spec
                        .op_limit
                        .is_some_and(|limit| issued.fetch_add(1, Ordering::Relaxed) >= limit);
                if timed_out || counted_out {
                    stopping = true;
                    break;
                }
            }
            let kind = spec.mix.pick(&mut rng);
            let keynum = match kind {
                OpKind::Insert => env.keyspace.next_insert(),
                _ => chooser.next(&mut rng, env.keyspace.limit()),
            };
            let value = match kind {
                OpKind::Read | OpKind::Delete => Bytes::new(),
                _ => env.values.value(&mut rng),
            };
            let op = Op {
                kind,
                keynum,
                key: Bytes::from(env.keys.key(keynum)),
                value,
            };
            inflight.push(issue(target.clone(), op, measured));
        }
        let Some(done) = inflight.next().await else {
            break;
        };
        if done.kind == OpKind::Insert {
            env.keyspace.complete(done.keynum);
        }
        if spec.stop_on_full
            && matches!(&done.result, Err(e) if e.kind == OpError::RESOURCE_EXHAUSTED)
        {
            env.full.store(true, Ordering::Relaxed);
        }
        if done.measured {
            rec.record(done.kind, done.latency, done.result.as_ref().map(|_| ()));
            rec.completed_at(done.end);
        }
        if let Some(pb) = &env.progress {
            pb.inc(1);
        }
    }
    rec
}

/// Runs one phase with one client task per target, starting now; `start` is the instant the
/// caller computed the warm-up end from (pass `Instant::now()`).
pub async fn run_phase(
    targets: &[Arc<dyn Target>],
    env: Arc<PhaseEnv>,
    spec: PhaseSpec,
    start: Instant,
) -> anyhow::Result<PhaseOutcome> {
    let spec = Arc::new(spec);
    let issued = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            tokio::spawn(client_loop(
                i,
                t.clone(),
                env.clone(),
                spec.clone(),
                issued.clone(),
                start,
            ))
        })
        .collect();
    let mut recorder = Recorder::default();
    for t in tasks {
        recorder.merge(t.await?);
    }
    let measured_start = start + spec.warmup;
    let measured = recorder
        .last_completion()
        .map(|t| t.saturating_duration_since(measured_start))
        .unwrap_or_default();
    Ok(PhaseOutcome {
        recorder,
        measured_start,
        measured,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ycsb::generator::Zipfian;
    use crate::ycsb::workload::Workload;
    use async_trait::async_trait;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// An in-memory target counting what it was asked to do.
    #[derive(Debug, Default)]
    struct Memory {
        data: Mutex<HashMap<Bytes, Bytes>>,
    }

    #[async_trait]
    impl Target for Memory {
        async fn get(&self, key: Bytes) -> Result<Option<Bytes>, OpError> {
            tokio::task::yield_now().await;
            Ok(self.data.lock().unwrap().get(&key).cloned())
        }
        async fn update(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
            self.data.lock().unwrap().insert(key, value);
            Ok(())
        }
        async fn insert(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
            tokio::task::yield_now().await;
            let mut d = self.data.lock().unwrap();
            if d.contains_key(&key) {
                return Err(OpError::new("already_exists", "exists"));
            }
            d.insert(key, value);
            Ok(())
        }
        async fn delete(&self, key: Bytes) -> Result<(), OpError> {
            self.data.lock().unwrap().remove(&key);
            Ok(())
        }
    }

    /// A target that holds at most `cap` keys and then refuses inserts as a full pool does.
    #[derive(Debug)]
    struct Small {
        mem: Memory,
        cap: usize,
    }

    #[async_trait]
    impl Target for Small {
        async fn get(&self, key: Bytes) -> Result<Option<Bytes>, OpError> {
            self.mem.get(key).await
        }
        async fn update(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
            self.mem.update(key, value).await
        }
        async fn insert(&self, key: Bytes, value: Bytes) -> Result<(), OpError> {
            if self.mem.data.lock().unwrap().len() >= self.cap {
                return Err(OpError::new(OpError::RESOURCE_EXHAUSTED, "full"));
            }
            self.mem.insert(key, value).await
        }
        async fn delete(&self, key: Bytes) -> Result<(), OpError> {
            self.mem.delete(key).await
        }
    }

    fn env(records: u64, acked: u64, next: u64) -> Arc<PhaseEnv> {
        Arc::new(PhaseEnv {
            keys: KeyFormat::new(24).unwrap(),
            values: ValuePool::new(16, 1),
            keyspace: KeySpace::with_next(acked, next),
            chooser: KeyChooser::Zipfian {
                zipf: Zipfian::new(0.99, records.max(1)),
                loaded: records,
            },
            progress: None,
            full: AtomicBool::new(false),
        })
    }

    fn spec(mix: Mix, ops: u64) -> PhaseSpec {
        PhaseSpec {
            mix,
            op_limit: Some(ops),
            time_limit: None,
            warmup: Duration::ZERO,
            outstanding: 4,
            seed: 3,
            stop_on_full: false,
        }
    }

    #[tokio::test]
    async fn load_then_run_counts_every_operation() {
        let mem: Arc<dyn Target> = Arc::new(Memory::default());
        let targets = vec![mem.clone(), mem.clone(), mem.clone()];
        let load = run_phase(
            &targets,
            env(500, 0, 0),
            spec(Workload::Load.mix(), 500),
            Instant::now(),
        )
        .await
        .unwrap();
        assert_eq!(load.recorder.ops(OpKind::Insert), 500);
        assert_eq!(
            load.recorder.total_errors(),
            0,
            "{:?}",
            load.recorder.errors_by_kind()
        );

        let run_env = env(500, 500, 500);
        let run = run_phase(
            &targets,
            run_env.clone(),
            spec(Workload::D.mix(), 2000),
            Instant::now(),
        )
        .await
        .unwrap();
        let r = &run.recorder;
        assert_eq!(r.total_ops(), 2000);
        assert_eq!(r.ops(OpKind::Read) + r.ops(OpKind::Insert), 2000);
        // Inserts took fresh numbers and every read found its key.
        assert_eq!(r.total_errors(), 0, "{:?}", r.errors_by_kind());
        assert_eq!(run_env.keyspace.limit(), 500 + r.ops(OpKind::Insert));
        assert_eq!(r.overall().unwrap().len(), 2000);
    }

    #[tokio::test]
    async fn reads_of_missing_keys_count_as_not_found() {
        let mem: Arc<dyn Target> = Arc::new(Memory::default());
        let run = run_phase(
            &[mem],
            env(100, 100, 100),
            spec(Workload::C.mix(), 50),
            Instant::now(),
        )
        .await
        .unwrap();
        assert_eq!(run.recorder.errors_of(OpKind::Read), 50);
        assert_eq!(run.recorder.errors_by_kind().get("not_found"), Some(&50));
    }

    #[tokio::test]
    async fn a_load_until_full_stops_at_the_first_refusal_and_deletes_make_room() {
        let small = Arc::new(Small {
            mem: Memory::default(),
            cap: 300,
        });
        let t: Arc<dyn Target> = small.clone();
        let mut full_spec = spec(Workload::Load.mix(), 10_000);
        full_spec.stop_on_full = true;
        let load = run_phase(
            std::slice::from_ref(&t),
            env(10_000, 0, 0),
            full_spec.clone(),
            Instant::now(),
        )
        .await
        .unwrap();
        let r = &load.recorder;
        assert_eq!(r.ops(OpKind::Insert) - r.errors_of(OpKind::Insert), 300);
        // Stopped right after the first refusal (the 4 requests in flight may all be refused).
        assert!(
            (1..=4).contains(&r.errors_of(OpKind::Insert)),
            "{:?}",
            r.errors_by_kind()
        );
        let mut delete = env(300, 300, 300);
        Arc::get_mut(&mut delete).unwrap().chooser = KeyChooser::Sequential {
            next: Arc::default(),
        };
        let del = run_phase(
            std::slice::from_ref(&t),
            delete,
            spec(Workload::Delete.mix(), 150),
            Instant::now(),
        )
        .await
        .unwrap();
        assert_eq!(del.recorder.ops(OpKind::Delete), 150);
        assert_eq!(small.mem.data.lock().unwrap().len(), 150);
    }

    #[test]
    fn recorder_merges() {
        let mut a = Recorder::default();
        a.record(OpKind::Read, Duration::from_micros(10), Ok(()));
        let mut b = Recorder::default();
        b.record(OpKind::Read, Duration::from_micros(30), Ok(()));
        let e = OpError::new("timeout", "slow");
        b.record(OpKind::Update, Duration::from_micros(50), Err(&e));
        a.merge(b);
        assert_eq!(a.ops(OpKind::Read), 2);
        assert_eq!(a.total_ops(), 3);
        assert_eq!(a.errors_of(OpKind::Update), 1);
        assert_eq!(a.errors_by_kind().get("timeout"), Some(&1));
        assert_eq!(a.overall().unwrap().len(), 3);
        assert_ne!(client_seed(1, 0), client_seed(1, 1));
    }
}
