//! Configuration of the monitor: [`MonitorConfig`], read from TOML (config/monitor.toml is the
//! documented example, and a test checks that it equals [`MonitorConfig::default`]).
//!
//! Sections: `[server]` (addresses), `[stats]` (how statistics are gathered each epoch),
//! `[failure]` (failure detection), `[orchestrator]` (which platform runs the KNs, with
//! `[orchestrator.kubernetes]`), `[policy]` ([`PolicyConfig`], the parameters of the SLO
//! policy engine, DINOMO Table 4) and `[dpm_replicas]` (the dpm-node replica set the monitor
//! fails over, [`DpmReplicasConfig`]). The `[policy]` table can also be read alone
//! ([`PolicyConfig::from_toml_str`], for the SetPolicy RPC).
//!
//! Invariants:
//! - every field is optional in the file (`default`) and an unknown field is an error
//!   (`deny_unknown_fields`), so a typo never silently falls back to a default;
//! - durations are written as integer milliseconds in fields named `*_ms` and read through
//!   `Duration` accessor methods (`PolicyConfig::epoch()`, ...); every duration must be above
//!   0 except `policy.grace_period_ms`, where 0 switches the grace period off (experiments);
//! - a config returned by [`MonitorConfig::from_toml_str`] or [`MonitorConfig::load`] has
//!   passed [`MonitorConfig::validate`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use dinomo_node_common::config::invalid;
use serde::{Deserialize, Serialize};

use crate::dpm_replicas::DpmReplicasConfig;
use crate::orchestrator::kubernetes::KubernetesConfig;

/// Why a monitor config was refused (the convention every node shares:
/// [`dinomo_node_common::config`]).
pub use dinomo_node_common::config::ConfigError;

/// The whole monitor configuration.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    pub server: ServerConfig,
    pub stats: StatsConfig,
    pub failure: FailureConfig,
    pub orchestrator: OrchestratorConfig,
    pub policy: PolicyConfig,
    /// `[dpm_replicas]`: the dpm-node replica set this monitor fails over (off by default).
    pub dpm_replicas: DpmReplicasConfig,
}

/// `[server]`: where the monitor listens and what it talks to.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// MonitorService gRPC address (client latency reports, Status, admin actions).
    pub listen: SocketAddr,
    /// The address clients reach MonitorService at (host:port). While this monitor leads it
    /// publishes it at the DPM, and routing nodes hand it to clients, which then report their
    /// latencies to it by default. Empty: the listen address, unless that is unspecified
    /// (0.0.0.0 or [::]), in which case nothing is published.
    pub advertise: String,
    /// The dpm-node's gRPC address.
    pub dpm: String,
    /// Prometheus /metrics address; empty disables it.
    pub metrics_listen: String,
    /// Decisions kept for the Status RPC.
    pub recent_decisions: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7600)),
            advertise: String::new(),
            dpm: "127.0.0.1:7700".into(),
            metrics_listen: "127.0.0.1:9600".into(),
            recent_decisions: 32,
        }
    }
}

impl ServerConfig {
    /// The metrics address, or `None` when disabled. Valid after [`MonitorConfig::validate`].
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        if self.metrics_listen.is_empty() {
            None
        } else {
            self.metrics_listen.parse().ok()
        }
    }
}

/// `[stats]`: how the per-epoch statistics are gathered.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StatsConfig {
    /// How often clients should send latency reports (told to them in every LatencyReply).
    pub report_every_ms: u64,
    /// Most frequent keys asked from each KN per epoch (KNs answer at most 1000).
    pub top_keys: u32,
    /// Deadline of one KN's Stats RPC; a KN that misses it is left out of that epoch.
    pub kn_stats_timeout_ms: u64,
}

impl Default for StatsConfig {
    fn default() -> Self {
        StatsConfig {
            report_every_ms: 1000,
            top_keys: 128,
            kn_stats_timeout_ms: 500,
        }
    }
}

impl StatsConfig {
    pub fn report_every(&self) -> Duration {
        Duration::from_millis(self.report_every_ms)
    }

    pub fn kn_stats_timeout(&self) -> Duration {
        Duration::from_millis(self.kn_stats_timeout_ms)
    }
}

