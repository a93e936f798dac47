//! The nemesis of issue 10: no stale read and no lost write under any fault schedule.
//!
//! Each schedule starts a fresh cluster with `dinomo up` (which restarts a dpm-node, routing
//! node or monitor that dies; the monitor recovers, adds and removes the KV nodes), on the shm
//! fabric for even seeds and the tcp fabric for odd ones, runs SDK clients on a Zipf workload
//! for a few seconds while a seeded nemesis applies a bounded number of faults at random
//! times, heals everything, waits (bounded) until the cluster serves again, reads every key
//! back, and checks the whole history for linearizability (dinomo-checker).
//!
//! Faults: SIGKILL of a KN (the monitor fails it over), of the monitor (its KNs, its children,
//! stop with it; `up` restarts it and it starts them again) and of the routing node (`up`
//! restarts it); SIGSTOP then SIGCONT (0.2-2 s later) of a KN (past 1 s the monitor fences
//! it), of the monitor and of the routing node; SIGKILL of the dpm-node (`up` restarts it on
//! the same ports); one-way network cuts of 0.2-3 s (iptables on loopback, see netfault.rs): a
//! KN cut off from the dpm-node (control RPCs, and the fabric on tcp) while its clients and the
//! monitor still reach it, a KN nobody reaches while it still reaches the DPM, and a KN whose
//! answers are lost; a KN added or removed through the monitor's admin API; hot keys
//! replicated (SetPolicy with a violated SLO: the policy replicates the hot keys of the Zipf
//! load) and, 1.5 s later, de-replicated (SetPolicy with a met SLO while the load moves to
//! another hot set, so the replicated keys turn cold). Not covered: disk or PM faults, clock
//! faults; the verbs fabric only when asked for (`DINOMO_NEMESIS_FABRIC=verbs`, in a build
//! with `--features rdma` on a machine with an RDMA device: scripts/vm-cluster.sh runs a small
//! KN-kill schedule so inside the Soft-RoCE VM). docs/testing.md has the details.
//!
//! Environment: `DINOMO_NEMESIS_SCHEDULES` (default 3; 1 when a seed is given),
//! `DINOMO_NEMESIS_SEED` (the first schedule's seed; the others follow it), and for the shape
//! of a schedule `DINOMO_NEMESIS_SECONDS` (load time, default 8), `DINOMO_NEMESIS_FAULTS`
//! (most faults per schedule, default 8), `DINOMO_NEMESIS_CLIENTS` (default 4),
//! `DINOMO_NEMESIS_FABRIC` (shm, tcp, verbs or mixed, the default: shm and tcp) and
//! `DINOMO_NEMESIS_KINDS` (a comma-separated subset of the fault kinds, as [`Fault::name`]
//! names them: kill-kn, stop-kn, stop-monitor, stop-routing, kill-monitor, kill-routing,
//! kill-dpm, cut-kn-dpm, cut-kn-clients, drop-kn-answers, add-kn, remove-kn, replicate (which
//! brings its dereplicate); default all). Network cuts need root, iptables and a cgroup2 mount; where
//! they are missing they are listed as `<cut>:unavailable` in the schedule's `applied=` list.
//! Every schedule prints one `NEMESIS seed=...` line; `scripts/nemesis.sh` runs the long form
//! and tabulates them. A failing schedule keeps its fault timeline, history and logs under
//! `target/tmp/nemesis-<seed>/` (every schedule does with `DINOMO_NEMESIS_KEEP=1`).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_checker::{check, History, Op, Res, Violation};
use dinomo_client::{admin, Client, ClientConfig};
use dinomo_placement::ClusterMap;
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::{AddKnRequest, KnRequest, PolicyRequest, StatusRequest};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

use super::cluster::{Role, UpCluster};
use super::e2e::{start_load_with, Keys, Load, Seen};
use super::netfault::{Cut, NetFaults};

/// KNs at the start; the nemesis keeps at least two in the map before it takes one away and
/// adds none beyond `MAX_KNS`.
const START_KNS: u32 = 3;
const MAX_KNS: usize = 5;
/// Keys per hot set (each de-replication moves the load to the next `KEYS` keys).
const KEYS: u32 = 64;
const ZIPF: f64 = 1.2;
/// At most this many hot sets per schedule.
const MAX_PHASES: u32 = 3;
/// Longer than any pause (2 s) plus a failover: a client gives up only on a stuck cluster.
const OP_DEADLINE: Duration = Duration::from_secs(30);
/// Bound on the wait for the healed cluster to serve again.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

