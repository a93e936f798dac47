//! The SDK against real clusters, with every operation recorded and the histories checked for
//! linearizability (dinomo-checker).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dinomo_checker::{check, History, Op, Res};
use dinomo_client::{Client, ClientError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::cluster::Cluster;

/// Which keys the clients touch: `key0 .. key{n-1}`, uniformly or Zipf-distributed.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    /// The first key's number.
    offset: u32,
    n: u32,
    /// Cumulative probabilities of keys 0..n under Zipf(theta); None: uniform.
    cdf: Option<Arc<Vec<f64>>>,
}

impl Keys {
    pub(super) fn uniform(n: u32) -> Keys {
        Keys {
            offset: 0,
            n,
            cdf: None,
        }
    }

    /// The same distribution over `key{offset} ..`.
    pub(super) fn shifted(mut self, offset: u32) -> Keys {
        self.offset = offset;
        self
    }

    pub(super) fn zipf(n: u32, theta: f64) -> Keys {
        let weights: Vec<f64> = (1..=n).map(|i| 1.0 / f64::from(i).powf(theta)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Keys {
            offset: 0,
            n,
            cdf: Some(Arc::new(cdf)),
        }
    }

    fn pick(&self, rng: &mut StdRng) -> u32 {
        self.offset
            + match &self.cdf {
                None => rng.random_range(0..self.n),
                Some(cdf) => {
                    let u: f64 = rng.random();
                    (cdf.partition_point(|&c| c < u) as u32).min(self.n - 1)
                }
            }
    }
}

/// Counts of what clients saw.
#[derive(Debug, Default)]
pub(super) struct Seen {
    pub(super) ops: AtomicU64,
    /// Errors that reached a caller: anything but a value or a semantic answer.
    pub(super) errors: AtomicU64,
    /// Writes that failed with [`ClientError::OutcomeUnknown`]: the one error class a crash
    /// (or a hung KN) may legitimately surface. Every other error counts only in `errors`, so
    /// `errors == unknown` fails on a DeadlineExceeded, NoMap, Other, ...
    pub(super) unknown: AtomicU64,
}

/// One client: random operations over `keys` keys until `stop` (at most `max_ops`).
async fn client_loop(
    client: Client,
    id: u64,
    keys: Keys,
    max_ops: u64,
    history: Arc<History>,
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = StdRng::seed_from_u64(id * 7919 + 1);
    for n in 0..max_ops {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let key = format!("key{}", keys.pick(&mut rng)).into_bytes();
        let value = format!("c{id}-{n}").into_bytes();
        let op = match rng.random_range(0..10) {
            0..=4 => Op::Get { key },
            5..=6 => Op::Put { key, value },
            7 => Op::Insert { key, value },
            8 => Op::Update { key, value },
            _ => Op::Delete { key },
        };
        let h = history.invoke(id, op.clone());
        let r: Result<Res, ClientError> = match op {
            Op::Get { key } => client
                .get(key)
                .await
                .map(|v| Res::Value(v.map(|b| b.to_vec()))),
            Op::Put { key, value } => client.put(key, value).await.map(|_| Res::Ok),
            Op::Insert { key, value } => match client.insert(key, value).await {
                Err(ClientError::AlreadyExists) => Ok(Res::AlreadyExists),
                r => r.map(|_| Res::Ok),
            },
            Op::Update { key, value } => match client.update(key, value).await {
                Err(ClientError::NotFound) => Ok(Res::NotFound),
                r => r.map(|_| Res::Ok),
            },
            Op::Delete { key } => {
                client
                    .delete(key)
                    .await
                    .map(|existed| if existed { Res::Ok } else { Res::NotFound })
            }
        };
        seen.ops.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(res) => history.complete(h, res),
            Err(e) => {
                seen.errors.fetch_add(1, Ordering::Relaxed);
                match e {
                    ClientError::InvalidArgument(_) => history.complete(h, Res::Fail),
                    ClientError::OutcomeUnknown(_) => {
                        seen.unknown.fetch_add(1, Ordering::Relaxed);
                        history.complete_unknown(h);
                    }
                    // Not an expected class: the test's error assertions fail on it. Still
                    // recorded as unknown, so the checker stays sound whatever the claim.
                    _ => history.complete_unknown(h),
                }
                eprintln!("client {id}: {e}");
            }
        }
    }
}

