//! Client-side latency recording and reporting to the monitor (DINOMO 3.5: the M-node
//! "periodically collects latency information from clients").
//!
//! Every finished operation (a value, a definite error, or a deadline) is recorded with the KN
//! that answered its last attempt. Unless reporting is switched off, a background task sends
//! what was recorded since the previous report every `report_every` to the monitor known at
//! that moment (configured, or named by the routing nodes; it may change when another monitor
//! takes over), then starts a new interval; the task ends when the last clone of the client is
//! dropped. An interval with no monitor to send it to, or whose report cannot be delivered, is
//! dropped (the monitor then sees a quieter epoch; latencies are a signal, not a record).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use dinomo_placement::KnId;
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::{KnLatency, LatencyReport};
use hdrhistogram::Histogram;
use parking_lot::{Mutex, RwLock};
use tonic::transport::Channel;

/// What was recorded in one reporting interval.
#[derive(Debug)]
struct Interval {
    hist: Histogram<u64>,
    sum_us: u64,
    per_kn: HashMap<KnId, (u64, u64)>,
}

impl Interval {
    fn new() -> Self {
        Interval {
            // 1 µs .. 60 s at 2 significant digits: a few KiB.
            hist: Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
            sum_us: 0,
            per_kn: HashMap::new(),
        }
    }
}

/// Latencies recorded since the last report.
#[derive(Debug)]
pub(crate) struct Recorder {
    current: Mutex<Interval>,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Recorder {
            current: Mutex::new(Interval::new()),
        }
    }

    pub(crate) fn record(&self, kn: Option<KnId>, took: Duration) {
        let us = (took.as_micros() as u64).clamp(1, 60_000_000);
        let mut c = self.current.lock();
        c.hist.saturating_record(us);
        c.sum_us += us;
        if let Some(kn) = kn {
            let e = c.per_kn.entry(kn).or_default();
            e.0 += 1;
            e.1 += us;
        }
    }

    /// The interval so far as a report, and a fresh interval.
    pub(crate) fn take_report(&self, client_id: &str) -> Option<LatencyReport> {
        let done = std::mem::replace(&mut *self.current.lock(), Interval::new());
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
                .map(|(kn_id, (count, sum_us))| KnLatency {
                    kn_id,
                    count,
                    sum_us,
                })
                .collect(),
        })
    }
}

/// A MonitorService client for `monitor` (host:port or URL); `None` if it is not an address.
fn monitor_client(monitor: &str) -> Option<MonitorServiceClient<Channel>> {
    let url = if monitor.starts_with("http") {
        monitor.to_string()
    } else {
        format!("http://{monitor}")
    };
    let Ok(endpoint) = tonic::transport::Endpoint::from_shared(url) else {
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

/// Sends the recorder's reports every `every` to the monitor `monitor` holds at the time,
/// until `owner` is dropped.
pub(crate) async fn report_loop<T: Send + Sync + 'static>(
    monitor: Arc<RwLock<Option<String>>>,
    every: Duration,
    recorder: Arc<Recorder>,
    owner: Weak<T>,
) {
    let client_id = format!("{}-{:08x}", std::process::id(), rand::random::<u32>());
    let mut current: Option<(String, Option<MonitorServiceClient<Channel>>)> = None;
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
        let Some(addr) = monitor.read().clone() else {
            continue;
        };
        if current.as_ref().is_none_or(|(a, _)| *a != addr) {
            current = Some((addr.clone(), monitor_client(&addr)));
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
}