/// The monitor: fast failure detection and policy epochs; the policy changes no membership
/// (never over- or under-utilised) and replicates only when the nemesis makes the SLO unmet.
fn policy(avg_slo_us: u64) -> String {
    format!(
        "avg_latency_slo_us = {avg_slo_us}
tail_latency_slo_us = 1000000000
over_utilized = 1.0
under_utilized = 0.0
hot_key_sigmas = 2.0
cold_key_sigmas = 0.0
min_hot_key_share = 0.01
epoch_ms = 300
grace_period_ms = 0
"
    )
}

const SLO_MET: u64 = 1_000_000_000;
const SLO_VIOLATED: u64 = 1;

fn monitor_toml() -> String {
    format!(
        "[stats]
report_every_ms = 200

[failure]
probe_every_ms = 100
failed_after_ms = 1000

[policy]
{}",
        policy(SLO_MET)
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    KillKn,
    PauseKn,
    PauseMonitor,
    PauseRouting,
    KillMonitor,
    KillRouting,
    KillDpm,
    /// A KN cannot reach the dpm-node (control RPCs and, on tcp, the fabric), while clients
    /// and the monitor still reach it.
    CutKnFromDpm,
    /// Nobody (clients, routing node, monitor) reaches a KN, which still reaches the DPM.
    CutKnFromClients,
    /// A KN's answers are lost: requests arrive and are served, nobody hears back.
    DropKnAnswers,
    AddKn,
    RemoveKn,
    HotOn,
    HotOff,
}

impl Fault {
    /// The mix; a [`Fault::HotOff`] follows each `HotOn` in the plan.
    const WEIGHTED: [(Fault, u32); 13] = [
        (Fault::KillKn, 2),
        (Fault::PauseKn, 2),
        (Fault::PauseMonitor, 1),
        (Fault::PauseRouting, 1),
        (Fault::KillMonitor, 1),
        (Fault::KillRouting, 1),
        (Fault::KillDpm, 1),
        (Fault::CutKnFromDpm, 2),
        (Fault::CutKnFromClients, 2),
        (Fault::DropKnAnswers, 1),
        (Fault::AddKn, 1),
        (Fault::RemoveKn, 1),
        (Fault::HotOn, 2),
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::KillKn => "kill-kn",
            Fault::PauseKn => "stop-kn",
            Fault::PauseMonitor => "stop-monitor",
            Fault::PauseRouting => "stop-routing",
            Fault::KillMonitor => "kill-monitor",
            Fault::KillRouting => "kill-routing",
            Fault::KillDpm => "kill-dpm",
            Fault::CutKnFromDpm => "cut-kn-dpm",
            Fault::CutKnFromClients => "cut-kn-clients",
            Fault::DropKnAnswers => "drop-kn-answers",
            Fault::AddKn => "add-kn",
            Fault::RemoveKn => "remove-kn",
            Fault::HotOn => "replicate",
            Fault::HotOff => "dereplicate",
        }
    }

    /// A fault of the mix (only those named in `only`, if given).
    fn pick(rng: &mut StdRng, only: &Option<Vec<String>>) -> Fault {
        let mix: Vec<(Fault, u32)> = Self::WEIGHTED
            .into_iter()
            .filter(|(f, _)| {
                only.as_ref()
                    .is_none_or(|o| o.iter().any(|n| n == f.name()))
            })
            .collect();
        assert!(!mix.is_empty(), "DINOMO_NEMESIS_KINDS names no fault kind");
        let total: u32 = mix.iter().map(|w| w.1).sum();
        let mut x = rng.random_range(0..total);
        for (f, w) in mix {
            if x < w {
                return f;
            }
            x -= w;
        }
        unreachable!()
    }
}

#[derive(Debug, Clone)]
struct Settings {
    schedules: u64,
    first_seed: u64,
    seconds: f64,
    max_faults: u32,
    clients: usize,
    /// Fault kinds to draw from (`Fault::name`s); None: all.
    kinds: Option<Vec<String>>,
    /// `shm`, `tcp`, `verbs`, or None: tcp for odd seeds, shm for even ones.
    fabric: Option<String>,
}

impl Settings {
    fn fabric(&self, seed: u64) -> &str {
        match &self.fabric {
            Some(f) => f,
            None if seed % 2 == 1 => "tcp",
            None => "shm",
        }
    }
}

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    let v = std::env::var(name).ok()?;
    Some(
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
    )
}

