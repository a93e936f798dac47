//! The monitor itself: what it knows about the cluster and how it acts on it.
//!
//! Three loops run while the monitor is up:
//! - **probe** (every `failure.probe_every_ms`): a Stats call to each KN of the published map
//!   is its heartbeat; a KN unanswered for `failure.failed_after_ms`, or reported dead by the
//!   orchestrator, is recovered at once ([`Monitor::recover_failed`]);
//! - **epoch** (every `policy.epoch_ms`, only while the orchestrator says this monitor leads):
//!   gathers the epoch's statistics (KN occupancy, ops and top keys; client latencies reported
//!   since the previous epoch), asks the policy engine for a decision and carries it out;
//! - the gRPC service (latency reports, Status, admin actions), in [`crate::service`].
//!
//! Invariants:
//! - One reconfiguration at a time (`reconfig` lock): every map change goes through
//!   `dinomo_client::admin::reconfigure_led` from the map of record, so versions only grow.
//! - Only the leader acts, and the DPM enforces it: when the orchestrator first says this
//!   monitor leads, [`Monitor::lead`] starts a new monitor term at the DPM, which from then on
//!   refuses the calls of every older term (a deposed monitor can no longer fence, merge,
//!   change cells or publish). Every DPM call of a reconfiguration carries the term, and
//!   leadership is re-checked before each of its steps (prepare, fence and merge, cells,
//!   publish): a reconfiguration that lost it aborts there. The map is published by
//!   compare-and-swap over the map the reconfiguration started from, so even two monitors
//!   that both believe they lead cannot make two maps of one version the map of record.
//! - A map change left unfinished by an earlier leader (recorded at the DPM before its first
//!   step, see `dinomo_client::admin`) is settled by the next one before it changes the map:
//!   [`Monitor::lead`] marks it pending when it takes a term, and the probe loop (so at start
//!   too) or the next reconfiguration resolves it: rolled back if it had not reached its
//!   point of no return (no fence, merge or cell change yet; undoing it is then exact and
//!   frees its KNs at once), finished otherwise (its cell changes cannot be undone, and every
//!   step is idempotent, so re-running them is safe).
//! - A KN is stopped by the orchestrator only after a map without it was published and its
//!   in-flight requests had `drain` to finish; a failed KN is fenced by the reconfiguration.
//! - Every decision, including "none", is logged with its reason and counted in
//!   `dinomo_monitor_decisions_total{action}`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dinomo_client::admin::{self, Leadership, ReconfigReport};
use dinomo_client::ClientError;
use dinomo_placement::{ClusterMap, KnId};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use dinomo_proto::kv::KnStatsRequest;
use dinomo_proto::monitor::LatencyReport;
use dinomo_proto::routing::routing_service_client::RoutingServiceClient;
use dinomo_proto::routing::GetClusterMapRequest;
use parking_lot::Mutex;
use tonic::transport::Channel;

use crate::config::{MonitorConfig, PolicyConfig};
use crate::orchestrator::Orchestrator;
use crate::policy::{Decision, EpochStats, KeyFreq, KnEpoch, PolicyState};

/// A decision as the Status RPC shows it.
#[derive(Debug, Clone)]
pub struct DecisionRecord {
    pub at: SystemTime,
    pub action: String,
    pub reason: String,
    pub map_version: u64,
}

/// One KN as last seen.
#[derive(Debug, Clone, Default)]
pub struct KnView {
    pub endpoint: String,
    pub occupancy: f64,
    pub ops: u64,
    pub alive: bool,
}

/// What the last epoch saw (for Status and the bench timelines).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub epoch: u64,
    pub map_version: u64,
    pub kns: BTreeMap<KnId, KnView>,
    pub avg_latency_us: f64,
    pub p99_latency_us: f64,
    pub replicated: BTreeMap<Vec<u8>, u32>,
}

/// A finished failure recovery.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub kn: KnId,
    /// Detection -> new map published at the DPM.
    pub to_published: Duration,
    /// Detection -> a routing node serves the new map (None: no routing node configured).
    pub to_served: Option<Duration>,
    pub report: ReconfigReport,
}

/// Client latencies reported since the last epoch.
#[derive(Debug, Default)]
struct LatencyAgg {
    count: u64,
    sum_us: u64,
    /// Sum over reports of count * p99 (the epoch's p99 is their count-weighted mean: an
    /// approximation, as percentiles do not add).
    p99_weighted: f64,
    per_kn: HashMap<KnId, (u64, u64)>,
}

/// The most a latency report may say a request took (p99, and the mean): one hour.
pub const MAX_REPORTED_LATENCY_US: u64 = 3_600_000_000;
/// The most `per_kn` entries one latency report may carry.
pub const MAX_REPORT_KNS: usize = 1024;
/// The longest `client_id` a latency report may carry, in bytes.
pub const MAX_CLIENT_ID: usize = 128;
/// The most reporting clients the monitor keeps; a new one beyond evicts the longest silent.
pub const MAX_CLIENTS: usize = 10_000;

/// The clients heard from, by how recently: bounded by [`MAX_CLIENTS`], so ids made up by the
/// report cannot grow it.
#[derive(Debug, Default)]
struct Clients {
    /// client id -> the sequence number of its last report.
    last: HashMap<String, u64>,
    /// The same, ordered by sequence number: the first is the longest silent.
    by_age: BTreeMap<u64, String>,
    seq: u64,
}

impl Clients {
    /// Notes a report from `id`; evicts the longest silent client if a new one is over the cap.
    fn heard(&mut self, id: &str) {
        self.seq += 1;
        let seq = self.seq;
        match self.last.get_mut(id) {
            Some(s) => {
                self.by_age.remove(s);
                *s = seq;
            }
            None => {
                if self.last.len() >= MAX_CLIENTS {
                    if let Some((_, oldest)) = self.by_age.pop_first() {
                        self.last.remove(&oldest);
                    }
                }
                self.last.insert(id.to_string(), seq);
            }
        }
        self.by_age.insert(seq, id.to_string());
    }
}

