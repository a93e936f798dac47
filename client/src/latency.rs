//! Client-side latency recording and reporting to the monitor (DINOMO 3.5: the M-node
//! "periodically collects latency information from clients").
//!
//! Unless reporting is switched off, every finished operation (a value, a definite error, or a
//! deadline) is recorded with the KN that answered its last attempt, into the recorder's shard
//! of the recording thread (so that operations on different cores take different locks). A
//! background task merges the shards' records since the previous report every `report_every`,
//! sends them to the monitor known at that moment (configured, or named by the routing nodes;
//! it may change when another monitor takes over; none known yet: the routing nodes are asked
//! again), then starts a new interval; the task ends
//! when the last clone of the client is dropped. An interval with no monitor to send it to, or
//! whose report cannot be delivered, is dropped (the monitor then sees a quieter epoch;
//! latencies are a signal, not a record).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dinomo_placement::KnId;
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::{KnLatency, LatencyReport};
use hdrhistogram::Histogram;
use parking_lot::{Mutex, RwLock};
use tonic::transport::Channel;

/// What was recorded in one reporting interval (by one shard, or merged).
#[derive(Debug)]
struct Interval {
    hist: Histogram<u64>,
    sum_us: u64,
    /// (KN, operations, sum of µs). A short list searched linearly: a cluster has a handful of
    /// KNs, and a scan of a few entries is cheaper per operation than hashing.
    per_kn: Vec<(KnId, u64, u64)>,
}

impl Interval {
    fn new() -> Self {
        Interval {
            // 1 µs .. 60 s at 2 significant digits: 2,560 counters, 20 KiB.
            hist: Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
            sum_us: 0,
            per_kn: Vec::new(),
        }
    }

    fn add_kn(&mut self, kn: KnId, count: u64, sum_us: u64) {
        match self.per_kn.iter_mut().find(|e| e.0 == kn) {
            Some(e) => {
                e.1 += count;
                e.2 += sum_us;
            }
            None => self.per_kn.push((kn, count, sum_us)),
        }
    }
}

/// One shard on its own cache lines, so that threads recording into neighbouring shards do
/// not bounce a shared line between cores.
#[derive(Debug)]
#[repr(align(128))]
struct Shard(Mutex<Interval>);

/// Latencies recorded since the last report.
///
/// Every operation of every clone records here, so one lock would be taken by all of them and
/// its cache line would move between cores on each operation. The interval is therefore split
/// into shards, and a thread always records into the same one: its lock is nearly always
/// uncontended and already in that core's cache. A report merges the shards, so what it says
/// is exactly what one interval would have said.
#[derive(Debug)]
pub(crate) struct Recorder {
    shards: Box<[Shard]>,
}

/// Hands each thread a shard index the first time it records (round robin over threads).
static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn thread_index() -> usize {
    THREAD_INDEX.with(|i| {
        if i.get() == usize::MAX {
            i.set(NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
        }
        i.get()
    })
}

impl Recorder {
    pub(crate) fn new() -> Self {
        // Enough shards that the runtime's worker threads rarely share one; each holds a
        // 20 KiB histogram.
        let n = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .next_power_of_two()
            .clamp(2, 64);
        Recorder {
            shards: (0..n).map(|_| Shard(Mutex::new(Interval::new()))).collect(),
        }
    }

    pub(crate) fn record(&self, kn: Option<KnId>, took: Duration) {
        let us = (took.as_micros() as u64).clamp(1, 60_000_000);
        let mut c = self.shards[thread_index() % self.shards.len()].0.lock();
        c.hist.saturating_record(us);
        c.sum_us += us;
        if let Some(kn) = kn {
            c.add_kn(kn, 1, us);
        }
    }

    /// The interval so far as a report, and a fresh interval.
    pub(crate) fn take_report(&self, client_id: &str) -> Option<LatencyReport> {
        let mut done = Interval::new();
        for shard in self.shards.iter() {
            // Merged and reset in place under the shard's lock, so no record is lost or
            // counted twice, and no histogram is allocated per shard per report.
            let mut s = shard.0.lock();
            if s.hist.is_empty() {
                continue;
            }
            done.hist
                .add(&s.hist)
                .expect("shards have the same bounds as the merged histogram");
            s.hist.reset();
            done.sum_us += std::mem::take(&mut s.sum_us);
            for (kn, count, sum_us) in s.per_kn.drain(..) {
                done.add_kn(kn, count, sum_us);
            }
        }
        if done.hist.is_empty() {
            return None;
        }
        Some(LatencyReport {
            client_id: client_id.to_string(),
            count: done.hist.len(),
            sum_us: done.sum_us,
            p99_us: done.hist.value_at_quantile(0.99),
            per_kn: done
                .per_kn
                .into_iter()
                .map(|(kn_id, count, sum_us)| KnLatency {
                    kn_id,
                    count,
                    sum_us,
                })
                .collect(),
        })
    }
}

/// A MonitorService client for `monitor` (host:port or URL); `None` if it is not an address.
fn monitor_client(
    security: &dinomo_security::Security,
    monitor: &str,
) -> Option<MonitorServiceClient<Channel>> {
    let Ok(endpoint) = security.endpoint(monitor, dinomo_security::Service::Monitor) else {
        tracing::warn!(%monitor, "bad monitor endpoint; latencies will not be reported to it");
        return None;
    };
    Some(MonitorServiceClient::new(
        endpoint
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(2))
            .connect_lazy(),
    ))
}