impl Settings {
    fn from_env() -> Settings {
        let seed: Option<u64> = env("DINOMO_NEMESIS_SEED");
        Settings {
            schedules: env("DINOMO_NEMESIS_SCHEDULES").unwrap_or(if seed.is_some() {
                1
            } else {
                3
            }),
            first_seed: seed.unwrap_or_else(|| rand::random_range(0..1_000_000_000)),
            seconds: env("DINOMO_NEMESIS_SECONDS").unwrap_or(8.0),
            max_faults: env("DINOMO_NEMESIS_FAULTS").unwrap_or(8),
            clients: env("DINOMO_NEMESIS_CLIENTS").unwrap_or(4),
            fabric: std::env::var("DINOMO_NEMESIS_FABRIC")
                .ok()
                .filter(|f| f != "mixed"),
            kinds: std::env::var("DINOMO_NEMESIS_KINDS")
                .ok()
                .map(|v| v.split(',').map(|k| k.trim().to_string()).collect()),
        }
    }
}

/// What one schedule did and found.
#[derive(Debug, Default)]
struct Outcome {
    seed: u64,
    fabric: String,
    /// Operations the clients ran (the read-back not included).
    ops: u64,
    /// Errors that reached a client (each recorded as an unknown outcome, or as a failure for
    /// an invalid argument).
    errors: u64,
    /// Operations of the history with an unknown outcome (read-back included).
    unknown: u64,
    faults: Vec<String>,
    violations: u32,
    /// Heal -> first acknowledged write and read; None: not within `RECOVERY_BOUND`.
    recovery: Option<Duration>,
    /// Most keys replicated at once, and keys de-replicated (as seen in the published map).
    max_replicated: usize,
    dereplicated: usize,
    /// Why the schedule failed, if it did.
    failure: Option<String>,
}

impl Outcome {
    fn line(&self) -> String {
        format!(
            "NEMESIS seed={} fabric={} ops={} unknown={} errors={} faults={} violations={} \
             recovery_ms={} replicated={} dereplicated={} result={} applied=[{}]",
            self.seed,
            self.fabric,
            self.ops,
            self.unknown,
            self.errors,
            self.faults.len(),
            self.violations,
            self.recovery
                .map_or("-".to_string(), |d| d.as_millis().to_string()),
            self.max_replicated,
            self.dereplicated,
            match &self.failure {
                None => "ok",
                Some(f) if f.starts_with("VIOLATION") => "VIOLATION",
                Some(f) if f.starts_with("UNDECIDED") => "UNDECIDED",
                Some(_) => "FAILED",
            },
            self.faults.join(",")
        )
    }
}

async fn monitor_admin(
    addr: &str,
) -> Result<MonitorServiceClient<tonic::transport::Channel>, String> {
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(30));
    Ok(MonitorServiceClient::new(ep.connect_lazy()))
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: signalling a process of this test's own cluster (found in its process group).
    unsafe { libc::kill(pid, sig) };
}

/// The nemesis of one schedule: applies faults, remembers what it did, and owns the tasks
/// that end them (SIGCONT) or wait for them (admin calls).
struct Nemesis<'a> {
    up: &'a UpCluster,
    /// None: this machine cannot cut connections (the reason is in `net_unavailable`).
    net: Option<&'a NetFaults>,
    rng: StdRng,
    /// The published map as last read (the DPM may be down when a fault needs it).
    map: Option<ClusterMap>,
    applied: Vec<String>,
    /// SIGCONTs to come (a heal sends them at once).
    pauses: Vec<JoinHandle<String>>,
    /// Network cuts to heal (each task owns its cut: aborting the task heals it too).
    cuts: Vec<JoinHandle<String>>,
    /// Admin calls in flight; each returns what happened.
    tasks: Vec<JoinHandle<String>>,
    /// KNs being removed.
    removing: Vec<u32>,
    dpm_kills: u32,
    monitor_kills: u32,
    /// Faults and map changes as they happened (the evidence of a failed schedule).
    timeline: String,
    start: Instant,
    history: Arc<History>,
    max_replicated: usize,
    /// Keys seen leaving the replicated set.
    dereplicated: usize,
}

