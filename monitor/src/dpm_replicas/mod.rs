//! Automatic failover of the dpm-node replica set (docs/decisions/0007, "Automatic failover"):
//! the monitor watches every member (primary and backups) with ReplicaService.Status, points
//! the clients at the serving primary, promotes a backup in place when the primary dies, and
//! adds members that answer as backups but are missing from the primary's set (the old primary
//! comes back that way once it has demoted itself).
//!
//! - What it decides is [`plan::plan`], a pure function; this module asks the members and does
//!   what the plan says. A round asks every member at once, each call bounded by
//!   `status_timeout_ms`. The calls to the members go through [`replicas::Replicas`] (gRPC,
//!   [`GrpcReplicas`]; scripted in this module's tests of its rounds, `watcher_tests.rs`).
//! - Only the leading monitor acts ([`Leadership`]: the Kubernetes Lease); standbys watch too,
//!   so one that takes over a dead leader's Lease already holds the observation a failover
//!   needs. Leadership comes from the platform, not from the DPM (the DPM is what failed).
//!   Before it promotes, the leader notes which backup beside its leadership
//!   ([`promotion_note`]); a monitor that takes over reads the note before it acts, and waits
//!   for that backup instead of promoting another.
//! - How clients follow the primary is the platform's ([`PrimaryPointer`]): on Kubernetes the
//!   chart's primary Service selects the pod this watcher labels
//!   ([`pod_labels::PodLabels`]); elsewhere the clients must reach the primary by a name that
//!   follows it ([`Unpointed`] only logs).
//! - It starts before the monitor's bootstrap: on Kubernetes the KNs and the monitor reach the
//!   DPM through that Service, which selects nothing until the first primary is labelled.

pub mod plan;
pub mod pod_labels;
pub mod promotion_note;
pub mod replicas;
#[cfg(test)]
mod watcher_tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::Deserialize;

use dinomo_node_common::config::{invalid, ConfigError};
use plan::{Memory, Plan, Seen};
pub use replicas::{GrpcReplicas, PromoteError, Replicas};

/// `[dpm_replicas]`: the dpm-node replica set this monitor fails over. Off when `members` is
/// empty (the default: `dinomo up` fails over its local set itself).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpmReplicasConfig {
    /// Every member, primary and backups, in any order: its ReplicaService address, exactly as
    /// the primary names its backups (`--backup`), and on Kubernetes its pod.
    pub members: Vec<MemberConfig>,
    /// How often every member is asked for its status.
    pub check_every_ms: u64,
    /// How long the serving primary may fail to answer as a primary before a backup is
    /// promoted. A primary restarted in place on its pool within this time is kept.
    pub failover_after_ms: u64,
    /// Deadline of one Status call.
    pub status_timeout_ms: u64,
    /// How long a backup promoted by this monitor, or perhaps promoted (a Promote of unknown
    /// outcome, the last leader's note), may take to answer as the primary (it opens and
    /// recovers its pool first: minutes for a large pool) before the failover is reported
    /// stuck. Nothing else is promoted meanwhile either way.
    pub promotion_stuck_after_ms: u64,
    /// Kubernetes: the pod label (value "true") the primary Service selects.
    pub primary_label: String,
}

/// One member of `[dpm_replicas]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    /// gRPC address (host:port).
    pub address: String,
    /// Kubernetes pod name (needed with the kubernetes orchestrator).
    #[serde(default)]
    pub pod: String,
}

impl Default for DpmReplicasConfig {
    fn default() -> Self {
        Self {
            members: Vec::new(),
            check_every_ms: 500,
            failover_after_ms: 3000,
            status_timeout_ms: 1000,
            promotion_stuck_after_ms: 120_000,
            primary_label: "dinomo.io/dpm-primary".into(),
        }
    }
}

impl DpmReplicasConfig {
    pub fn enabled(&self) -> bool {
        !self.members.is_empty()
    }

    pub fn check_every(&self) -> Duration {
        Duration::from_millis(self.check_every_ms)
    }

    pub fn failover_after(&self) -> Duration {
        Duration::from_millis(self.failover_after_ms)
    }

    pub fn status_timeout(&self) -> Duration {
        Duration::from_millis(self.status_timeout_ms)
    }

    pub fn promotion_stuck_after(&self) -> Duration {
        Duration::from_millis(self.promotion_stuck_after_ms)
    }