/// `[failure]`: failure detection by missed heartbeats (in addition to what the orchestrator
/// reports).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailureConfig {
    /// How often each KN is probed.
    pub probe_every_ms: u64,
    /// A KN that has not answered a probe for this long is declared failed and recovered.
    pub failed_after_ms: u64,
}

impl Default for FailureConfig {
    fn default() -> Self {
        FailureConfig {
            probe_every_ms: 200,
            failed_after_ms: 1000,
        }
    }
}

impl FailureConfig {
    pub fn probe_every(&self) -> Duration {
        Duration::from_millis(self.probe_every_ms)
    }

    pub fn failed_after(&self) -> Duration {
        Duration::from_millis(self.failed_after_ms)
    }
}

/// Which platform runs the KV nodes (see [`crate::orchestrator`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OrchestratorKind {
    /// KNs are child processes of the monitor.
    #[default]
    Local,
    /// KNs are the pods of a StatefulSet.
    Kubernetes,
    /// KNs are started by someone else (containers, systemd); the monitor adopts those that
    /// register with the DPM.
    External,
}

/// `[orchestrator]`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrchestratorConfig {
    pub kind: OrchestratorKind,
    /// `[orchestrator.kubernetes]`: used when `kind = "kubernetes"`.
    pub kubernetes: KubernetesConfig,
}

/// `[policy]`: the SLO policy engine's parameters (DINOMO section 3.5, Table 4). Defaults are
/// the paper's experimental settings where it gives one.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Average-latency SLO, microseconds (paper: 1.2 ms).
    pub avg_latency_slo_us: u64,
    /// Tail (p99) latency SLO, microseconds (paper: 16 ms).
    pub tail_latency_slo_us: u64,
    /// A KN is over-utilised above this occupancy (paper: 0.20).
    pub over_utilized: f64,
    /// A KN is under-utilised below this occupancy (paper: 0.10).
    pub under_utilized: f64,
    /// A key is hot above mean + this many standard deviations of key access counts (paper: 3).
    pub hot_key_sigmas: f64,
    /// A replicated key is cold below mean - this many standard deviations (paper: 1).
    pub cold_key_sigmas: f64,
    /// A hot key must also carry at least this share of all requests of the epoch.
    pub min_hot_key_share: f64,
    /// Most keys replicated (or re-replicated) by one decision.
    pub max_hot_keys_per_epoch: usize,
    /// Time between two policy decisions (the paper does not give one).
    pub epoch_ms: u64,
    /// After a membership change, no other membership or replication change for this long
    /// (paper: 90 s); 0 switches the grace period off.
    pub grace_period_ms: u64,
    /// The policy never removes a KN below this many.
    pub min_kns: u32,
    /// The policy never adds a KN above this many.
    pub max_kns: u32,
    /// Largest replication factor; 0 means up to the number of KNs.
    pub max_replication: u32,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            avg_latency_slo_us: 1200,
            tail_latency_slo_us: 16_000,
            over_utilized: 0.20,
            under_utilized: 0.10,
            hot_key_sigmas: 3.0,
            cold_key_sigmas: 1.0,
            min_hot_key_share: 0.01,
            max_hot_keys_per_epoch: 8,
            epoch_ms: 1000,
            grace_period_ms: 90_000,
            min_kns: 1,
            max_kns: 16,
            max_replication: 0,
        }
    }
}

impl PolicyConfig {
    pub fn epoch(&self) -> Duration {
        Duration::from_millis(self.epoch_ms)
    }

    pub fn grace_period(&self) -> Duration {
        Duration::from_millis(self.grace_period_ms)
    }