impl Nemesis<'_> {
    async fn refresh_map(&mut self) {
        let dpm = self.up.dpm_addr();
        if let Ok(Ok(Some(m))) =
            tokio::time::timeout(Duration::from_secs(1), admin::published_map(&dpm)).await
        {
            self.max_replicated = self.max_replicated.max(m.replicated.len());
            if let Some(old) = &self.map {
                if m.version > old.version {
                    let _ = writeln!(
                        self.timeline,
                        "{:>8.3} s  before op #{:<7} map v{}: KNs {:?}, replicated {:?}",
                        self.start.elapsed().as_secs_f64(),
                        self.history.len(),
                        m.version,
                        m.kn_ids().collect::<Vec<_>>(),
                        m.replicated
                            .iter()
                            .map(|(k, o)| (String::from_utf8_lossy(k).into_owned(), o.clone()))
                            .collect::<Vec<_>>()
                    );
                    self.dereplicated += old
                        .replicated
                        .keys()
                        .filter(|k| !m.replicated.contains_key(*k))
                        .count();
                }
            }
            self.map = Some(m);
        }
    }

    /// KNs in the map whose process runs (not stopped, not being removed).
    fn available_kns(&self) -> Vec<(u32, i32)> {
        let Some(map) = &self.map else {
            return Vec::new();
        };
        let procs = self.up.procs();
        map.kn_ids()
            .filter(|id| !self.removing.contains(id))
            .filter_map(|id| {
                procs
                    .iter()
                    .find(|p| p.role == Role::Kn(id) && p.serving())
                    .map(|p| (id, p.pid))
            })
            .collect()
    }

    /// Notes a fault on the timeline: when (since the load started, and as the number of
    /// operations invoked so far, which is the history's next op id) and what.
    fn note(&mut self, what: String) {
        let _ = writeln!(
            self.timeline,
            "{:>8.3} s  before op #{:<7} {what}",
            self.start.elapsed().as_secs_f64(),
            self.history.len()
        );
        self.applied.push(what);
    }

    fn pause(&mut self, pid: i32, what: String) {
        let ms = self.rng.random_range(200..=2000u64);
        signal(pid, libc::SIGSTOP);
        self.note(format!("stop-{what}:{ms}ms"));
        self.pauses.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            signal(pid, libc::SIGCONT);
            format!("{what} continued after {ms} ms")
        }));
    }

    /// Applies a network cut for 200 ms to 3 s.
    fn cut(&mut self, what: String, cut: impl FnOnce(&NetFaults) -> Result<Cut, String>) {
        let Some(net) = self.net else {
            self.note(format!("{what}:unavailable"));
            return;
        };
        let ms = self.rng.random_range(200..=3000u64);
        match cut(net) {
            Ok(c) => {
                self.note(format!("{what}:{ms}ms"));
                self.cuts.push(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    drop(c);
                    format!("{what} healed after {ms} ms")
                }));
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }

    fn admin_call<F, Fut>(&mut self, what: String, call: F)
    where
        F: FnOnce(MonitorServiceClient<tonic::transport::Channel>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<String, tonic::Status>> + Send + 'static,
    {
        let addr = self.up.monitor_addr();
        self.note(what.clone());
        self.tasks.push(tokio::spawn(async move {
            let r = async {
                let m = monitor_admin(&addr).await?;
                tokio::time::timeout(Duration::from_secs(40), call(m))
                    .await
                    .map_err(|_| "no answer within 40 s".to_string())?
                    .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
            }
            .await;
            match r {
                Ok(m) => format!("{what}: {m}"),
                Err(e) => format!("{what} refused: {e}"),
            }
        }));
    }

    fn set_policy(&mut self, what: &str, slo: u64) {
        self.admin_call(what.to_string(), move |mut m| async move {
            m.set_policy(PolicyRequest { toml: policy(slo) })
                .await
                .map(|_| "policy set".to_string())
        });
    }

    /// Applies `f` (or, when the cluster's state does not allow it, a fault that it does).
    /// Returns true when the load should move to its next hot set.
    async fn apply(&mut self, f: Fault) -> bool {
        self.refresh_map().await;
        let kns = self.available_kns();
        let in_map = self.map.as_ref().map_or(0, |m| m.kns.len());
        let f = match f {
            Fault::KillKn | Fault::PauseKn | Fault::RemoveKn if kns.len() < 2 => {
                if in_map < MAX_KNS {
                    Fault::AddKn
                } else {
                    Fault::PauseRouting
                }
            }
            Fault::AddKn if in_map >= MAX_KNS => Fault::PauseMonitor,
            Fault::KillDpm if self.dpm_kills >= 2 => Fault::PauseMonitor,
            // A monitor's KNs are its children: they stop with it, and its successor starts
            // them again. Two such restarts per schedule are plenty.
            Fault::KillMonitor if self.monitor_kills >= 2 => Fault::PauseMonitor,
            Fault::CutKnFromDpm | Fault::CutKnFromClients | Fault::DropKnAnswers
                if kns.is_empty() =>
            {
                Fault::PauseRouting
            }
            f => f,
        };
        match f {
            Fault::KillKn => {
                let (id, pid) = kns[self.rng.random_range(0..kns.len())];
                signal(pid, libc::SIGKILL);
                self.note(format!("kill-kn{id}"));
            }
            Fault::PauseKn => {
                let (id, pid) = kns[self.rng.random_range(0..kns.len())];
                self.pause(pid, format!("kn{id}"));
            }
            Fault::PauseMonitor | Fault::PauseRouting => {
                let (role, name) = if f == Fault::PauseMonitor {
                    (Role::Monitor, "monitor")
                } else {
                    (Role::Routing, "routing")
                };
                match self
                    .up
                    .procs()
                    .into_iter()
                    .find(|p| p.role == role && p.serving())
                {
                    Some(p) => self.pause(p.pid, name.to_string()),
                    None => self.note(format!("stop-{name}:skipped")),
                }
            }
            Fault::KillMonitor | Fault::KillRouting => {
                let role = if f == Fault::KillMonitor {
                    self.monitor_kills += 1;
                    Role::Monitor
                } else {
                    Role::Routing
                };
                match self.up.pid(role) {
                    Some(pid) => {
                        signal(pid, libc::SIGKILL);
                        self.note(f.name().to_string());
                    }
                    None => self.note(format!("{}:skipped", f.name())),
                }
            }
            Fault::CutKnFromDpm => {
                let (id, pid) = kns[self.rng.random_range(0..kns.len())];
                let ports = self.up.dpm_ports();
                self.cut(format!("cut-kn{id}-dpm"), |n| n.cut_process_to(pid, &ports));
            }
            Fault::CutKnFromClients | Fault::DropKnAnswers => {
                let (id, _) = kns[self.rng.random_range(0..kns.len())];
                let port = self.up.kn_port(id);
                if f == Fault::CutKnFromClients {
                    self.cut(format!("cut-kn{id}-clients"), |n| n.cut_to_port(port));
                } else {
                    self.cut(format!("drop-kn{id}-answers"), |n| n.cut_from_port(port));
                }
            }
            Fault::KillDpm => match self.up.pid(Role::Dpm) {
                Some(pid) => {
                    signal(pid, libc::SIGKILL);
                    self.dpm_kills += 1;
                    self.note("kill-dpm".to_string());
                }
                None => self.note("kill-dpm:skipped".to_string()),
            },
            Fault::AddKn => self.admin_call("add-kn".to_string(), |mut m| async move {
                m.add_kn(AddKnRequest {})
                    .await
                    .map(|r| format!("KN {} added", r.into_inner().kn_id))
            }),
            Fault::RemoveKn => {
                let (id, _) = kns[self.rng.random_range(0..kns.len())];
                self.removing.push(id);
                self.admin_call(format!("remove-kn{id}"), move |mut m| async move {
                    m.remove_kn(KnRequest { kn_id: id })
                        .await
                        .map(|r| r.into_inner().message)
                });
            }
            Fault::HotOn => self.set_policy("replicate", SLO_VIOLATED),
            Fault::HotOff => {
                self.set_policy("dereplicate", SLO_MET);
                return true;
            }
        }
        false
    }

    /// Ends every fault now: the pending SIGCONTs are sent at once (to the whole cluster) and
    /// every network cut is lifted.
    async fn heal(&mut self) {
        for t in self.pauses.drain(..) {
            t.abort();
        }
        self.up.wake_all();
        for t in self.cuts.drain(..) {
            t.abort();
            // Cancelled (its cut dropped, so healed) or already done.
            let _ = t.await;
        }
    }

    /// Waits for the admin calls still in flight (bounded); what each did.
    async fn settle(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        for t in self.tasks.drain(..) {
            match tokio::time::timeout(Duration::from_secs(45), t).await {
                Ok(Ok(n)) => notes.push(n),
                Ok(Err(e)) => notes.push(format!("nemesis task failed: {e}")),
                Err(_) => notes.push("admin call did not end within 45 s".to_string()),
            }
        }
        self.up.wake_all();
        notes
    }
}