    /// Checks the section; `pods` says whether every member must name its pod.
    pub fn validate(&self, pods: bool) -> Result<(), ConfigError> {
        if !self.enabled() {
            return Ok(());
        }
        if self.members.len() < 2 {
            return Err(invalid(
                "dpm_replicas.members",
                "a replica set has a primary and at least one backup: name them all, or none \
                 (off)"
                    .to_string(),
            ));
        }
        for (i, m) in self.members.iter().enumerate() {
            if m.address.trim().is_empty() {
                return Err(invalid(
                    "dpm_replicas.members",
                    format!("member {i} has no address"),
                ));
            }
            if self.members[..i].iter().any(|o| o.address == m.address) {
                return Err(invalid(
                    "dpm_replicas.members",
                    format!("{} is named twice", m.address),
                ));
            }
            if pods && m.pod.trim().is_empty() {
                return Err(invalid(
                    "dpm_replicas.members",
                    format!(
                        "{} names no pod: with the kubernetes orchestrator the primary \
                         Service follows the pod the monitor labels",
                        m.address
                    ),
                ));
            }
        }
        for (field, v) in [
            ("dpm_replicas.check_every_ms", self.check_every_ms),
            ("dpm_replicas.status_timeout_ms", self.status_timeout_ms),
            (
                "dpm_replicas.promotion_stuck_after_ms",
                self.promotion_stuck_after_ms,
            ),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be above 0".to_string()));
            }
        }
        if self.promotion_stuck_after_ms < self.failover_after_ms {
            return Err(invalid(
                "dpm_replicas.promotion_stuck_after_ms",
                format!(
                    "{} must be at least dpm_replicas.failover_after_ms ({}): a promoted backup \
                     is given at least as long as the primary was",
                    self.promotion_stuck_after_ms, self.failover_after_ms
                ),
            ));
        }
        if self.failover_after_ms <= self.check_every_ms {
            return Err(invalid(
                "dpm_replicas.failover_after_ms",
                format!(
                    "{} must be above dpm_replicas.check_every_ms ({}): a primary must miss \
                     more than one check before a backup replaces it",
                    self.failover_after_ms, self.check_every_ms
                ),
            ));
        }
        if self.primary_label.trim().is_empty() {
            return Err(invalid(
                "dpm_replicas.primary_label",
                "must not be empty".to_string(),
            ));
        }
        Ok(())
    }
}

/// Whether this monitor may act now, and the note a leader leaves for the next.
#[async_trait]
pub trait Leadership: Send + Sync {
    async fn leads(&self) -> bool;

    /// Leaves `note` for whoever leads next (`None` removes it); false if it was not written
    /// (this monitor does not lead, or the Lease changed under the write). The default keeps
    /// nothing: a monitor that is the only one has no successor.
    async fn leave_note(&self, _note: Option<String>) -> anyhow::Result<bool> {
        Ok(true)
    }

    /// The note the last leader left.
    async fn note(&self) -> anyhow::Result<Option<String>> {
        Ok(None)
    }
}

/// A monitor that always leads (the only one).
#[derive(Debug)]
pub struct Alone;

#[async_trait]
impl Leadership for Alone {
    async fn leads(&self) -> bool {
        true
    }
}

/// Leadership as the orchestrator tells it (the Lease on Kubernetes). A "leading" answer is
/// reused for [`LEADS_FOR`] (well within the Lease's duration), so that the rounds do not
/// renew the Lease several times a second; a check that takes longer than [`LEADS_TIMEOUT`]
/// means "not leading".
#[derive(Debug)]
pub struct ByOrchestrator {
    orchestrator: std::sync::Arc<dyn crate::orchestrator::Orchestrator>,
    led_at: parking_lot::Mutex<Option<Instant>>,
}

impl ByOrchestrator {
    pub fn new(orchestrator: std::sync::Arc<dyn crate::orchestrator::Orchestrator>) -> Self {
        Self {
            orchestrator,
            led_at: parking_lot::Mutex::new(None),
        }
    }
}

#[async_trait]
impl Leadership for ByOrchestrator {
    async fn leads(&self) -> bool {
        if self.led_at.lock().is_some_and(|t| t.elapsed() < LEADS_FOR) {
            return true;
        }
        // Stamped before asking: the Lease's renewal time is taken at the start of the call.
        let asked = Instant::now();
        let leads = match tokio::time::timeout(LEADS_TIMEOUT, self.orchestrator.is_leader()).await {
            Ok(Ok(leads)) => leads,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot tell whether this monitor leads; not acting on the dpm replica set");
                false
            }
            Err(_) => {
                tracing::warn!(
                    "no answer about the Lease within {} s; not acting on the dpm replica set",
                    LEADS_TIMEOUT.as_secs()
                );
                false
            }
        };
        *self.led_at.lock() = leads.then_some(asked);
        leads
    }

    async fn leave_note(&self, note: Option<String>) -> anyhow::Result<bool> {
        Ok(self.orchestrator.set_leader_note(note.as_deref()).await?)
    }

    async fn note(&self) -> anyhow::Result<Option<String>> {
        Ok(self.orchestrator.leader_note().await?)
    }
}

/// How clients are pointed at the primary.
#[async_trait]
pub trait PrimaryPointer: Send + Sync {
    /// Makes clients reach `members[to]` as the primary (and no other member).
    async fn point_at(&self, members: &[MemberConfig], to: usize) -> anyhow::Result<()>;
}

/// No pointer: the clients reach the primary by a name that follows it (a virtual IP, DNS
/// an operator changes). Says which member to reach.
#[derive(Debug)]
pub struct Unpointed;