/// Checks a latency report (decision 0005): it counts requests, its latencies are at most an
/// hour, its per-KN part is within its totals (checked arithmetic) and bounded in size, and
/// its client id is short. The error says what is wrong.
pub fn check_report(r: &LatencyReport) -> Result<(), String> {
    if r.count == 0 {
        return Err("a latency report must count requests".into());
    }
    if r.client_id.len() > MAX_CLIENT_ID {
        return Err(format!(
            "client_id is {} bytes; at most {MAX_CLIENT_ID}",
            r.client_id.len()
        ));
    }
    let mean = r.sum_us / r.count;
    if r.p99_us > MAX_REPORTED_LATENCY_US || mean > MAX_REPORTED_LATENCY_US {
        return Err(format!(
            "p99 {} us and mean {mean} us: latencies over an hour ({MAX_REPORTED_LATENCY_US} \
             us) are not reported",
            r.p99_us
        ));
    }
    if r.per_kn.len() > MAX_REPORT_KNS {
        return Err(format!(
            "{} per-KN entries; at most {MAX_REPORT_KNS}",
            r.per_kn.len()
        ));
    }
    let mut kn_count = 0u64;
    for k in &r.per_kn {
        kn_count = kn_count
            .checked_add(k.count)
            .filter(|&c| c <= r.count)
            .ok_or_else(|| {
                format!(
                    "the per-KN counts add up to more than the report's count {}",
                    r.count
                )
            })?;
        if k.sum_us > r.sum_us {
            return Err(format!(
                "KN {}'s latency sum {} us is over the report's sum {} us",
                k.kn_id, k.sum_us, r.sum_us
            ));
        }
    }
    Ok(())
}

/// Per-KN probe state.
#[derive(Debug)]
struct Probe {
    last_ok: Instant,
    /// Cumulative gets + puts + deletes at the previous epoch.
    last_ops: Option<u64>,
}

/// Settings that are not in the config file (they come from the command line).
#[derive(Debug, Clone, Default)]
pub struct MonitorOptions {
    /// Routing nodes whose serving of a new map is timed after a failure recovery.
    pub routing: Vec<String>,
    /// How long a removed KN keeps running after the map without it is published, so that
    /// requests already sent to it complete.
    pub drain: Duration,
}

/// Least time between two attempts to start a replacement KN after a failed one, and the most
/// it grows to (see [`Monitor::replace_below_floor`]).
const REPLACE_EVERY: Duration = Duration::from_secs(5);
const REPLACE_EVERY_MAX: Duration = Duration::from_secs(120);

/// A replacement KN being started, or when the next may be.
#[derive(Debug, Default)]
struct Replacement {
    running: bool,
    not_before: Option<Instant>,
    backoff: Duration,
}

/// The monitor.
#[derive(Debug)]
pub struct Monitor {
    pub cfg: MonitorConfig,
    pub opts: MonitorOptions,
    orchestrator: Arc<dyn Orchestrator>,
    latency: Mutex<LatencyAgg>,
    /// The clients that reported latencies ([`MAX_CLIENTS`] at most).
    clients: Mutex<Clients>,
    /// The KNs of the map of record as last read: per-KN latencies of other ids are dropped.
    members: Mutex<std::collections::HashSet<KnId>>,
    policy: Mutex<PolicyState>,
    /// The policy parameters in force (`cfg.policy` at start; SetPolicy replaces them).
    policy_cfg: Mutex<PolicyConfig>,
    reconfig: tokio::sync::Mutex<()>,
    probes: Mutex<HashMap<KnId, Probe>>,
    /// When the last probe round ended: a long gap means this monitor itself was stalled
    /// (SIGSTOP, a frozen VM), and silence it did not watch proves nothing about the KNs.
    last_probe_round: Mutex<Option<Instant>>,
    /// [`Monitor::replace_below_floor`]'s state.
    replacement: Mutex<Replacement>,
    channels: Mutex<HashMap<String, KvServiceClient<Channel>>>,
    snapshot: Mutex<Snapshot>,
    decisions: Mutex<VecDeque<DecisionRecord>>,
    recoveries: Mutex<Vec<Recovery>>,
    epoch: Mutex<u64>,
    /// The DPM monitor term this monitor holds while it leads (None: not leading). An async
    /// lock, held across the leadership check, so one term is started per leadership.
    term: tokio::sync::Mutex<Option<u64>>,
    /// Set when a new term starts: an unfinished reconfiguration recorded at the DPM is to be
    /// resolved before this monitor changes the map ([`Monitor::resolve_unfinished`]).
    resolve_pending: AtomicBool,
    /// The MonitorService address to publish for clients ([`Monitor::advertise`]), and the
    /// term it was last published under.
    endpoint: Mutex<(Option<String>, Option<u64>)>,
}

/// A reconfiguration driven by this monitor under `term` (see [`Monitor::lead`]).
struct Led<'a> {
    monitor: &'a Monitor,
    term: u64,
}

impl Leadership for Led<'_> {
    fn term(&self) -> Option<u64> {
        Some(self.term)
    }

    async fn check(&self, step: &'static str) -> dinomo_client::Result<()> {
        let lost = |why: String| {
            ClientError::Other(format!(
                "reconfiguration aborted before its {step} step: {why}"
            ))
        };
        match self.monitor.lead().await {
            Ok(Some(t)) if t == self.term => Ok(()),
            Ok(Some(t)) => Err(lost(format!(
                "this monitor lost its leadership (term {}) and took it again (term {t}) \
                 meanwhile",
                self.term
            ))),
            Ok(None) => Err(lost(format!(
                "this monitor no longer leads (term {})",
                self.term
            ))),
            Err(e) => Err(lost(format!(
                "cannot tell whether this monitor still leads: {e:#}"
            ))),
        }
    }
}