pub(super) struct Load {
    history: Arc<History>,
    pub(super) seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn start_load(cluster: &Cluster, clients: u64, keys: u32, max_ops: u64) -> Load {
    let mut cs = Vec::new();
    for _ in 0..clients {
        cs.push(cluster.client().await);
    }
    start_load_with(
        cs,
        Keys::uniform(keys),
        max_ops,
        Arc::new(History::new()),
        0,
    )
}

/// Clients `first_id..` running [`client_loop`] over `keys`, recording into `history`.
pub(super) fn start_load_with(
    clients: Vec<Client>,
    keys: Keys,
    max_ops: u64,
    history: Arc<History>,
    first_id: u64,
) -> Load {
    let seen = Arc::new(Seen::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (i, client) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(client_loop(
            client,
            first_id + i as u64,
            keys.clone(),
            max_ops,
            history.clone(),
            seen.clone(),
            stop.clone(),
        )));
    }
    Load {
        history,
        seen,
        stop,
        tasks,
    }
}

impl Load {
    /// Stops the clients (after their current operation) and waits for them.
    pub(super) async fn finish(self) -> (Arc<History>, Arc<Seen>) {
        self.stop.store(true, Ordering::Relaxed);
        self.join().await
    }

    /// Waits for the clients to run all their operations.
    async fn join(self) -> (Arc<History>, Arc<Seen>) {
        for t in self.tasks {
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("clients finish")
                .unwrap();
        }
        (self.history, self.seen)
    }
}