#[async_trait]
impl PrimaryPointer for Unpointed {
    async fn point_at(&self, members: &[MemberConfig], to: usize) -> anyhow::Result<()> {
        tracing::warn!(
            primary = %members[to].address,
            "the dpm replica set's primary is {}: clients must reach it (this platform does not \
             point them)",
            members[to].address
        );
        Ok(())
    }
}

/// The watcher: one [`Watcher::round`] per `check_every_ms`.
pub struct Watcher {
    cfg: DpmReplicasConfig,
    addresses: Vec<String>,
    /// How the members are asked ([`GrpcReplicas`] but in tests); shared with the AddBackup
    /// tasks.
    replicas: Arc<dyn Replicas>,
    leadership: Box<dyn Leadership>,
    pointer: Box<dyn PrimaryPointer>,
    memory: Memory,
    led: bool,
    /// The AddBackup call per member, running or done, and when it was started: a member is
    /// added again only once the last call ended and [`ADD_RETRY`] passed (a second AddBackup
    /// of a backup being attached would start its copy again).
    adding: Vec<Option<(tokio::task::JoinHandle<()>, Instant)>>,
    /// A promotion waiting to answer as the primary: (member, when the primary was last
    /// seen serving + its down time, when Promote was answered).
    promoting: Option<(usize, Instant, Instant)>,
    /// The last wait or stuck message, so each is logged once.
    said: String,
    /// Whether [`plan::unserved_report`] was logged since a primary last served with a backup
    /// in sync, or since this monitor leads (once per episode, and again by a new leader).
    unserved_reported: bool,
    /// How many times it was logged (tests).
    unserved_reports: u64,
    /// The backups in sync last logged as saying they cannot be promoted (each with why), and
    /// whether that is every backup in sync ([`Watcher::report_unpromotable`]); empty until
    /// one is.
    unpromotable_said: (Vec<(usize, String)>, bool),
    /// How many times a change of it was logged (tests).
    unpromotable_reports: u64,
    /// The member whose pod carries the primary label, under which term, since when: labelled
    /// again when the primary changes, when it restarted (a recreated pod comes back without
    /// the label, and every start takes a new term), after a failed patch, and every
    /// [`RELABEL_EVERY`] in case someone removed it.
    labelled: Option<(usize, u64, Instant)>,
    /// When the last label patch failed ([`LABEL_RETRY`]).
    label_failed: Option<Instant>,
    /// Whether the note the last leader left was read since this monitor leads: a monitor
    /// acts only once it has ([`promotion_note`]).
    note_read: bool,
    /// A promotion note is (or may be) left: removed once a primary serves with a backup in
    /// sync.
    note_left: bool,
    /// That note's text, as read from the Lease (or written there, answered): checked against
    /// the observation before every round's plan (the observation it is about may be taken
    /// after it is read). `None` after a refusal or a Promote not sent (nothing is under way),
    /// and after a lead change until the Lease's note is read.
    note: Option<String>,
}

/// What a round did (for tests and logs).
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Not leading: watched only.
    Standby,
    Serving {
        primary: usize,
    },
    Waiting(String),
    Promoted {
        member: usize,
    },
    Stuck(String),
    /// A call the plan needed failed; retried next round.
    Failed(String),
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("members", &self.addresses)
            .field("memory", &self.memory)
            .field("led", &self.led)
            .finish_non_exhaustive()
    }
}