/// The load's hot sets: phase p uses keys `p * KEYS .. (p + 1) * KEYS`, Zipf-distributed.
struct Workload {
    clients: Vec<Client>,
    history: Arc<History>,
    first_id: u64,
    phase: u32,
    current: Option<Load>,
    /// Earlier phases, being stopped.
    stopping: Vec<JoinHandle<(Arc<History>, Arc<Seen>)>>,
}

impl Workload {
    fn start_phase(&mut self) {
        if let Some(old) = self.current.take() {
            self.stopping.push(tokio::spawn(old.finish()));
        }
        self.current = Some(start_load_with(
            self.clients.clone(),
            Keys::zipf(KEYS, ZIPF).shifted(self.phase * KEYS),
            1_000_000,
            self.history.clone(),
            self.first_id + u64::from(self.phase) * 100,
        ));
    }

    fn next_phase(&mut self) {
        if self.phase + 1 < MAX_PHASES {
            self.phase += 1;
            self.start_phase();
        }
    }

    /// Stops every phase; returns (operations, errors that reached a caller).
    async fn finish(mut self) -> (u64, u64) {
        if let Some(l) = self.current.take() {
            self.stopping.push(tokio::spawn(l.finish()));
        }
        let (mut ops, mut errors) = (0, 0);
        for t in self.stopping {
            let (_, seen) = t.await.expect("a load phase finishes");
            ops += seen.ops.load(Ordering::Relaxed);
            errors += seen.errors.load(Ordering::Relaxed);
        }
        (ops, errors)
    }
}