/// The longest a client with latencies to report waits between asking the routing nodes for
/// a monitor while they name none: a monitor started late is found within this, and a
/// cluster without one costs each client a map fetch this often.
const MAX_MONITOR_ASK_GAP: Duration = Duration::from_secs(15);

/// Sends the recorder's reports every `every` to the monitor `monitor` holds at the time,
/// until `owner` is dropped.
///
/// `learn` asks the routing nodes again (with the owner, while it lives) when there is a
/// report and no monitor to send it to: a client connected before its routing node knew of
/// the monitor (they started together), and one whose operations all succeed never fetches
/// the map again, so it would otherwise never hear of it.
pub(crate) async fn report_loop<T, F, Fut>(
    security: dinomo_security::Security,
    monitor: Arc<RwLock<Option<String>>>,
    every: Duration,
    recorder: Arc<Recorder>,
    owner: Weak<T>,
    learn: F,
) where
    T: Send + Sync + 'static,
    F: Fn(Arc<T>) -> Fut + Send,
    Fut: std::future::Future<Output = ()> + Send,
{
    let client_id = format!("{}-{:08x}", std::process::id(), rand::random::<u32>());
    let mut current: Option<(String, Option<MonitorServiceClient<Channel>>)> = None;
    // When to ask the routing nodes for a monitor next, and the gap after that one: doubled
    // while they name none (a cluster without a monitor), up to MAX_MONITOR_ASK_GAP.
    let mut next_ask = tokio::time::Instant::now();
    let mut ask_gap = every;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        if owner.strong_count() == 0 {
            return;
        }
        let Some(report) = recorder.take_report(&client_id) else {
            continue;
        };
        if monitor.read().is_none() && tokio::time::Instant::now() >= next_ask {
            // Only while there is something to report, and less often while none is named.
            if let Some(owner) = owner.upgrade() {
                learn(owner).await;
            }
            if monitor.read().is_none() {
                ask_gap = (ask_gap * 2).min(MAX_MONITOR_ASK_GAP);
            } else {
                ask_gap = every;
            }
            next_ask = tokio::time::Instant::now() + ask_gap;
        }
        let Some(addr) = monitor.read().clone() else {
            continue;
        };
        if current.as_ref().is_none_or(|(a, _)| *a != addr) {
            current = Some((addr.clone(), monitor_client(&security, &addr)));
        }
        if let Some((_, Some(client))) = current.as_mut() {
            if let Err(e) = client.report_latency(report).await {
                tracing::debug!(monitor = %addr, error = %e.message(), "latency report not delivered");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_summarises_the_interval_and_starts_a_new_one() {
        let r = Recorder::new();
        assert!(
            r.take_report("c").is_none(),
            "nothing recorded, nothing to say"
        );
        for i in 1..=100u64 {
            r.record(Some(1 + (i % 2) as u32), Duration::from_micros(i * 10));
        }
        let rep = r.take_report("c").expect("a report");
        assert_eq!(rep.count, 100);
        assert_eq!(rep.sum_us, (1..=100u64).map(|i| i * 10).sum::<u64>());
        assert!((980..=1010).contains(&rep.p99_us), "p99 {}", rep.p99_us);
        let total: u64 = rep.per_kn.iter().map(|k| k.count).sum();
        assert_eq!(total, 100);
        assert!(
            r.take_report("c").is_none(),
            "the next interval starts empty"
        );
    }

    /// Threads record into different shards; the report is their sum, as if one interval had
    /// recorded everything, and the shards start the next interval empty.
    #[test]
    fn a_report_merges_what_every_thread_recorded() {
        let r = Arc::new(Recorder::new());
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 1..=1000u64 {
                        let kn = if i % 4 == 0 {
                            None
                        } else {
                            Some(1 + (t % 3) as u32)
                        };
                        r.record(kn, Duration::from_micros(t * 1000 + i));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let rep = r.take_report("c").expect("a report");
        assert_eq!(rep.count, 8000);
        let sum: u64 = (0..8u64)
            .flat_map(|t| (1..=1000u64).map(move |i| t * 1000 + i))
            .sum();
        assert_eq!(rep.sum_us, sum);
        assert!((7800..=8100).contains(&rep.p99_us), "p99 {}", rep.p99_us);
        let mut per_kn: Vec<_> = rep.per_kn.iter().map(|k| (k.kn_id, k.count)).collect();
        per_kn.sort();
        // Threads 0, 3, 6 -> KN 1; 1, 4, 7 -> KN 2; 2, 5 -> KN 3; 750 of 1000 ops name a KN.
        assert_eq!(per_kn, vec![(1, 2250), (2, 2250), (3, 1500)]);
        let kn_sum: u64 = rep.per_kn.iter().map(|k| k.sum_us).sum();
        let expected: u64 = (0..8u64)
            .flat_map(|t| {
                (1..=1000u64)
                    .filter(|i| i % 4 != 0)
                    .map(move |i| t * 1000 + i)
            })
            .sum();
        assert_eq!(kn_sum, expected);
        assert!(
            r.take_report("c").is_none(),
            "the next interval starts empty"
        );
    }
}