/// Lets the load run for at least `min`, then on until the clients have seen `ops` operations
/// in all (at most 60 s): on a fast machine just `min`, on a slow one (the emulated VM of
/// scripts/vm-cluster.sh) long enough that the load really spans what the test does next.
pub(super) async fn run_load(seen: &Seen, min: Duration, ops: u64) {
    tokio::time::sleep(min).await;
    let start = std::time::Instant::now();
    while seen.ops.load(Ordering::Relaxed) < ops && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(super) fn assert_linearizable(history: &History, what: &str) {
    match check(history) {
        Ok(report) => println!("{what}: linearizable: {report:?}"),
        Err(v) => panic!("{what}: NOT linearizable:\n{v}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crud_across_three_kns_is_linearizable() {
    let cluster = Cluster::start(3).await;
    let load = start_load(&cluster, 4, 24, 250).await;
    let (history, seen) = load.join().await;
    assert_eq!(
        seen.errors.load(Ordering::Relaxed),
        0,
        "no error may reach a caller in a healthy cluster"
    );
    assert!(seen.ops.load(Ordering::Relaxed) >= 1000);
    assert_linearizable(&history, "3 KNs");
    // Every KN served part of the load.
    let client = cluster.client().await;
    let map = client.map();
    for kn in &map.kns {
        assert!(
            (0..24).any(|k| map.owner(format!("key{k}").as_bytes()) == Some(kn.id)),
            "KN {} owns no test key",
            kn.id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_changes_under_load_reach_no_caller() {
    let mut cluster = Cluster::start(2).await;
    let load = start_load(&cluster, 4, 24, 100_000).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let added = cluster.add_kn(2).await;
    println!("added KN 2: {added:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let removed = cluster.remove_kn(0).await;
    println!("removed KN 0: {removed:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (history, seen) = load.finish().await;
    println!(
        "ops {} errors {}",
        seen.ops.load(Ordering::Relaxed),
        seen.errors.load(Ordering::Relaxed)
    );
    assert!(!added.affected.is_empty() && !removed.affected.is_empty());
    assert!(
        added.fenced.is_empty() && removed.fenced.is_empty(),
        "graceful changes fence nobody"
    );
    assert_eq!(
        seen.errors.load(Ordering::Relaxed),
        0,
        "a map change must not surface errors to callers"
    );
    assert!(seen.ops.load(Ordering::Relaxed) > 200);
    assert_linearizable(&history, "add KN 2, then remove KN 0");
    // The data is all there after the changes.
    let client = cluster.client().await;
    assert_eq!(
        client.map().kns.iter().map(|k| k.id).collect::<Vec<_>>(),
        vec![1, 2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kn_killed_under_load_loses_no_acknowledged_write() {
    let mut cluster = Cluster::start(3).await;
    let load = start_load(&cluster, 4, 24, 100_000).await;
    run_load(&load.seen, Duration::from_millis(700), 100).await;
    cluster.kns.get_mut(&1).unwrap().kill9();
    let t = std::time::Instant::now();
    let r = cluster.remove_kn(1).await;
    println!("failover of KN 1 in {:?}: {r:?}", t.elapsed());
    assert_eq!(r.fenced, vec![1], "the dead KN is fenced");
    let after = load.seen.ops.load(Ordering::Relaxed) + 101;
    run_load(&load.seen, Duration::from_millis(700), after).await;
    let (history, seen) = load.finish().await;
    println!(
        "ops {} errors {} (unknown outcome {})",
        seen.ops.load(Ordering::Relaxed),
        seen.errors.load(Ordering::Relaxed),
        seen.unknown.load(Ordering::Relaxed)
    );
    assert!(seen.ops.load(Ordering::Relaxed) > 200);
    // Acknowledged writes of the dead KN are read back by its successors: the checker sees
    // every acknowledged write and every later read.
    assert_linearizable(&history, "KN 1 killed and failed over");
}

/// A KN stopped with SIGTERM while clients write to it over the KV wire: it says goodbye,
/// answers every request it read (run, or UNAVAILABLE once stopping) and waits for its
/// connections before it stops, so no write ends outcome-unknown: each is acknowledged, or
/// provably never applied (retried elsewhere until the deadline, which ends it as
/// DeadlineExceeded since the map still names the stopped KN).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kn_stopped_under_wire_load_leaves_no_write_outcome_unknown() {
    let mut cluster = Cluster::start(2).await;
    let mut cfg = dinomo_client::ClientConfig::new(&[&cluster.routing.addr]);
    cfg.deadline = Duration::from_secs(2);
    cfg.transport = dinomo_client::KvTransport::Wire;
    let client = Client::connect_with(cfg).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, unknown, other) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let writers: Vec<_> = (0..16)
        .map(|w| {
            let (client, stop) = (client.clone(), stop.clone());
            let (ok, unknown, other) = (ok.clone(), unknown.clone(), other.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    match client.put(format!("w{w}-{n}"), "v").await {
                        Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(ClientError::OutcomeUnknown(m)) => {
                            println!("outcome unknown: {m}");
                            unknown.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(_) => other.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let before = ok.load(Ordering::Relaxed);
    let mut kn = cluster.kns.remove(&1).unwrap();
    let stopped = tokio::task::spawn_blocking(move || {
        let t = std::time::Instant::now();
        kn.stop();
        t.elapsed()
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let (ok, unknown, other) = (
        ok.load(Ordering::Relaxed),
        unknown.load(Ordering::Relaxed),
        other.load(Ordering::Relaxed),
    );
    println!(
        "KN 1 stopped in {stopped:?}; writes: {ok} acknowledged ({before} before the stop), \
         {unknown} outcome unknown, {other} other errors"
    );
    assert!(before > 100, "the load ran before the stop: {before}");
    assert_eq!(unknown, 0, "a graceful stop left writes outcome-unknown");
}