async fn client(up: &UpCluster, deadline: Duration, report: bool) -> Client {
    let mut cfg = ClientConfig::new(&[up.routing_addr()]);
    cfg.deadline = deadline;
    if report {
        cfg.monitor = Some(up.monitor_addr());
        cfg.report_every = Duration::from_millis(200);
    }
    Client::connect_with(cfg).await.expect("a client connects")
}

/// Heal -> a write and a read of a probe key both succeed (bounded); else the last error.
async fn wait_serving(probe: &Client) -> Result<Duration, String> {
    let healed = Instant::now();
    let mut n = 0u64;
    let mut last = String::from("no attempt");
    while healed.elapsed() < RECOVERY_BOUND {
        n += 1;
        let v = format!("p{n}");
        match probe.put(&b"nemesis-probe"[..], v.clone()).await {
            Err(e) => last = format!("probe put: {e}"),
            Ok(()) => match probe.get(&b"nemesis-probe"[..]).await {
                Ok(g) if g.as_deref() == Some(v.as_bytes()) => return Ok(healed.elapsed()),
                Ok(g) => last = format!("probe get: {g:?}, not {v}"),
                Err(e) => last = format!("probe get: {e}"),
            },
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(last)
}

/// The monitor's recent decisions (for the evidence of a schedule).
async fn monitor_decisions(up: &UpCluster) -> String {
    let status = async {
        let mut m = monitor_admin(&up.monitor_addr()).await.ok()?;
        tokio::time::timeout(Duration::from_secs(5), m.status(StatusRequest {}))
            .await
            .ok()?
            .ok()
    };
    match status.await {
        None => "monitor status: no answer\n".to_string(),
        Some(s) => {
            let s = s.into_inner();
            let mut out = format!(
                "monitor status: map version {}, replicated {:?}\n",
                s.map_version, s.replicated
            );
            for d in &s.recent {
                let _ = writeln!(
                    out,
                    "  [{}] {} (map {}): {}",
                    d.at_ms, d.action, d.map_version, d.reason
                );
            }
            out
        }
    }
}

/// Keeps the evidence of a failed schedule: history, fault list, every log.
fn keep_evidence(up: &UpCluster, seed: u64, history: &History, o: &Outcome, detail: &str) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nemesis-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::create_dir_all(dir.join("logs"));
    let mut h = String::new();
    for e in history.entries() {
        let _ = writeln!(h, "{} {e}", String::from_utf8_lossy(e.op.key()));
    }
    let _ = std::fs::write(dir.join("history.txt"), h);
    let _ = std::fs::write(
        dir.join("outcome.txt"),
        format!("{}\n\n{detail}\n", o.line()),
    );
    let _ = std::fs::copy(up.dir.path().join("up.log"), dir.join("logs/up.log"));
    if let Ok(d) = std::fs::read_dir(up.dir.path().join("data").join("logs")) {
        for e in d.flatten() {
            let _ = std::fs::copy(e.path(), dir.join("logs").join(e.file_name()));
        }
    }
    eprintln!("nemesis seed {seed}: evidence kept in {}", dir.display());
}

async fn run_schedule(seed: u64, s: Settings) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let n_faults = rng.random_range(1..=s.max_faults.max(1));
    let span = (s.seconds - 0.3).max(0.5);
    let mut plan: Vec<(Duration, Fault)> = (0..n_faults)
        .map(|_| {
            (
                Duration::from_secs_f64(0.3 + rng.random::<f64>() * span),
                Fault::pick(&mut rng, &s.kinds),
            )
        })
        .collect();
    // A hot-key episode: replicate (the SLO made unmet), then 1.5 s later de-replicate (the
    // SLO met, the load moved to another hot set). The KNs' key counts halve every second, so
    // a hot set the load left needs about 6 s to turn cold: episodes come early, at most two
    // of them, and the load runs on for 7 s after the last de-replication.
    let mut end = Duration::from_secs_f64(s.seconds);
    let mut episodes = 0;
    let mut offs = Vec::new();
    plan.retain_mut(|(at, f)| {
        if *f != Fault::HotOn {
            return true;
        }
        episodes += 1;
        *at = (*at).min(Duration::from_secs_f64(s.seconds * 0.3));
        let off = *at + Duration::from_millis(1500);
        offs.push((off, Fault::HotOff));
        end = end.max(off + Duration::from_secs(7));
        episodes <= 2
    });
    offs.truncate(2);
    plan.extend(offs);
    plan.sort_by_key(|p| p.0);

    let fabric = s.fabric(seed).to_string();
    let net = match NetFaults::new() {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("nemesis seed {seed}: no network faults on this machine: {e}");
            None
        }
    };
    let mut up = UpCluster::start_on(&fabric, START_KNS, 24, Some(&monitor_toml()));
    let mut clients = Vec::new();
    for _ in 0..s.clients {
        clients.push(client(&up, OP_DEADLINE, true).await);
    }
    let probe = client(&up, Duration::from_secs(5), false).await;
    let history = Arc::new(History::new());
    // Client ids (which also seed each client's choices) differ from one seed to the next.
    let first_id = (seed % 1_000_000) * 1000;
    let mut load = Workload {
        clients,
        history: history.clone(),
        first_id,
        phase: 0,
        current: None,
        stopping: Vec::new(),
    };
    load.start_phase();

    let mut nemesis = Nemesis {
        up: &up,
        net: net.as_ref(),
        rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
        map: None,
        applied: Vec::new(),
        pauses: Vec::new(),
        cuts: Vec::new(),
        tasks: Vec::new(),
        removing: Vec::new(),
        dpm_kills: 0,
        monitor_kills: 0,
        timeline: String::new(),
        start: Instant::now(),
        history: history.clone(),
        max_replicated: 0,
        dereplicated: 0,
    };
    let start = nemesis.start;
    for (at, f) in plan {
        // Between faults, watch the map (for the replicated keys it shows).
        while start.elapsed() + Duration::from_millis(250) < at {
            tokio::time::sleep(Duration::from_millis(200)).await;
            nemesis.refresh_map().await;
        }
        tokio::time::sleep(at.saturating_sub(start.elapsed())).await;
        if nemesis.apply(f).await {
            load.next_phase();
        }
    }
    while start.elapsed() < end {
        tokio::time::sleep(Duration::from_millis(200)).await;
        nemesis.refresh_map().await;
    }
    nemesis.heal().await;
    nemesis.note("heal".to_string());
    nemesis.applied.pop();
    let served = wait_serving(&probe).await;
    let recovery = served.as_ref().ok().copied();
    let notes = nemesis.settle().await;
    nemesis.refresh_map().await;
    let phases = load.phase + 1;
    let (ops, errors) = load.finish().await;
    let mut o = Outcome {
        seed,
        fabric,
        ops,
        errors,
        faults: nemesis.applied.clone(),
        recovery,
        max_replicated: nemesis.max_replicated,
        dereplicated: nemesis.dereplicated,
        ..Outcome::default()
    };
    let mut detail = format!(
        "timeline:\n{}nemesis notes: {notes:?}\n{}",
        nemesis.timeline,
        monitor_decisions(&up).await
    );
    if !up.running() {
        o.failure = Some("FAILED: dinomo up exited (a node kept dying)".to_string());
    } else if let Err(last) = &served {
        o.failure = Some(format!(
            "STUCK: the healed cluster did not serve within {RECOVERY_BOUND:?} ({last})"
        ));
    }
    // Read every key back (recorded: the checker sees whether each read is the last write),
    // unless the cluster is not serving; bounded like the recovery.
    let mut unread = 0;
    let read_back = Instant::now();
    for k in 0..(phases * KEYS) {
        if o.failure.is_some() || read_back.elapsed() > RECOVERY_BOUND {
            unread += 1;
            continue;
        }
        let key = format!("key{k}").into_bytes();
        let h = history.invoke(first_id + 999, Op::Get { key: key.clone() });
        match probe.get(key).await {
            Ok(v) => history.complete(h, Res::Value(v.map(|b| b.to_vec()))),
            Err(e) => {
                unread += 1;
                history.complete_unknown(h);
                let _ = writeln!(detail, "read-back of key{k} failed: {e}");
            }
        }
    }
    if unread > 0 && o.failure.is_none() {
        o.failure = Some(format!("STUCK: {unread} keys could not be read back"));
    }
    o.unknown = history
        .entries()
        .iter()
        .filter(|e| e.complete_time().is_none())
        .count() as u64;
    let h2 = history.clone();
    let verdict = tokio::task::spawn_blocking(move || check(&h2))
        .await
        .expect("the checker runs");
    match verdict {
        Ok(r) => {
            let _ = writeln!(detail, "checker: {r:?}");
        }
        Err(v) => {
            o.violations = 1;
            let kind = if matches!(v, Violation::Undecided { .. }) {
                "UNDECIDED"
            } else {
                "VIOLATION"
            };
            let _ = writeln!(detail, "{kind}: {v}");
            // A violation outranks (and keeps) a liveness failure found before it.
            o.failure = Some(match o.failure.take() {
                Some(before) => format!("{kind}: {v}\n(and {before})"),
                None => format!("{kind}: {v}"),
            });
        }
    }
    if o.failure.is_some() {
        eprintln!("{}\n{detail}", o.line());
        up.dump_logs(25);
    }
    if o.failure.is_some() || std::env::var_os("DINOMO_NEMESIS_KEEP").is_some() {
        keep_evidence(&up, seed, &history, &o, &detail);
    }
    drop(up);
    drop(net);
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_schedules_lose_no_write_and_serve_no_stale_read() {
    let s = Settings::from_env();
    println!(
        "nemesis: {} schedule(s) from seed {} ({} s of load, up to {} faults, {} clients each); \
         replay one with DINOMO_NEMESIS_SEED=<seed>",
        s.schedules, s.first_seed, s.seconds, s.max_faults, s.clients
    );
    let mut outcomes = Vec::new();
    for i in 0..s.schedules {
        let seed = s.first_seed.wrapping_add(i);
        let started = Instant::now();
        // A schedule runs in its own task: a panic there (a harness failure) is one failed
        // schedule, its cluster dropped, and the others still run.
        let o = match tokio::spawn(run_schedule(seed, s.clone())).await {
            Ok(o) => o,
            Err(e) => Outcome {
                seed,
                failure: Some(format!("PANIC: {e}")),
                ..Outcome::default()
            },
        };
        println!("{} took_ms={}", o.line(), started.elapsed().as_millis());
        outcomes.push(o);
    }
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.failure.is_some()).collect();
    let slowest = outcomes.iter().filter_map(|o| o.recovery).max();
    println!(
        "NEMESIS-SUMMARY schedules={} ops={} unknown={} faults={} violations={} failed={} \
         slowest_recovery_ms={}",
        outcomes.len(),
        outcomes.iter().map(|o| o.ops).sum::<u64>(),
        outcomes.iter().map(|o| o.unknown).sum::<u64>(),
        outcomes.iter().map(|o| o.faults.len()).sum::<usize>(),
        outcomes.iter().map(|o| o.violations).sum::<u32>(),
        failed.len(),
        slowest.map_or("-".to_string(), |d| d.as_millis().to_string()),
    );
    assert!(
        failed.is_empty(),
        "{} schedule(s) failed:\n{}",
        failed.len(),
        failed
            .iter()
            .map(|o| format!(
                "  DINOMO_NEMESIS_SEED={}: {}",
                o.seed,
                o.failure.as_deref().unwrap_or_default()
            ))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