    /// Checks every policy field; `Err` names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("policy.avg_latency_slo_us", self.avg_latency_slo_us)?;
        positive("policy.tail_latency_slo_us", self.tail_latency_slo_us)?;
        fraction("policy.over_utilized", self.over_utilized)?;
        fraction("policy.under_utilized", self.under_utilized)?;
        if self.under_utilized >= self.over_utilized {
            return Err(invalid(
                "policy.under_utilized",
                format!(
                    "{} must be below policy.over_utilized ({}), or a KN could be both under- \
                     and over-utilised",
                    self.under_utilized, self.over_utilized
                ),
            ));
        }
        sigmas("policy.hot_key_sigmas", self.hot_key_sigmas)?;
        sigmas("policy.cold_key_sigmas", self.cold_key_sigmas)?;
        fraction("policy.min_hot_key_share", self.min_hot_key_share)?;
        positive(
            "policy.max_hot_keys_per_epoch",
            self.max_hot_keys_per_epoch as u64,
        )?;
        positive("policy.epoch_ms", self.epoch_ms)?;
        // grace_period_ms = 0 is allowed: it switches the grace period off.
        positive("policy.min_kns", u64::from(self.min_kns))?;
        if self.max_kns < self.min_kns {
            return Err(invalid(
                "policy.max_kns",
                format!(
                    "{} must be at least policy.min_kns ({})",
                    self.max_kns, self.min_kns
                ),
            ));
        }
        if self.max_replication == 1 {
            return Err(invalid(
                "policy.max_replication",
                "1 would forbid replication; use 0 (up to the number of KNs) or at least 2"
                    .to_string(),
            ));
        }
        Ok(())
    }
}

/// `[policy]` wrapping, for [`PolicyConfig::from_toml_str`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyTable {
    policy: PolicyConfig,
}

impl PolicyConfig {
    /// Parses and validates a policy alone: either a document holding only a `[policy]` table
    /// or the policy's fields at the top level. Omitted fields take their defaults.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let parse_error = |e: toml::de::Error| ConfigError::Parse {
            origin: "policy".to_string(),
            message: e.to_string(),
        };
        let table: toml::Table = toml::from_str(text).map_err(parse_error)?;
        let policy = if table.contains_key("policy") {
            toml::from_str::<PolicyTable>(text)
                .map_err(parse_error)?
                .policy
        } else {
            toml::from_str::<PolicyConfig>(text).map_err(parse_error)?
        };
        policy.validate()?;
        Ok(policy)
    }

    /// The policy as TOML fields (no `[policy]` header), readable by
    /// [`PolicyConfig::from_toml_str`] as long as no integer exceeds `i64::MAX` (TOML's
    /// integers are i64: such a value is written but refused when read back).
    pub fn to_toml_string(&self) -> String {
        // A struct of plain numbers: serialising it has no failure case.
        toml::to_string(self).expect("a PolicyConfig always serialises to TOML")
    }
}

impl MonitorConfig {
    /// Parses and validates a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, "monitor config")
    }

    /// Reads, parses and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: MonitorConfig = dinomo_node_common::config::parse_toml(text, origin)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every section; `Err` names the first bad field and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.server.dpm.trim().is_empty() {
            return Err(invalid(
                "server.dpm",
                "must be the dpm-node's address, not empty".to_string(),
            ));
        }
        if !self.server.metrics_listen.is_empty()
            && self.server.metrics_listen.parse::<SocketAddr>().is_err()
        {
            return Err(invalid(
                "server.metrics_listen",
                format!(
                    "{:?} is not a socket address (use \"\" to disable metrics)",
                    self.server.metrics_listen
                ),
            ));
        }
        positive(
            "server.recent_decisions",
            self.server.recent_decisions as u64,
        )?;
        positive("stats.report_every_ms", self.stats.report_every_ms)?;
        positive("stats.top_keys", u64::from(self.stats.top_keys))?;
        positive("stats.kn_stats_timeout_ms", self.stats.kn_stats_timeout_ms)?;
        positive("failure.probe_every_ms", self.failure.probe_every_ms)?;
        if self.failure.failed_after_ms <= self.failure.probe_every_ms {
            return Err(invalid(
                "failure.failed_after_ms",
                format!(
                    "{} must be above failure.probe_every_ms ({}), or one late probe would \
                     declare a KN failed",
                    self.failure.failed_after_ms, self.failure.probe_every_ms
                ),
            ));
        }
        self.validate_kubernetes()?;
        let kubernetes = self.orchestrator.kind == OrchestratorKind::Kubernetes;
        self.dpm_replicas.validate(kubernetes)?;
        let lease = self.orchestrator.kubernetes.lease_duration_secs;
        if kubernetes && self.dpm_replicas.enabled() && lease < crate::dpm_replicas::MIN_LEASE_SECS
        {
            return Err(invalid(
                "orchestrator.kubernetes.lease_duration_secs",
                format!(
                    "{lease} is below {} s, the shortest Lease with which the monitor fails the \
                     dpm replica set over (it acts up to 7 s after a renewal)",
                    crate::dpm_replicas::MIN_LEASE_SECS
                ),
            ));
        }
        self.policy.validate()
    }

    fn validate_kubernetes(&self) -> Result<(), ConfigError> {
        let k = &self.orchestrator.kubernetes;
        for (field, value) in [
            ("orchestrator.kubernetes.statefulset", &k.statefulset),
            ("orchestrator.kubernetes.service", &k.service),
            ("orchestrator.kubernetes.lease_name", &k.lease_name),
        ] {
            if value.trim().is_empty() {
                return Err(invalid(field, "must not be empty".to_string()));
            }
        }
        positive("orchestrator.kubernetes.kn_port", u64::from(k.kn_port))?;
        positive(
            "orchestrator.kubernetes.lease_duration_secs",
            u64::from(k.lease_duration_secs),
        )?;
        positive(
            "orchestrator.kubernetes.ready_timeout_ms",
            k.ready_timeout_ms,
        )?;
        positive("orchestrator.kubernetes.stop_timeout_ms", k.stop_timeout_ms)?;
        positive(
            "orchestrator.kubernetes.poll_interval_ms",
            k.poll_interval_ms,
        )?;
        Ok(())
    }
}