fn kn_channel(endpoint: &str, timeout: Duration) -> Option<KvServiceClient<Channel>> {
    let ep = dinomo_security::Security::of_process()
        .endpoint(endpoint, dinomo_security::Service::Kv)
        .ok()?;
    Some(KvServiceClient::new(
        ep.connect_timeout(timeout)
            .timeout(timeout)
            .tcp_nodelay(true)
            .connect_lazy(),
    ))
}

impl Monitor {
    pub fn new(
        cfg: MonitorConfig,
        opts: MonitorOptions,
        orchestrator: Arc<dyn Orchestrator>,
    ) -> Arc<Self> {
        let policy_cfg = Mutex::new(cfg.policy.clone());
        Arc::new(Monitor {
            cfg,
            opts,
            orchestrator,
            latency: Mutex::new(LatencyAgg::default()),
            clients: Mutex::new(Clients::default()),
            members: Mutex::new(Default::default()),
            // A starting monitor counts as a membership change: the cluster it finds (or just
            // started) gets the grace period before the policy adds or removes anything.
            policy: Mutex::new({
                let mut p = PolicyState::new();
                p.note_membership_change(Instant::now());
                p
            }),
            policy_cfg,
            reconfig: tokio::sync::Mutex::new(()),
            probes: Mutex::new(HashMap::new()),
            last_probe_round: Mutex::new(None),
            replacement: Mutex::new(Replacement::default()),
            channels: Mutex::new(HashMap::new()),
            snapshot: Mutex::new(Snapshot::default()),
            decisions: Mutex::new(VecDeque::new()),
            recoveries: Mutex::new(Vec::new()),
            epoch: Mutex::new(0),
            term: tokio::sync::Mutex::new(None),
            resolve_pending: AtomicBool::new(false),
            endpoint: Mutex::new((None, None)),
        })
    }

    /// Where clients reach this monitor's MonitorService, bound at `listening`:
    /// `server.advertise`, else `listening` unless its address is unspecified. While it leads,
    /// the monitor publishes it at the DPM (once per term, see [`Monitor::lead`]) and routing
    /// nodes hand it to clients, which then report their latencies here by default.
    pub fn advertise(&self, listening: std::net::SocketAddr) {
        let endpoint = if !self.cfg.server.advertise.is_empty() {
            Some(self.cfg.server.advertise.clone())
        } else if listening.ip().is_unspecified() {
            tracing::warn!(
                %listening,
                "server.advertise is not set and the monitor listens on every address: its \
                 address is not published, so clients will not report latencies unless told \
                 where it is"
            );
            None
        } else {
            Some(listening.to_string())
        };
        *self.endpoint.lock() = (endpoint, None);
    }