/// `message` with every "<digits> ms" made "# ms", so that a message repeated with a longer
/// wait compares equal (addresses and terms, which say what it is about, are kept).
fn without_durations(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
        let end = rest[start..]
            .find(|c: char| !c.is_ascii_digit())
            .map_or(rest.len(), |e| start + e);
        out.push_str(&rest[..start]);
        match rest[end..].starts_with(" ms") {
            true => out.push('#'),
            false => out.push_str(&rest[start..end]),
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

const ADD_RETRY: Duration = Duration::from_secs(10);
const RELABEL_EVERY: Duration = Duration::from_secs(10);
/// Wait after a failed label patch before the next (each is a patch per member).
const LABEL_RETRY: Duration = Duration::from_secs(2);
/// How long an answer of the Lease is taken as still true (each asking renews it: a write).
const LEADS_FOR: Duration = Duration::from_secs(1);
/// Deadline of one leadership check: an API server that does not answer means "not leading".
/// With [`LEADS_FOR`] and [`POINT_TIMEOUT`], a label moves at most 7 s after the Lease was
/// last renewed: within half of the Lease's 15 s minimum (config validation). A Promote is
/// sent at most about 6.5 s after (a check, the note's write, also bounded by this, and the
/// connection), and only after the note's write, conditional on the Lease this monitor holds,
/// succeeded: that write is the guard against a monitor that took the Lease over meanwhile.
const LEADS_TIMEOUT: Duration = Duration::from_secs(3);
/// Deadline of one pointing (the label patches): well within half a Lease, so a monitor that
/// lost its Lease meanwhile does not move the label long after.
const POINT_TIMEOUT: Duration = Duration::from_secs(3);

/// The shortest Lease with which the watcher acts on Kubernetes (see [`LEADS_TIMEOUT`]).
pub const MIN_LEASE_SECS: u32 = 15;

impl Watcher {
    pub fn new(
        cfg: DpmReplicasConfig,
        leadership: Box<dyn Leadership>,
        pointer: Box<dyn PrimaryPointer>,
    ) -> Self {
        let addresses: Vec<String> = cfg.members.iter().map(|m| m.address.clone()).collect();
        Self {
            adding: addresses.iter().map(|_| None).collect(),
            addresses,
            cfg,
            replicas: Arc::new(GrpcReplicas),
            leadership,
            pointer,
            memory: Memory::default(),
            led: false,
            promoting: None,
            said: String::new(),
            unserved_reported: false,
            unserved_reports: 0,
            unpromotable_said: (Vec::new(), false),
            unpromotable_reports: 0,
            labelled: None,
            label_failed: None,
            note_read: false,
            note_left: false,
            note: None,
        }
    }

    /// Asks the members through `replicas` instead of gRPC (tests script them).
    pub fn with_replicas(mut self, replicas: Arc<dyn Replicas>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Runs rounds until the task is dropped.
    pub async fn run(mut self) {
        tracing::info!(
            members = ?self.addresses,
            failover_after_ms = self.cfg.failover_after_ms,
            "watching the dpm replica set"
        );
        loop {
            self.round().await;
            tokio::time::sleep(self.cfg.check_every()).await;
        }
    }

    /// Asks every member, then does what [`plan::plan`] says if this monitor leads.
    pub async fn round(&mut self) -> Outcome {
        let timeout = self.cfg.status_timeout();
        let seen: Vec<Seen> = futures::future::join_all(
            self.addresses
                .iter()
                .map(|a| self.replicas.status(a, timeout)),
        )
        .await;
        let leads = self.leadership.leads().await;
        if leads != self.led {
            // Whoever led meanwhile may have pointed elsewhere: point again; and may have
            // promoted a backup: read its note before acting.
            self.memory.pointed = None;
            self.led = leads;
            self.note_read = false;
            // Only the Lease's note counts, once read: a copy from an earlier time as leader
            // must not pin while the read fails.
            self.note = None;
            // A leader reports an episode it finds, even one it reported before a lead change.
            self.unserved_reported = false;
            self.unpromotable_said = (Vec::new(), false);
        }
        let note_unread = match leads && !self.note_read {
            true => self.read_note().await.err(),
            false => None,
        };
        if leads {
            // Against the observation held before this round (the one a failover would use).
            self.apply_note();
        }
        let plan = plan::plan(
            &self.addresses,
            &seen,
            &mut self.memory,
            Instant::now(),
            self.cfg.failover_after(),
        );
        // An observation, not an action: every monitor pod exports it (alert on the max).
        let unserved = self
            .memory
            .unserved_since
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        metrics::gauge!("dinomo_monitor_dpm_no_backup_in_sync_seconds").set(unserved);
        // -1: no observation to count from (see `no_backup_in_sync_seconds`).
        let promotability = plan::promotability(&seen, &self.memory);
        metrics::gauge!("dinomo_monitor_dpm_promotable_backups")
            .set(promotability.as_ref().map_or(-1.0, |p| p.promotable as f64));
        if !leads {
            metrics::gauge!("dinomo_monitor_dpm_failover_stuck").set(0.0);
            return Outcome::Standby;
        }
        self.report_unserved(&seen);
        // While the observed primary serves: once it is down, the plan says what a failover
        // finds.
        if let (Some(p), None) = (promotability, self.memory.down_since) {
            self.report_unpromotable(&seen, p);
        }
        if let (Some(why), Plan::Promote { .. }) = (note_unread, &plan) {
            // Serving, waiting and stuck need no note (a serving primary ends any pin); a
            // promotion does: the last leader may have promoted another backup.
            let why = format!(
                "reading the last leader's promotion note: {why}; promoting nothing until it \
                 is read"
            );
            self.say(&why, true);
            return Outcome::Failed(why);
        }
        match plan {
            Plan::Serving {
                primary,
                term,
                point,
                add,
                unknown,
            } => {
                if !unknown.is_empty() {
                    self.say(
                        &format!(
                            "{} lists backups no member of [dpm_replicas] names: {unknown:?}; \
                             adding none (a member named differently would be attached twice)",
                            self.addresses[primary]
                        ),
                        true,
                    );
                }
                self.serving(primary, term, point, add).await
            }
            Plan::Wait(why) => {
                metrics::gauge!("dinomo_monitor_dpm_failover_stuck").set(0.0);
                self.say(&why, false);
                Outcome::Waiting(why)
            }
            Plan::Stuck(why) => {
                self.say(&why, true);
                metrics::gauge!("dinomo_monitor_dpm_failover_stuck").set(1.0);
                Outcome::Stuck(why)
            }
            Plan::Promote {
                member,
                others,
                min_term,
                down_for,
            } => self.promote(member, others, min_term, down_for).await,
        }
    }

    /// Logs, once per episode, that no primary has had a backup in sync for longer than
    /// `promotion_stuck_after_ms` ([`plan::unserved_report`]).
    fn report_unserved(&mut self, seen: &[plan::Seen]) {
        let report = plan::unserved_report(
            &self.addresses,
            seen,
            &self.memory,
            Instant::now(),
            self.cfg.promotion_stuck_after(),
        );
        match report {
            Some(report) if !self.unserved_reported => {
                tracing::error!("dpm replica set: {report}");
                self.unserved_reported = true;
                self.unserved_reports += 1;
            }
            Some(_) => {}
            None => self.unserved_reported = false,
        }
    }

    /// Logs, when it changes, which backups in sync with the serving primary say they cannot
    /// be promoted (a verbs backup that may not pin its pool), before the primary dies: a
    /// failover skips them, and when that is every backup in sync it would find none (an
    /// error then). A member still in sync that does not answer this round keeps its last
    /// verdict, so one missed status does not log the warning again.
    fn report_unpromotable(&mut self, seen: &[Seen], p: plan::Promotability) {
        let (said, _) = &self.unpromotable_said;
        let silent_since: Vec<(usize, String)> = said
            .iter()
            .filter(|(m, _)| seen[*m].is_err() && p.in_sync.contains(m))
            .cloned()
            .collect();
        let mut now = p.unpromotable.clone();
        now.extend(silent_since.iter().cloned());
        now.sort_unstable();
        // Every backup in sync says so (one silent or copying again may yet be promotable).
        let none_could = !now.is_empty() && now.len() == p.in_sync.len();
        let same = |a: &[(usize, String)], b: &[(usize, String)]| {
            a.iter().map(|(m, _)| m).eq(b.iter().map(|(m, _)| m))
        };
        if same(&now, said) && none_could == self.unpromotable_said.1 {
            return;
        }
        let was_said = !said.is_empty();
        let reasons: Vec<String> = now
            .iter()
            .map(|(m, why)| match silent_since.iter().any(|(s, _)| s == m) {
                true => format!("{}: {why} (said before; no answer now)", self.addresses[*m]),
                false => format!("{}: {why}", self.addresses[*m]),
            })
            .collect();
        let reasons = reasons.join("; ");
        self.unpromotable_said = (now, none_could);
        if self.unpromotable_said.0.is_empty() {
            if was_said {
                self.unpromotable_reports += 1;
                tracing::info!("dpm replica set: no backup in sync says it cannot be promoted");
            }
            return;
        }
        self.unpromotable_reports += 1;
        if none_could {
            tracing::error!(
                "dpm replica set: every backup in sync says it cannot be promoted, so no \
                 failover is possible if the primary dies: {reasons}. Raise the pin limit \
                 (docs/operations.md, \"The verbs fabric\")"
            );
        } else {
            tracing::warn!(
                "dpm replica set: a failover would skip backups in sync that say they cannot \
                 be promoted: {reasons}. {} of the {} in sync can be promoted now",
                p.promotable,
                p.in_sync.len()
            );
        }
    }

    /// Reads the note the last leader left (see [`Watcher::apply_note`]).
    async fn read_note(&mut self) -> Result<(), String> {
        let note = match tokio::time::timeout(LEADS_TIMEOUT, self.leadership.note()).await {
            Ok(Ok(note)) => note,
            Ok(Err(e)) => return Err(format!("{e:#}")),
            Err(_) => return Err(format!("no answer within {} s", LEADS_TIMEOUT.as_secs())),
        };
        self.note_read = true;
        if let Some(note) = &note {
            tracing::info!(%note, "the last leader left a promotion note");
            // Removed once a primary serves with a backup in sync, pinning or not.
            self.note_left = true;
        }
        // A pin or a noted wait of this monitor that the Lease's note no longer names was about
        // a failover that ended under another leader (it removes the note once a primary
        // serves with a backup in sync, or when the Promote was refused or not sent). Kept, it
        // would hold a primary that serves below the term floor (`plan::term_floor`).
        let named = note
            .as_deref()
            .and_then(|n| promotion_note::parse(n, &self.addresses).ok());
        if let Some((m, _)) = self.memory.promote_only {
            let term = self.memory.serving.as_ref().map(|s| s.term);
            if named.is_none_or(|(member, t)| member != m || Some(t) != term) {
                tracing::info!(
                    backup = %self.addresses[m],
                    "the Lease no longer notes the promotion this monitor pinned: another \
                     leader ended that failover; unpinned"
                );
                self.memory.promote_only = None;
            }
        }
        if let Some(p) = self.memory.promoted.filter(|p| p.noted) {
            if named.is_none_or(|(member, t)| member != p.member || t != p.from_term) {
                self.memory.promoted = None;
            }
        }
        // A copy from an earlier time as leader says nothing once the Lease holds none.
        self.note = note;
        Ok(())
    }

    /// A note of the failover of the primary this monitor last saw serve pins its observation
    /// to the backup it names: that leader (or this monitor, before it lost the Lease) may have
    /// promoted it, and it may still be opening its pool.
    fn apply_note(&mut self) {
        let Some(note) = &self.note else {
            return;
        };
        if self.memory.serving.is_none() {
            // No observation: nothing is promoted from none, so the note pins nothing; but a
            // failover this monitor did not see may be under way (it started while the noted
            // backup opens its pool): wait for that backup before raising the alarm. (A note
            // naming another member than the one waited for is newer: another leader's.)
            if let Ok((member, term)) = promotion_note::parse(note, &self.addresses) {
                if self.memory.promoted.is_none_or(|p| p.member != member) {
                    tracing::info!(backup = %self.addresses[member], %note, "a promotion note and no observation of a serving primary: waiting for the noted backup");
                    self.memory.promoted = Some(plan::Promoted {
                        member,
                        stuck_at: Instant::now() + self.cfg.promotion_stuck_after(),
                        from_term: term,
                        noted: true,
                    });
                }
            }
            return;
        }
        let Ok(member) =
            promotion_note::pinned(note, &self.addresses, self.memory.serving.as_ref())
        else {
            return;
        };
        if self.memory.promote_only.map(|(m, _)| m) == Some(member) {
            // Pinned already; a lead change forgot the chosen primary: it is that backup still.
            if self.memory.pointed.is_none() {
                self.memory.pointed = Some(member);
                self.labelled = None;
            }
            return;
        }
        tracing::warn!(
            backup = %self.addresses[member],
            %note,
            "a promotion note of the failover this monitor would make: waiting for that backup \
             to serve, promoting no other"
        );
        // As after a Promote of unknown outcome of its own (see `promote`): the only member
        // the observation may still promote (a refusal this monitor saw of it was of another
        // call), and the chosen primary, labelled as soon as it answers as one.
        self.memory.promote_only =
            Some((member, Instant::now() + self.cfg.promotion_stuck_after()));
        self.memory.refused.retain(|&m| m != member);
        self.memory.not_reached.retain(|n| n.member != member);
        self.memory.pointed = Some(member);
        self.labelled = None;
    }

    /// Forgets the note this monitor wrote for a promotion that did not happen (refused, not
    /// sent) and removes it from the Lease; a removal that fails is retried once a primary
    /// serves with a backup in sync (a next leader reading it meanwhile is pinned to that
    /// backup: refused, it moves on; not connected, it asks that backup again every round, as
    /// for its own pin).
    async fn forget_note(&mut self) {
        self.note = None;
        self.remove_note().await;
    }

    /// Removes the promotion note once a primary serves with a backup in sync (a failure is
    /// retried next round).
    async fn remove_note(&mut self) {
        if !self.note_left {
            return;
        }
        match tokio::time::timeout(LEADS_TIMEOUT, self.leadership.leave_note(None)).await {
            Ok(Ok(true)) => {
                self.note_left = false;
                self.note = None;
            }
            // Not leading any more (the next leader reads the note and removes it once it sees
            // a primary serve), or the Lease changed under the write (retried next round).
            Ok(Ok(false)) => {
                tracing::debug!("removing the promotion note: the Lease changed; retrying")
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %format!("{e:#}"), "removing the promotion note; retrying")
            }
            Err(_) => tracing::debug!("removing the promotion note: no answer; retrying"),
        }
    }

    fn say(&mut self, what: &str, error: bool) {
        // Once per message, whatever durations it quotes (they change every round).
        let without_waits = without_durations(what);
        if self.said != without_waits {
            if error {
                tracing::error!("dpm replica set: {what}");
            } else {
                tracing::info!("dpm replica set: {what}");
            }
            self.said = without_waits;
        }
    }

    /// Points the clients at `member` (serving under `term`), within [`POINT_TIMEOUT`], if this
    /// monitor still leads.
    async fn point(&mut self, member: usize, term: u64) -> Result<(), String> {
        if !self.leadership.leads().await {
            return Err("this monitor no longer leads".into());
        }
        let pointing = self.pointer.point_at(&self.cfg.members, member);
        match tokio::time::timeout(POINT_TIMEOUT, pointing).await {
            Ok(Ok(())) => {
                self.labelled = Some((member, term, Instant::now()));
                Ok(())
            }
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(_) => Err(format!("no answer within {} s", POINT_TIMEOUT.as_secs())),
        }
    }

    async fn serving(
        &mut self,
        primary: usize,
        term: u64,
        point: bool,
        add: Vec<usize>,
    ) -> Outcome {
        metrics::gauge!("dinomo_monitor_dpm_failover_stuck").set(0.0);
        if let Some((member, detected, promoted)) = self.promoting {
            if member == primary {
                let ms = detected.elapsed().as_millis() as u64;
                tracing::info!(
                    primary = %self.addresses[primary],
                    failover_ms = ms,
                    since_promote_ms = promoted.elapsed().as_millis() as u64,
                    "failover done: the promoted backup answers as the primary"
                );
                metrics::gauge!("dinomo_monitor_dpm_failover_ms").set(ms as f64);
            }
            self.promoting = None;
        }
        let stale = self
            .labelled
            .is_none_or(|(m, t, at)| m != primary || t != term || at.elapsed() >= RELABEL_EVERY);
        let backing_off = self
            .label_failed
            .is_some_and(|at| at.elapsed() < LABEL_RETRY);
        let mut outcome = Outcome::Serving { primary };
        if (point || stale) && !backing_off {
            match self.point(primary, term).await {
                Ok(()) => {
                    self.label_failed = None;
                    if point {
                        tracing::info!(primary = %self.addresses[primary], term, "clients pointed at the dpm primary");
                    }
                    self.memory.pointed = Some(primary);
                }
                Err(e) => {
                    let why = format!(
                        "pointing clients at the primary {}: {e}",
                        self.addresses[primary]
                    );
                    tracing::warn!("{why}; retrying in {} s", LABEL_RETRY.as_secs());
                    self.label_failed = Some(Instant::now());
                    outcome = Outcome::Failed(why);
                }
            }
        }
        self.say(
            &format!("{} serves as the primary", self.addresses[primary]),
            false,
        );
        if !add.is_empty() && !self.leadership.leads().await {
            // Lost meanwhile: the new leader adds them (twice would copy them twice).
            return Outcome::Standby;
        }
        for m in add {
            if let Some((call, started)) = &self.adding[m] {
                if !call.is_finished() || started.elapsed() < ADD_RETRY {
                    continue;
                }
            }
            let (p, b) = (self.addresses[primary].clone(), self.addresses[m].clone());
            let replicas = self.replicas.clone();
            // Its own task: an attach digests the backup's whole pool first, and the rounds
            // must go on meanwhile.
            let call = tokio::spawn(async move {
                match replicas.add_backup(&p, &b).await {
                    Ok(()) => {
                        tracing::info!(primary = %p, backup = %b, "added a member that answered as a backup to the primary's set")
                    }
                    Err(e) => {
                        tracing::warn!(primary = %p, backup = %b, error = %format!("{e:#}"), "adding a backup failed; retrying")
                    }
                }
            });
            self.adding[m] = Some((call, Instant::now()));
        }
        // The note's failover is over for this monitor whether or not its removal succeeds: it
        // pins or delays nothing here from now on. It stays on the Lease until a backup is in
        // sync with the primary (until then the old primary may still report one: a next
        // leader needs the note to know it is replaced). Last: not urgent, and its write waits
        // for the Lease's renewals.
        self.note = None;
        if self.memory.serving.is_some() {
            self.remove_note().await;
        }
        outcome
    }

    async fn promote(
        &mut self,
        member: usize,
        others: Vec<usize>,
        min_term: u64,
        down_for: Duration,
    ) -> Outcome {
        let target = self.addresses[member].clone();
        let backups: Vec<String> = others.iter().map(|&m| self.addresses[m].clone()).collect();
        // The round began with this monitor leading; a Lease lost since (a slow round) must
        // not promote beside the new leader.
        if !self.leadership.leads().await {
            return Outcome::Standby;
        }
        let Some(observed) = self.memory.serving.as_ref().map(|s| s.term) else {
            // The plan promotes only from an observation.
            return Outcome::Failed("no observation to promote from".into());
        };
        // Noted first: a monitor that takes over while the backup opens its pool (it answers
        // nothing meanwhile) must wait for it, not promote another backup of the observation.
        // The write is conditional on the Lease this monitor holds: a monitor that took it
        // over meanwhile makes it fail, so no Promote follows. Marked left before the write:
        // a write whose answer is lost may have landed.
        self.note_left = true;
        let note = promotion_note::encode(&target, observed, promotion_note::unix_now_ms());
        match tokio::time::timeout(
            LEADS_TIMEOUT,
            self.leadership.leave_note(Some(note.clone())),
        )
        .await
        {
            Ok(Ok(true)) => self.note = Some(note),
            Ok(Ok(false)) => {
                tracing::warn!(backup = %target, "not promoting: the Lease changed while noting the promotion (another monitor leads?)");
                return Outcome::Standby;
            }
            Ok(Err(e)) => {
                let why = format!("noting the promotion of {target} for a next leader: {e:#}; not promoting this round");
                tracing::warn!("{why}");
                return Outcome::Failed(why);
            }
            Err(_) => {
                let why = format!(
                    "noting the promotion of {target} for a next leader: no answer within {} s; \
                     not promoting this round",
                    LEADS_TIMEOUT.as_secs()
                );
                tracing::warn!("{why}");
                return Outcome::Failed(why);
            }
        }
        tracing::warn!(
            backup = %target,
            down_ms = down_for.as_millis() as u64,
            min_term,
            others = ?backups,
            "the dpm primary is down: promoting a backup that was in sync"
        );
        match self.replicas.promote(&target, backups, min_term).await {
            Ok(()) => {
                metrics::counter!("dinomo_monitor_dpm_failovers_total").increment(1);
                let now = Instant::now();
                self.promoting = Some((member, now - down_for, now));
                self.memory.serving = None;
                self.memory.down_since = None;
                self.memory.promoted = Some(plan::Promoted {
                    member,
                    stuck_at: now + self.cfg.promotion_stuck_after(),
                    from_term: observed,
                    noted: false,
                });
                // The chosen primary from now on, labelled or not: the plan counts it as
                // serving once it answers as a primary, and a failed label is retried then.
                self.memory.pointed = Some(member);
                // Point at once: the clients' next connection finds the new primary as soon
                // as it serves (it recovers the pool first). Its term is not known yet: the
                // next round labels it again under it.
                if let Err(e) = self.point(member, 0).await {
                    self.labelled = None;
                    tracing::warn!(error = %e, "pointing clients at the promoted primary; retrying");
                }
                Outcome::Promoted { member }
            }
            Err(PromoteError::Refused(e)) => {
                let why = format!("promoting {target}: refused: {e}");
                tracing::error!("{why}; another backup of the observation is tried next round");
                self.memory.refused.push(member);
                // Nothing changed there, and nothing is under way there either (a Promote in
                // progress answers ALREADY_EXISTS): no pin on it, and a next leader must not
                // wait for it.
                if self.memory.promote_only.map(|(m, _)| m) == Some(member) {
                    self.memory.promote_only = None;
                }
                self.forget_note().await;
                Outcome::Failed(why)
            }
            Err(PromoteError::NotSent(e))
                if self.memory.promote_only.map(|(m, _)| m) == Some(member) =>
            {
                // Pinned before this call (an earlier Promote of unknown outcome, or the last
                // leader's): it may still be promoting itself, so it is the only one asked,
                // again next round; the note stays.
                let why = format!("promoting {target}: not sent: {e}; asking it again");
                tracing::warn!("{why}");
                self.pinned_failure(why)
            }
            Err(PromoteError::NotSent(e)) => {
                // Nothing reached it: another backup of the observation is tried first, this
                // one again after `failover_after` (it may be the only one in sync), and a
                // next leader must not wait for it.
                let why = format!("promoting {target}: not sent: {e}");
                tracing::error!(
                    "{why}; another backup of the observation is tried first, this one again later"
                );
                let now = Instant::now();
                match self
                    .memory
                    .not_reached
                    .iter_mut()
                    .find(|n| n.member == member)
                {
                    // Asked again: the wait counts from the first try.
                    Some(n) => n.at = now,
                    None => self.memory.not_reached.push(plan::NotReached {
                        member,
                        at: now,
                        stuck_at: now + self.cfg.promotion_stuck_after(),
                    }),
                }
                self.forget_note().await;
                Outcome::Failed(why)
            }
            Err(PromoteError::Unknown(e)) => {
                // It may be promoting itself: no other backup may be promoted beside it. It is
                // the chosen one from now on (the plan counts it as serving once it answers as
                // a primary), and the only one the observation may still promote (again: a
                // second Promote of it is answered ALREADY_EXISTS if the first got through).
                let why = format!(
                    "promoting {target}: no answer that says whether it is promoting itself \
                     ({e}); waiting for it to serve, and promoting no other backup"
                );
                tracing::error!("{why}");
                let now = Instant::now();
                self.promoting = Some((member, now - down_for, now));
                // Asked again (pinned already): the wait counts from the first pin.
                let stuck_at = match self.memory.promote_only {
                    Some((m, at)) if m == member => at,
                    _ => now + self.cfg.promotion_stuck_after(),
                };
                self.memory.promote_only = Some((member, stuck_at));
                self.memory.pointed = Some(member);
                self.labelled = None;
                self.pinned_failure(why)
            }
        }
    }

    /// A Promote of the pinned backup that failed again (not sent, or no answer): asked again
    /// next round, and past the pin's stuck time reported stuck (a backup answering Status as
    /// a backup of the observation's term is asked every round, which alone never reports).
    fn pinned_failure(&mut self, why: String) -> Outcome {
        match self.memory.promote_only {
            Some((_, stuck_at)) if Instant::now() >= stuck_at => {
                let why = format!(
                    "{why}; for longer than `promotion_stuck_after_ms`: bring the primary back, \
                     or promote a backup by hand (helm/README.md, \"Backups\")"
                );
                self.say(&why, true);
                metrics::gauge!("dinomo_monitor_dpm_failover_stuck").set(1.0);
                Outcome::Stuck(why)
            }
            _ => Outcome::Failed(why),
        }
    }
}