fn positive(field: &str, value: u64) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(invalid(
            field,
            "0 is not allowed: must be above 0".to_string(),
        ));
    }
    Ok(())
}

fn fraction(field: &str, value: f64) -> Result<(), ConfigError> {
    // `contains` is false for NaN, so NaN is refused too.
    if !(0.0..=1.0).contains(&value) {
        return Err(invalid(field, format!("{value} must be in 0..=1")));
    }
    Ok(())
}

fn sigmas(field: &str, value: f64) -> Result<(), ConfigError> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(invalid(
            field,
            format!("{value} must be a finite number of standard deviations >= 0"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED: &str = include_str!("../../config/monitor.toml");

    fn invalid_field(err: ConfigError) -> String {
        match err {
            ConfigError::Invalid { field, .. } => field,
            other => panic!("expected an Invalid error, got {other}"),
        }
    }

    #[test]
    fn shipped_file_parses_and_equals_the_defaults() {
        let cfg = MonitorConfig::from_toml_str(SHIPPED).unwrap();
        assert_eq!(cfg, MonitorConfig::default());
    }

    #[test]
    fn defaults_are_the_paper_values() {
        let p = PolicyConfig::default();
        assert_eq!(p.avg_latency_slo_us, 1200);
        assert_eq!(p.tail_latency_slo_us, 16_000);
        assert_eq!(p.over_utilized, 0.20);
        assert_eq!(p.under_utilized, 0.10);
        assert_eq!(p.hot_key_sigmas, 3.0);
        assert_eq!(p.cold_key_sigmas, 1.0);
        assert_eq!(p.grace_period(), Duration::from_secs(90));
        assert_eq!(p.epoch(), Duration::from_secs(1));
        MonitorConfig::default().validate().unwrap();
    }

    #[test]
    fn empty_file_is_the_defaults() {
        assert_eq!(
            MonitorConfig::from_toml_str("").unwrap(),
            MonitorConfig::default()
        );
    }

    #[test]
    fn fields_override_defaults_and_durations_are_milliseconds() {
        let cfg = MonitorConfig::from_toml_str(
            "[policy]\nepoch_ms = 250\nmax_kns = 4\n[orchestrator]\nkind = \"kubernetes\"\n",
        )
        .unwrap();
        assert_eq!(cfg.policy.epoch(), Duration::from_millis(250));
        assert_eq!(cfg.policy.max_kns, 4);
        assert_eq!(cfg.orchestrator.kind, OrchestratorKind::Kubernetes);
        assert_eq!(cfg.policy.min_kns, 1);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = MonitorConfig::from_toml_str("[policy]\nepoch = 1000\n").unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
        assert!(err.to_string().contains("epoch"), "{err}");
        let err = MonitorConfig::from_toml_str("[polcy]\n").unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
        let err = MonitorConfig::from_toml_str("[orchestrator]\nkind = \"nomad\"\n").unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
    }

    #[test]
    fn utilisation_bounds_must_be_ordered() {
        let err =
            MonitorConfig::from_toml_str("[policy]\nunder_utilized = 0.3\nover_utilized = 0.2\n")
                .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("policy.under_utilized"), "{text}");
        assert!(text.contains("0.3"), "{text}");
        assert_eq!(invalid_field(err), "policy.under_utilized");
        // Equal bounds are refused too.
        let err =
            MonitorConfig::from_toml_str("[policy]\nunder_utilized = 0.2\nover_utilized = 0.2\n")
                .unwrap_err();
        assert_eq!(invalid_field(err), "policy.under_utilized");
    }

    #[test]
    fn fractions_must_be_in_zero_to_one() {
        let err = MonitorConfig::from_toml_str("[policy]\nover_utilized = 1.5\n").unwrap_err();
        assert!(err.to_string().contains("1.5"), "{err}");
        assert_eq!(invalid_field(err), "policy.over_utilized");
        let err = MonitorConfig::from_toml_str("[policy]\nmin_hot_key_share = -0.1\n").unwrap_err();
        assert_eq!(invalid_field(err), "policy.min_hot_key_share");
        let cfg = MonitorConfig {
            policy: PolicyConfig {
                under_utilized: f64::NAN,
                ..PolicyConfig::default()
            },
            ..MonitorConfig::default()
        };
        assert_eq!(
            invalid_field(cfg.validate().unwrap_err()),
            "policy.under_utilized"
        );
    }

    #[test]
    fn durations_and_counts_must_be_positive() {
        for (text, field) in [
            ("[policy]\nepoch_ms = 0\n", "policy.epoch_ms"),
            (
                "[policy]\navg_latency_slo_us = 0\n",
                "policy.avg_latency_slo_us",
            ),
            ("[policy]\nmin_kns = 0\n", "policy.min_kns"),
            (
                "[policy]\nmax_hot_keys_per_epoch = 0\n",
                "policy.max_hot_keys_per_epoch",
            ),
            ("[stats]\nreport_every_ms = 0\n", "stats.report_every_ms"),
            ("[failure]\nprobe_every_ms = 0\n", "failure.probe_every_ms"),
        ] {
            let err = MonitorConfig::from_toml_str(text).unwrap_err();
            assert_eq!(invalid_field(err), field, "{text}");
        }
    }

    #[test]
    fn other_bad_values_name_their_field() {
        for (text, field) in [
            ("[policy]\nmin_kns = 4\nmax_kns = 3\n", "policy.max_kns"),
            ("[policy]\nmax_replication = 1\n", "policy.max_replication"),
            ("[policy]\nhot_key_sigmas = -1.0\n", "policy.hot_key_sigmas"),
            (
                "[policy]\ncold_key_sigmas = inf\n",
                "policy.cold_key_sigmas",
            ),
            (
                "[failure]\nprobe_every_ms = 500\nfailed_after_ms = 500\n",
                "failure.failed_after_ms",
            ),
            (
                "[server]\nmetrics_listen = \"nowhere\"\n",
                "server.metrics_listen",
            ),
            ("[server]\ndpm = \"\"\n", "server.dpm"),
            (
                "[orchestrator.kubernetes]\nstatefulset = \"\"\n",
                "orchestrator.kubernetes.statefulset",
            ),
            (
                "[orchestrator.kubernetes]\npoll_interval_ms = 0\n",
                "orchestrator.kubernetes.poll_interval_ms",
            ),
        ] {
            let err = MonitorConfig::from_toml_str(text).unwrap_err();
            assert_eq!(invalid_field(err), field, "{text}");
        }
        // Bad addresses in typed fields fail while parsing, naming the field.
        let err = MonitorConfig::from_toml_str("[server]\nlisten = \"nowhere\"\n").unwrap_err();
        assert!(err.to_string().contains("listen"), "{err}");
    }

    #[test]
    fn a_zero_grace_period_switches_it_off() {
        let cfg = MonitorConfig::from_toml_str("[policy]\ngrace_period_ms = 0\n").unwrap();
        assert_eq!(cfg.policy.grace_period(), Duration::ZERO);
    }

    #[test]
    fn kubernetes_section_is_read() {
        let cfg = MonitorConfig::from_toml_str(
            "[orchestrator]\nkind = \"kubernetes\"\n[orchestrator.kubernetes]\n\
             namespace = \"kv\"\nkn_port = 7100\n",
        )
        .unwrap();
        assert_eq!(cfg.orchestrator.kubernetes.namespace, "kv");
        assert_eq!(cfg.orchestrator.kubernetes.kn_port, 7100);
        assert_eq!(
            cfg.orchestrator.kubernetes.statefulset,
            KubernetesConfig::default().statefulset
        );
        // Refused for the right reason: the error names the unknown field.
        let e = MonitorConfig::from_toml_str("[orchestrator.kubernetes]\nnamespaces = \"kv\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("namespaces"), "{e}");
    }

    #[test]
    fn policy_alone_parses_with_or_without_its_header() {
        let bare = PolicyConfig::from_toml_str("epoch_ms = 300\ngrace_period_ms = 0\n").unwrap();
        assert_eq!(bare.epoch_ms, 300);
        assert_eq!(bare.grace_period_ms, 0);
        assert_eq!(bare.max_kns, 16);
        let wrapped =
            PolicyConfig::from_toml_str("[policy]\nepoch_ms = 300\ngrace_period_ms = 0\n").unwrap();
        assert_eq!(wrapped, bare);
        assert_eq!(
            PolicyConfig::from_toml_str("").unwrap(),
            PolicyConfig::default()
        );
        // Other sections, unknown fields and bad values are refused.
        for text in [
            "[policy]\nepoch_ms = 300\n[server]\ndpm = \"x\"\n",
            "epoch = 300\n",
            "[policy]\nepoch = 300\n",
        ] {
            let err = PolicyConfig::from_toml_str(text).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{text}: {err}");
        }
        let err = PolicyConfig::from_toml_str("under_utilized = 0.5\n").unwrap_err();
        assert_eq!(invalid_field(err), "policy.under_utilized");
    }

    #[test]
    fn policy_round_trips_through_toml() {
        let p = PolicyConfig {
            over_utilized: 0.35,
            hot_key_sigmas: 1000.0,
            grace_period_ms: 0,
            max_replication: 3,
            ..PolicyConfig::default()
        };
        let text = p.to_toml_string();
        assert!(text.contains("over_utilized = 0.35"), "{text}");
        assert_eq!(PolicyConfig::from_toml_str(&text).unwrap(), p);
        assert_eq!(
            PolicyConfig::from_toml_str(&format!("[policy]\n{text}")).unwrap(),
            p
        );
    }

    #[test]
    fn metrics_can_be_disabled() {
        let cfg = MonitorConfig::from_toml_str("[server]\nmetrics_listen = \"\"\n").unwrap();
        assert_eq!(cfg.server.metrics_addr(), None);
        assert_eq!(
            MonitorConfig::default().server.metrics_addr(),
            Some(SocketAddr::from(([127, 0, 0, 1], 9600)))
        );
    }

    #[test]
    fn load_reads_a_file_and_reports_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("monitor.toml");
        std::fs::write(&path, "[policy]\nmax_kns = 5\n").unwrap();
        assert_eq!(MonitorConfig::load(&path).unwrap().policy.max_kns, 5);
        std::fs::write(&path, "[policy]\nmax_kns = \"five\"\n").unwrap();
        let err = MonitorConfig::load(&path).unwrap_err();
        assert!(err.to_string().contains("monitor.toml"), "{err}");
        let missing = dir.path().join("absent.toml");
        let err = MonitorConfig::load(&missing).unwrap_err();
        assert!(matches!(err, ConfigError::Io { .. }), "{err}");
    }
}