    /// Publishes the advertised address under `term` unless it already was. A failure is
    /// logged and retried at the next [`Monitor::lead`]: it costs only latency reports.
    async fn publish_endpoint(&self, term: u64) {
        let addr = match &*self.endpoint.lock() {
            (Some(addr), published) if *published != Some(term) => addr.clone(),
            _ => return,
        };
        match admin::publish_monitor_endpoint(self.dpm(), term, &addr).await {
            Ok(()) => {
                tracing::info!(monitor = %addr, term, "published this monitor's address for clients");
                let mut e = self.endpoint.lock();
                if e.0.as_deref() == Some(&addr) {
                    e.1 = Some(term);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot publish this monitor's address; retrying"),
        }
    }

    /// Whether this monitor may act now, and under which DPM monitor term. Asks the
    /// orchestrator (which renews the Lease on Kubernetes); on becoming leader, starts a new
    /// term at the DPM, which deposes every other monitor there. Losing leadership, or not
    /// being able to tell, drops the term: acting again takes a new one.
    pub async fn lead(&self) -> anyhow::Result<Option<u64>> {
        let mut term = self.term.lock().await;
        match self.orchestrator.is_leader().await {
            Ok(true) => {
                if let Some(t) = *term {
                    self.publish_endpoint(t).await;
                    return Ok(Some(t));
                }
                let t = admin::new_monitor_term(self.dpm()).await?;
                metrics::gauge!("dinomo_monitor_term").set(t as f64);
                tracing::info!(term = t, "leading: started a new monitor term at the DPM");
                *term = Some(t);
                // The previous leader may have crashed in the middle of a map change.
                self.resolve_pending.store(true, Ordering::Release);
                self.publish_endpoint(t).await;
                Ok(Some(t))
            }
            Ok(false) => {
                if let Some(t) = term.take() {
                    tracing::warn!(term = t, "lost leadership; standing by");
                }
                Ok(None)
            }
            Err(e) => {
                if let Some(t) = term.take() {
                    tracing::warn!(term = t, error = %e, "cannot tell whether this monitor leads; standing by");
                }
                Err(e.into())
            }
        }
    }

    pub fn orchestrator(&self) -> &Arc<dyn Orchestrator> {
        &self.orchestrator
    }

    fn dpm(&self) -> &str {
        &self.cfg.server.dpm
    }

    /// Starts the probe and epoch loops (they end when the monitor is dropped).
    pub fn spawn_loops(self: &Arc<Self>) {
        tokio::spawn(probe_loop(Arc::downgrade(self)));
        tokio::spawn(epoch_loop(Arc::downgrade(self)));
    }

    /// A client's latency report, refused (with why) if [`check_report`] refuses it. Per-KN
    /// entries of KNs not in the map of record (as last read) are dropped; totals saturate.
    pub fn report(&self, r: &LatencyReport) -> Result<(), String> {
        check_report(r)?;
        let clients = {
            let mut c = self.clients.lock();
            c.heard(&r.client_id);
            c.last.len()
        };
        metrics::gauge!("dinomo_monitor_reporting_clients").set(clients as f64);
        let members = self.members.lock();
        let mut l = self.latency.lock();
        l.count = l.count.saturating_add(r.count);
        l.sum_us = l.sum_us.saturating_add(r.sum_us);
        l.p99_weighted += r.count as f64 * r.p99_us as f64;
        for k in r.per_kn.iter().filter(|k| members.contains(&k.kn_id)) {
            let e = l.per_kn.entry(k.kn_id).or_default();
            e.0 = e.0.saturating_add(k.count);
            e.1 = e.1.saturating_add(k.sum_us);
        }
        Ok(())
    }

    /// How many clients the monitor keeps as reporting (at most [`MAX_CLIENTS`]).
    pub fn reporting_clients(&self) -> usize {
        self.clients.lock().last.len()
    }

    /// The policy parameters in force.
    pub fn policy_config(&self) -> PolicyConfig {
        self.policy_cfg.lock().clone()
    }

    /// Replaces the policy parameters (validated first; the grace period in progress stays).
    pub fn set_policy(&self, p: PolicyConfig) -> anyhow::Result<()> {
        p.validate()?;
        tracing::info!(policy = ?p, "policy parameters replaced");
        *self.policy_cfg.lock() = p;
        Ok(())
    }

    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.lock().clone()
    }

    pub fn decisions(&self) -> Vec<DecisionRecord> {
        self.decisions.lock().iter().cloned().collect()
    }

    pub fn recoveries(&self) -> Vec<Recovery> {
        self.recoveries.lock().clone()
    }

    fn record(&self, action: &str, reason: &str, map_version: u64) {
        metrics::counter!("dinomo_monitor_decisions_total", "action" => action.to_string())
            .increment(1);
        let mut d = self.decisions.lock();
        d.push_back(DecisionRecord {
            at: SystemTime::now(),
            action: action.to_string(),
            reason: reason.to_string(),
            map_version,
        });
        while d.len() > self.cfg.server.recent_decisions.max(1) {
            d.pop_front();
        }
    }

    fn channel(&self, endpoint: &str) -> Option<KvServiceClient<Channel>> {
        let mut c = self.channels.lock();
        if let Some(ch) = c.get(endpoint) {
            return Some(ch.clone());
        }
        let ch = kn_channel(endpoint, self.cfg.stats.kn_stats_timeout())?;
        c.insert(endpoint.to_string(), ch.clone());
        Some(ch)
    }

    /// The map of record.
    pub async fn current_map(&self) -> anyhow::Result<ClusterMap> {
        let map = admin::published_map(self.dpm())
            .await?
            .ok_or_else(|| anyhow::anyhow!("no cluster map has been published yet"))?;
        *self.members.lock() = map.kn_ids().collect();
        Ok(map)
    }

    async fn reconfigure(
        &self,
        current: &ClusterMap,
        next: &ClusterMap,
    ) -> anyhow::Result<ReconfigReport> {
        self.reconfigure_without(current, next, &[]).await
    }

    async fn reconfigure_without(
        &self,
        current: &ClusterMap,
        next: &ClusterMap,
        dead: &[KnId],
    ) -> anyhow::Result<ReconfigReport> {
        let Some(term) = self.lead().await? else {
            anyhow::bail!("this monitor does not lead; only the active monitor changes the map");
        };
        // Caller holds the reconfiguration lock. If this settles an earlier change, `current`
        // is stale and the reconfiguration below fails fast; the caller retries.
        self.resolve_pending_locked(term).await?;
        let led = Led {
            monitor: self,
            term,
        };
        let r = match admin::reconfigure_led(self.dpm(), current, next, dead, &led).await {
            Ok(r) => r,
            Err(e) => {
                // It may have stopped half-way (the DPM restarted, a KN hung) and left its
                // record at the DPM: this leader settles it too, as it would an earlier
                // leader's, before its next change (else every later change is refused).
                self.resolve_pending.store(true, Ordering::Release);
                return Err(e.into());
            }
        };
        metrics::gauge!("dinomo_monitor_map_version").set(next.version as f64);
        metrics::gauge!("dinomo_monitor_kns").set(next.kns.len() as f64);
        metrics::gauge!("dinomo_monitor_replicated_keys").set(next.replicated.len() as f64);
        Ok(r)
    }

    /// Settles a reconfiguration that an earlier leader left unfinished, if this monitor
    /// leads and has not checked since it took its term or since one of its own changes
    /// failed (`admin::resolve_unfinished`: finished if it passed its point of no return,
    /// rolled back otherwise). Called by the probe loop, so at start, after every change of
    /// leader and after a failed change, and before each map change.
    pub async fn resolve_unfinished(&self) -> anyhow::Result<()> {
        if !self.resolve_pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some(term) = self.lead().await? else {
            return Ok(());
        };
        let _g = self.reconfig.lock().await;
        self.resolve_pending_locked(term).await
    }

    /// [`Monitor::resolve_unfinished`] under the reconfiguration lock.
    async fn resolve_pending_locked(&self, term: u64) -> anyhow::Result<()> {
        if !self.resolve_pending.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let led = Led {
            monitor: self,
            term,
        };
        let resolution = match admin::resolve_unfinished(self.dpm(), &led).await {
            Ok(r) => r,
            Err(e) => {
                self.resolve_pending.store(true, Ordering::Release);
                return Err(anyhow::Error::new(e)
                    .context("resolving a reconfiguration left unfinished by an earlier leader"));
            }
        };
        let (reason, version) = match resolution {
            None => return Ok(()),
            Some(admin::Resolution::WasPublished { version }) => (
                "an earlier leader's change was published; its record deleted".to_string(),
                version,
            ),
            Some(admin::Resolution::Superseded { version }) => (
                "an earlier leader's change was superseded; its record deleted".to_string(),
                version,
            ),
            Some(admin::Resolution::RolledBack { version }) => (
                "an earlier leader's change stopped before its point of no return: rolled back"
                    .to_string(),
                version,
            ),
            Some(admin::Resolution::Finished(r)) => {
                self.policy.lock().note_membership_change(Instant::now());
                (
                    format!(
                        "an earlier leader's change (map {} -> {}) was past its point of no \
                         return: finished",
                        r.from_version, r.to_version
                    ),
                    r.to_version,
                )
            }
        };
        tracing::warn!(%reason, map_version = version, "unfinished reconfiguration resolved");
        self.record("resolve_reconfiguration", &reason, version);
        Ok(())
    }

    // ---------------------------------------------------------------- actions

    /// Starts a KN and adds it to the map. Returns the KN and the new map version.
    pub async fn add_kn(&self, reason: &str) -> anyhow::Result<(KnId, u64)> {
        // Starting a KN takes seconds: not under the reconfiguration lock, so a failure is
        // recovered meanwhile. It owns nothing until the map below names it.
        let info = self.orchestrator.add_kn().await?;
        let kn = info.id;
        let r = async {
            let _g = self.reconfig.lock().await;
            let current = self.current_map().await?;
            let next = current.with_kn_added(info)?;
            self.reconfigure(&current, &next).await
        }
        .await;
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                // Not in the map: stop it rather than leave it running, owning nothing. (If
                // the change failed after publishing, the KN is a member: keep it.)
                let member = self.current_map().await.map(|m| m.contains(kn));
                if matches!(member, Ok(false)) {
                    if let Err(stop) = self.orchestrator.remove_kn(kn).await {
                        tracing::warn!(kn, error = %stop, "could not stop a KN the map did not take");
                    }
                }
                return Err(e);
            }
        };
        self.probes.lock().insert(
            kn,
            Probe {
                last_ok: Instant::now(),
                last_ops: None,
            },
        );
        self.policy.lock().note_membership_change(Instant::now());
        tracing::info!(kn, map_version = r.to_version, %reason, "KN added");
        self.record("add_kn", &format!("KN {kn}: {reason}"), r.to_version);
        Ok((kn, r.to_version))
    }

    /// Removes `kn` from the map, lets its requests drain, then stops it. Never goes below
    /// the policy's `min_kns` (nor below one KN).
    pub async fn remove_kn(&self, kn: KnId, reason: &str) -> anyhow::Result<u64> {
        let version = {
            let _g = self.reconfig.lock().await;
            let current = self.current_map().await?;
            if !current.contains(kn) {
                anyhow::bail!(not_in_map(kn, &current));
            }
            let floor = self.policy_config().min_kns.max(1) as usize;
            if current.kns.len() <= floor {
                anyhow::bail!(
                    "removing KN {kn} would leave {} KN(s), below policy.min_kns = {floor}",
                    current.kns.len() - 1
                );
            }
            let next = current.with_kn_removed(kn)?;
            let r = self.reconfigure(&current, &next).await?;
            self.probes.lock().remove(&kn);
            self.policy.lock().note_membership_change(Instant::now());
            r.to_version
        };
        // Outside the reconfiguration lock: a failure elsewhere is recovered meanwhile.
        tokio::time::sleep(self.opts.drain).await;
        if let Err(e) = self.orchestrator.remove_kn(kn).await {
            tracing::warn!(kn, error = %e, "the orchestrator could not stop the removed KN");
        }
        tracing::info!(kn, map_version = version, %reason, "KN removed");
        self.record("remove_kn", &format!("KN {kn}: {reason}"), version);
        Ok(version)
    }

    /// Failure recovery (DINOMO 3.5): a map without `kn` is made the map of record; the
    /// reconfiguration fences the dead KN's epoch and merges all of its logs first.
    pub async fn recover_failed(
        &self,
        kn: KnId,
        detected: Instant,
        how: &str,
    ) -> anyhow::Result<Option<Recovery>> {
        let _g = self.reconfig.lock().await;
        let current = self.current_map().await?;
        if !current.contains(kn) {
            return Ok(None);
        }
        tracing::warn!(kn, %how, "KN failure detected; recovering");
        metrics::counter!("dinomo_monitor_kn_failures_total").increment(1);
        let next = current.with_kn_removed(kn)?;
        let report = self.reconfigure_without(&current, &next, &[kn]).await?;
        let to_published = detected.elapsed();
        self.probes.lock().remove(&kn);
        self.policy.lock().note_membership_change(Instant::now());
        drop(_g);
        let to_served = self.wait_served(next.version, detected).await;
        metrics::histogram!("dinomo_monitor_recovery_seconds").record(to_published.as_secs_f64());
        let rec = Recovery {
            kn,
            to_published,
            to_served,
            report,
        };
        tracing::info!(
            kn,
            map_version = next.version,
            to_published_ms = to_published.as_secs_f64() * 1e3,
            to_served_ms = to_served.map(|d| d.as_secs_f64() * 1e3),
            fenced = ?rec.report.fenced,
            merged_entries = rec.report.merged_entries,
            "KN failure recovered"
        );
        self.record(
            "recover_failed_kn",
            &format!(
                "KN {kn} {how}; recovered {:.1} ms after detection (map served after {})",
                to_published.as_secs_f64() * 1e3,
                to_served.map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
            ),
            next.version,
        );
        self.recoveries.lock().push(rec.clone());
        Ok(Some(rec))
    }

    /// After failures, the map may hold fewer KNs than `policy.min_kns` (at least one): with
    /// none, nobody serves any key. Starts a replacement in the background (starting a KN
    /// takes seconds, which failure detection must not wait for): one at a time, and after a
    /// failed attempt not again for [`REPLACE_EVERY`], doubling up to [`REPLACE_EVERY_MAX`],
    /// so a platform that cannot start KNs is not hammered.
    pub async fn replace_below_floor(self: &Arc<Self>) {
        let floor = self.policy_config().min_kns.max(1) as usize;
        let Ok(map) = self.current_map().await else {
            return;
        };
        if map.kns.len() >= floor {
            return;
        }
        {
            let mut r = self.replacement.lock();
            if r.running || r.not_before.is_some_and(|t| Instant::now() < t) {
                return;
            }
            r.running = true;
        }
        let reason = format!(
            "the map holds {} KN(s) after failures, below policy.min_kns = {floor}",
            map.kns.len()
        );
        tracing::warn!(%reason, "starting a replacement KN");
        let mon = self.clone();
        tokio::spawn(async move {
            let ok = match mon.add_kn(&reason).await {
                Ok(_) => true,
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "starting a replacement KN failed; will retry");
                    false
                }
            };
            let mut r = mon.replacement.lock();
            r.running = false;
            r.backoff = if ok {
                REPLACE_EVERY
            } else {
                (r.backoff * 2).clamp(REPLACE_EVERY, REPLACE_EVERY_MAX)
            };
            r.not_before = (!ok).then(|| Instant::now() + r.backoff);
        });
    }

    /// Waits (up to 5 s) until a routing node serves map `version`.
    async fn wait_served(&self, version: u64, since: Instant) -> Option<Duration> {
        let r = self.opts.routing.first()?;
        let ep = dinomo_security::Security::of_process()
            .endpoint(r, dinomo_security::Service::Routing)
            .ok()?;
        let mut c = RoutingServiceClient::new(ep.timeout(Duration::from_secs(5)).connect_lazy());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let got = c
                .get_cluster_map(GetClusterMapRequest {
                    newer_than: Some(version - 1),
                })
                .await;
            if got.is_ok_and(|m| m.into_inner().version >= version) {
                return Some(since.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        None
    }

    /// Replicates hot keys: key -> replication factor (owners: the first R KNs clockwise).
    pub async fn replicate(&self, keys: &[(Vec<u8>, u32)], reason: &str) -> anyhow::Result<u64> {
        let _g = self.reconfig.lock().await;
        let current = self.current_map().await?;
        let mut next = current.clone();
        for (key, r) in keys {
            let owners = current.replica_candidates(key, *r as usize);
            if owners.len() < 2 {
                // Fewer KNs now than when the policy decided: nothing to share the key with.
                continue;
            }
            next = next.with_replicated(key.clone(), owners)?;
        }
        if next.replicated == current.replicated {
            anyhow::bail!(
                "no key can be replicated over the current {} KN(s)",
                current.kns.len()
            );
        }
        next.version = current.version + 1;
        let rep = self.reconfigure(&current, &next).await?;
        tracing::info!(keys = keys.len(), map_version = rep.to_version, %reason, "hot keys replicated");
        self.record("replicate", reason, rep.to_version);
        Ok(rep.to_version)
    }

    /// De-replicates keys (their cells' values go back to the index).
    pub async fn dereplicate(&self, keys: &[Vec<u8>], reason: &str) -> anyhow::Result<u64> {
        let _g = self.reconfig.lock().await;
        let current = self.current_map().await?;
        let mut next = current.clone();
        for key in keys {
            next = next.with_replicated(key.clone(), Vec::new())?;
        }
        next.version = current.version + 1;
        let rep = self.reconfigure(&current, &next).await?;
        tracing::info!(keys = keys.len(), map_version = rep.to_version, %reason, "keys de-replicated");
        self.record("dereplicate", reason, rep.to_version);
        Ok(rep.to_version)
    }

    // ---------------------------------------------------------------- loops

    /// One round of heartbeats; returns the KNs found failed (with how).
    async fn probe_once(&self) -> Vec<(KnId, String)> {
        let round_started = Instant::now();
        let Ok(map) = self.current_map().await else {
            return Vec::new();
        };
        let mut failed = Vec::new();
        match self.orchestrator.failed_kns().await {
            Ok(dead) => {
                for kn in dead.into_iter().filter(|&k| map.contains(k)) {
                    failed.push((
                        kn,
                        format!(
                            "reported dead by the {} orchestrator",
                            self.orchestrator.name()
                        ),
                    ));
                }
            }
            Err(e) => tracing::debug!(error = %e, "orchestrator failure query failed"),
        }
        let calls = map.kns.iter().map(|k| {
            let ch = self.channel(&k.endpoint);
            let id = k.id;
            async move {
                let ok = match ch {
                    Some(mut c) => c.stats(KnStatsRequest { top_keys: 0 }).await.is_ok(),
                    None => false,
                };
                (id, ok)
            }
        });
        let results = futures::future::join_all(calls).await;
        let now = Instant::now();
        let after = self.cfg.failure.failed_after();
        let mut probes = self.probes.lock();
        // From the end of the last round to the start of this one: not the time this round
        // waited for a hung KN, which is the silence being measured.
        let previous = self.last_probe_round.lock().replace(now);
        if let Some(gap) = previous.map(|t| round_started.saturating_duration_since(t)) {
            if gap > after / 2 {
                // This monitor did not probe for that long: it was stalled, not the KNs. Their
                // heartbeat clocks start again now; a KN that is really gone misses the next
                // `failed_after` of heartbeats too.
                tracing::warn!(
                    gap_ms = gap.as_millis() as u64,
                    "the monitor itself was stalled; restarting the KNs' heartbeat clocks"
                );
                for p in probes.values_mut() {
                    p.last_ok = now;
                }
            }
        }
        for (kn, ok) in results {
            let p = probes.entry(kn).or_insert(Probe {
                last_ok: now,
                last_ops: None,
            });
            if ok {
                p.last_ok = now;
            } else if now.duration_since(p.last_ok) >= after && !failed.iter().any(|f| f.0 == kn) {
                failed.push((
                    kn,
                    format!(
                        "missed heartbeats for {} ms",
                        now.duration_since(p.last_ok).as_millis()
                    ),
                ));
            }
        }
        probes.retain(|kn, _| map.contains(*kn));
        failed
    }

    /// One decision epoch: gather, decide, act.
    pub async fn run_epoch(&self) -> anyhow::Result<Decision> {
        let epoch = {
            let mut e = self.epoch.lock();
            *e += 1;
            *e
        };
        let map = self.current_map().await?;
        let top = self.cfg.stats.top_keys;
        let calls = map.kns.iter().map(|k| {
            let ch = self.channel(&k.endpoint);
            let id = k.id;
            async move {
                let r = match ch {
                    Some(mut c) => c.stats(KnStatsRequest { top_keys: top }).await.ok(),
                    None => None,
                };
                (id, r.map(|r| r.into_inner()))
            }
        });
        let results = futures::future::join_all(calls).await;
        let lat = std::mem::take(&mut *self.latency.lock());
        let mut kns = Vec::new();
        let mut views = BTreeMap::new();
        let mut keys: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
        let mut total_ops = 0u64;
        {
            let mut probes = self.probes.lock();
            for (id, r) in results {
                let endpoint = map.endpoint(id).unwrap_or_default().to_string();
                let Some(s) = r else {
                    views.insert(
                        id,
                        KnView {
                            endpoint,
                            alive: false,
                            ..Default::default()
                        },
                    );
                    continue;
                };
                let cumulative = s.gets + s.puts + s.deletes;
                let p = probes.entry(id).or_insert(Probe {
                    last_ok: Instant::now(),
                    last_ops: None,
                });
                let ops = p.last_ops.map_or(0, |l| cumulative.saturating_sub(l));
                p.last_ops = Some(cumulative);
                total_ops += ops;
                kns.push(KnEpoch {
                    id,
                    occupancy: s.occupancy,
                    ops,
                });
                views.insert(
                    id,
                    KnView {
                        endpoint,
                        occupancy: s.occupancy,
                        ops,
                        alive: true,
                    },
                );
                for k in s.top_keys {
                    *keys.entry(k.key.to_vec()).or_default() += k.count;
                }
            }
        }
        // KNs' top-key counters halve every second, so a steady rate r per second shows as about
        // 2r: halve them to put them on the same per-epoch scale as `total_ops`.
        let epoch_secs = self.policy_config().epoch().as_secs_f64().max(1e-3);
        let scale = epoch_secs / 2.0;
        let keys: Vec<KeyFreq> = keys
            .into_iter()
            .map(|(key, count)| {
                let owner = map.owner(&key).unwrap_or_default();
                KeyFreq {
                    key,
                    count: (count as f64 * scale).round() as u64,
                    owner,
                }
            })
            .collect();
        let (avg, p99) = if lat.count > 0 {
            (
                Some(lat.sum_us as f64 / lat.count as f64),
                Some(lat.p99_weighted / lat.count as f64),
            )
        } else {
            (None, None)
        };
        let kn_latency_us = lat
            .per_kn
            .iter()
            .filter(|(_, (c, _))| *c > 0)
            .map(|(&kn, &(c, s))| (kn, s as f64 / c as f64))
            .collect();
        let replicated: BTreeMap<Vec<u8>, u32> = map
            .replicated
            .iter()
            .map(|(k, o)| (k.clone(), o.len() as u32))
            .collect();
        let stats = EpochStats {
            epoch,
            kns,
            avg_latency_us: avg,
            p99_latency_us: p99,
            kn_latency_us,
            keys,
            total_ops,
            replicated: replicated.clone(),
        };
        if let Some(a) = avg {
            metrics::gauge!("dinomo_monitor_avg_latency_us").set(a);
        }
        if let Some(p) = p99 {
            metrics::gauge!("dinomo_monitor_p99_latency_us").set(p);
        }
        *self.snapshot.lock() = Snapshot {
            epoch,
            map_version: map.version,
            kns: views,
            avg_latency_us: avg.unwrap_or(0.0),
            p99_latency_us: p99.unwrap_or(0.0),
            replicated,
        };
        let decision = self
            .policy
            .lock()
            .decide(&self.policy_config(), &stats, Instant::now());
        self.act(&decision).await;
        Ok(decision)
    }

    async fn act(&self, d: &Decision) {
        let result = match d {
            Decision::None { reason } => {
                tracing::debug!(%reason, "policy: no action");
                self.record("none", reason, 0);
                Ok(())
            }
            Decision::AddKn { reason } => {
                tracing::info!(%reason, "policy: add a KN");
                self.add_kn(reason).await.map(|_| ())
            }
            Decision::RemoveKn { kn, reason } => {
                let candidates = [*kn];
                let kn = self.orchestrator.removal_choice(&candidates).unwrap_or(*kn);
                tracing::info!(kn, %reason, "policy: remove a KN");
                self.remove_kn(kn, reason).await.map(|_| ())
            }
            Decision::Replicate { keys, reason } => {
                tracing::info!(keys = keys.len(), %reason, "policy: replicate hot keys");
                self.replicate(keys, reason).await.map(|_| ())
            }
            Decision::Dereplicate { keys, reason } => {
                tracing::info!(keys = keys.len(), %reason, "policy: de-replicate cold keys");
                self.dereplicate(keys, reason).await.map(|_| ())
            }
        };
        if let Err(e) = result {
            tracing::error!(action = d.action(), error = %e, "carrying out the decision failed");
            metrics::counter!("dinomo_monitor_action_errors_total", "action" => d.action().to_string())
                .increment(1);
        }
    }
}

async fn probe_loop(m: std::sync::Weak<Monitor>) {
    loop {
        let Some(mon) = m.upgrade() else { return };
        let every = mon.cfg.failure.probe_every();
        // Only the leader changes the map. (Two monitors that both believe they lead still
        // cannot publish two maps of one version: the DPM refuses the older term, and the
        // publish is a compare-and-swap.)
        if !matches!(mon.lead().await, Ok(Some(_))) {
            drop(mon);
            tokio::time::sleep(every).await;
            continue;
        }
        if let Err(e) = mon.resolve_unfinished().await {
            tracing::error!(error = %format!("{e:#}"), "will retry");
        }
        let failed = mon.probe_once().await;
        for (kn, how) in failed {
            let detected = Instant::now();
            if let Err(e) = mon.recover_failed(kn, detected, &how).await {
                tracing::error!(kn, error = %e, "failure recovery failed; will retry");
            }
        }
        mon.replace_below_floor().await;
        drop(mon);
        tokio::time::sleep(every).await;
    }
}

async fn epoch_loop(m: std::sync::Weak<Monitor>) {
    let mut next = Instant::now();
    loop {
        let Some(mon) = m.upgrade() else { return };
        next += mon.policy_config().epoch();
        match mon.lead().await {
            Ok(Some(_)) => {
                if let Err(e) = mon.run_epoch().await {
                    tracing::warn!(error = %e, "decision epoch skipped");
                }
            }
            Ok(None) => tracing::debug!("not the leader; standing by"),
            Err(e) => tracing::warn!(error = %e, "cannot tell whether this monitor leads"),
        }
        drop(mon);
        tokio::time::sleep_until(next.into()).await;
    }
}

/// Unix milliseconds of a time.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Why a KN cannot be removed or failed: it is not in `map`. Names the map's KNs, since the
/// monitor may have removed it itself (an idle KN, after the grace period).
pub(crate) fn not_in_map(kn: KnId, map: &ClusterMap) -> String {
    let ids: Vec<String> = map.kn_ids().map(|k| k.to_string()).collect();
    let kns = if ids.is_empty() {
        "none".to_string()
    } else {
        ids.join(", ")
    };
    format!(
        "KN {kn} is not in the cluster map (version {}, KNs {kns}); `dinomo admin status` lists \
         the monitor's recent decisions",
        map.version
    )
}

#[cfg(test)]
mod report_tests {
    use dinomo_proto::monitor::KnLatency;

    use super::*;

    fn report(count: u64, sum_us: u64, p99_us: u64, per_kn: &[(KnId, u64, u64)]) -> LatencyReport {
        LatencyReport {
            client_id: "c".into(),
            count,
            sum_us,
            p99_us,
            per_kn: per_kn
                .iter()
                .map(|&(kn_id, count, sum_us)| KnLatency {
                    kn_id,
                    count,
                    sum_us,
                })
                .collect(),
        }
    }

    fn refused(r: &LatencyReport, says: &str) {
        let e = check_report(r).expect_err(says);
        assert!(e.contains(says), "{says:?} not in {e:?}");
    }

    const HOUR: u64 = MAX_REPORTED_LATENCY_US;

    #[test]
    fn reports_are_checked() {
        check_report(&report(
            10,
            10 * HOUR,
            HOUR,
            &[(1, 4, 4 * HOUR), (2, 6, 6 * HOUR)],
        ))
        .unwrap();
        refused(&report(0, 0, 0, &[]), "must count requests");
        refused(&report(1, 1, HOUR + 1, &[]), "over an hour");
        refused(&report(2, 2 * HOUR + 2, 1, &[]), "mean 3600000001 us");
        // Per-KN counts within the count, each per-KN sum within the sum.
        refused(
            &report(10, 100, 10, &[(1, 6, 1), (2, 5, 1)]),
            "add up to more",
        );
        refused(
            &report(10, 100, 10, &[(1, 1, 101)]),
            "over the report's sum",
        );
        // No overflow: u64::MAX + 1 is refused, not wrapped (nor a panic).
        refused(
            &report(u64::MAX, u64::MAX, 1, &[(1, u64::MAX, 1), (2, 1, 1)]),
            "add up to more",
        );
        let many: Vec<_> = (0..=MAX_REPORT_KNS as u32).map(|k| (k, 0, 0)).collect();
        check_report(&report(1, 1, 1, &many[..MAX_REPORT_KNS])).unwrap();
        refused(&report(1, 1, 1, &many), "per-KN entries");
        let mut r = report(1, 1, 1, &[]);
        r.client_id = "i".repeat(MAX_CLIENT_ID);
        check_report(&r).unwrap();
        r.client_id.push('i');
        refused(&r, "client_id is 129 bytes");
    }

    #[tokio::test]
    async fn unknown_kns_are_dropped_and_totals_saturate() {
        let m = Monitor::new(
            MonitorConfig::default(),
            MonitorOptions::default(),
            Arc::new(crate::orchestrator::external::ExternalOrchestrator::new(
                "127.0.0.1:1".into(),
                Duration::from_secs(1),
            )),
        );
        *m.members.lock() = [1, 2].into_iter().collect();
        m.report(&report(u64::MAX, u64::MAX, 1, &[(1, 5, 5), (99, 1, 1)]))
            .unwrap();
        m.report(&report(3, 3, 1, &[(2, 3, 3)])).unwrap();
        assert!(m.report(&report(0, 0, 0, &[])).is_err());
        let l = m.latency.lock();
        assert_eq!((l.count, l.sum_us), (u64::MAX, u64::MAX));
        let mut kns: Vec<_> = l.per_kn.iter().map(|(&k, &v)| (k, v)).collect();
        kns.sort();
        assert_eq!(kns, [(1, (5, 5)), (2, (3, 3))], "KN 99 is not in the map");
    }

    #[test]
    fn clients_are_bounded_and_the_longest_silent_goes() {
        let mut c = Clients::default();
        for i in 0..MAX_CLIENTS {
            c.heard(&format!("c{i}"));
        }
        // c0 speaks again: c1 is now the longest silent.
        c.heard("c0");
        c.heard("new");
        assert_eq!(c.last.len(), MAX_CLIENTS);
        assert_eq!(c.by_age.len(), MAX_CLIENTS);
        assert!(c.last.contains_key("c0") && c.last.contains_key("new"));
        assert!(!c.last.contains_key("c1"));
        c.heard("newer");
        assert!(!c.last.contains_key("c2"));
        assert_eq!(c.last.len(), MAX_CLIENTS);
    }
}
