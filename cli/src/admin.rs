//! `dinomo admin`: the monitor's admin actions (add, remove or fail a KV node) and its status;
//! failing the dpm-node primary (see [`crate::fail_dpm`]) and changing its replica set (see
//! [`crate::backup_set`]).

use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::{AddKnRequest, KnRequest, PolicyRequest, StatusRequest};

#[derive(Debug, Args)]
pub struct AdminArgs {
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    /// The monitor's address (`dinomo up` runs it at port-base - 100: 7600 by default).
    #[arg(long, env = "DINOMO_MONITOR", default_value = "127.0.0.1:7600")]
    pub monitor: String,
    #[command(subcommand)]
    pub action: Action,
}

#[derive(Debug, Subcommand)]
pub enum Action {
    /// Start a KV node and add it to the cluster map.
    AddKn,
    /// Take a KV node out of the map, let its requests drain, then stop it.
    RemoveKn {
        /// The KV node's id.
        kn: u32,
    },
    /// Kill a KV node abruptly (an experiment): the monitor detects the failure, merges its
    /// logs, fences it and publishes a map without it. Prints the recovery time.
    FailKn {
        /// The KV node's id.
        kn: u32,
    },
    /// Kill the dpm-node primary abruptly (SIGKILL, an experiment; it must run on this host
    /// and have backups in sync): `dinomo up --dpm-replicas N` promotes a backup. Prints the
    /// failover time until the new primary answers and until a write (of the key
    /// "dinomo/fail-dpm/probe") is acknowledged again.
    FailDpm {
        /// The dpm-node's address.
        #[arg(long, env = "DINOMO_DPM", default_value = "127.0.0.1:7700")]
        dpm: String,
        /// A routing node, for the write that proves the cluster writes again.
        #[arg(long, env = "DINOMO_ROUTING", default_value = "127.0.0.1:7900")]
        routing: String,
        /// How long to wait for the backups to be in sync, and then for the failover.
        #[arg(long, default_value_t = 60)]
        timeout_secs: u64,
    },
    /// Add a backup dpm-node to the primary's replica set: the primary attaches it (taking
    /// its term, which fences older primaries there) and copies the chunks its pool lacks in
    /// the background; it counts for acknowledgements once in sync. Adding a backup that is in
    /// the set already attaches it anew, a failed one or one in sync alike: until it is in
    /// sync again the set holds one copy fewer. A primary started without --backup refuses
    /// (replication is off there). Prints the replica set.
    AddBackup {
        /// The backup's gRPC address (a dpm-node started with --role backup).
        backup: String,
        /// The primary dpm-node's address.
        #[arg(long, env = "DINOMO_DPM", default_value = "127.0.0.1:7700")]
        dpm: String,
        /// How long to wait for the attach (the backup digests its whole pool first: the
        /// primary allows 30 s + 4 s per GiB).
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
    },
    /// Remove a backup from the primary's replica set: the primary no longer waits for it (a
    /// failed backup holds every acknowledgement until it is removed or added again). Its pool
    /// keeps what it holds. Prints the replica set.
    RemoveBackup {
        /// The backup's gRPC address, as the primary lists it (`dinomo status`).
        backup: String,
        /// The primary dpm-node's address.
        #[arg(long, env = "DINOMO_DPM", default_value = "127.0.0.1:7700")]
        dpm: String,
    },
    /// Make a backup dpm-node the primary, in place (a failover you decided: the primary is
    /// lost). The backup must hold a complete copy (`dinomo status --dpm BACKUP` says
    /// "promotable"). It stops serving as a backup and starts as the primary on its pool at
    /// its own addresses: it recovers the pool, takes a term later than any the named nodes
    /// report (which fences the old primary at every backup it attaches) and replicates to
    /// the --backup nodes. Point the KV nodes, routing node and monitor at it (on Kubernetes,
    /// the dpm Service; see helm/README.md). Waits until it answers as the primary. A node
    /// being promoted already, or the primary already, is waited for the same way (a retry is
    /// safe; its --backup list is not applied then).
    PromoteBackup {
        /// The backup's gRPC address.
        backup: String,
        /// Another backup the new primary replicates to (repeat the flag for each).
        #[arg(long = "backup")]
        others: Vec<String>,
        /// How long to wait for it to answer as the primary.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// The monitor's view: KNs, occupancy, latencies, replicated keys, recent decisions.
    Status,
    /// Replace the policy parameters at run time from a TOML file (a [policy] table, as in
    /// config/monitor.toml; omitted fields take their defaults). Prints the policy in force.
    SetPolicy {
        /// The TOML file.
        file: std::path::PathBuf,
    },
}

pub async fn run(a: AdminArgs) -> anyhow::Result<()> {
    if let Action::FailDpm {
        dpm,
        routing,
        timeout_secs,
    } = &a.action
    {
        // The probe write is a client's call: the admin identity may not write keys.
        let writer = a.security.client("client")?;
        return crate::fail_dpm::run(dpm, routing, writer, Duration::from_secs(*timeout_secs))
            .await;
    }
    if let Action::PromoteBackup {
        backup,
        others,
        timeout_secs,
    } = &a.action
    {
        let s =
            crate::backup_set::promote(backup, others, Duration::from_secs(*timeout_secs)).await?;
        println!("{backup} is the primary now (term {}):", s.term);
        if s.backups.is_empty() {
            println!("    no backups: it acknowledges alone");
        }
        for b in &s.backups {
            println!("{}", crate::status::backup_line(b));
        }
        return Ok(());
    }
    let change = match &a.action {
        Action::AddBackup {
            backup,
            dpm,
            timeout_secs,
        } => Some((backup, dpm, true, Duration::from_secs(*timeout_secs))),
        Action::RemoveBackup { backup, dpm } => Some((backup, dpm, false, Duration::from_secs(30))),
        _ => None,
    };
    if let Some((backup, dpm, add, timeout)) = change {
        let set = crate::backup_set::change(dpm, backup, add, timeout).await?;
        println!(
            "{} backup {backup}; replica set of primary {dpm} (term {}):",
            if add { "added" } else { "removed" },
            set.term
        );
        if set.backups.is_empty() {
            println!("    no backups: the primary acknowledges alone");
        }
        for b in &set.backups {
            println!("{}", crate::status::backup_line(b));
        }
        return Ok(());
    }
    let channel = dinomo_security::Security::of_process()
        .endpoint(&a.monitor, dinomo_security::Service::Monitor)?
        .connect()
        .await;
    let mut m = channel
        .map(MonitorServiceClient::new)
        .with_context(|| format!("cannot reach the monitor at {}", a.monitor))?;
    let reply = match a.action {
        Action::AddKn => m.add_kn(AddKnRequest {}).await,
        Action::RemoveKn { kn } => m.remove_kn(KnRequest { kn_id: kn }).await,
        Action::FailKn { kn } => m.fail_kn(KnRequest { kn_id: kn }).await,
        Action::FailDpm { .. }
        | Action::AddBackup { .. }
        | Action::RemoveBackup { .. }
        | Action::PromoteBackup { .. } => unreachable!("handled above"),
        Action::SetPolicy { file } => {
            let toml = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let r = m
                .set_policy(PolicyRequest { toml })
                .await
                .map_err(|s| anyhow::anyhow!("{}", s.message()))?
                .into_inner();
            println!("policy in force:\n{}", r.toml);
            return Ok(());
        }
        Action::Status => {
            let s = m
                .status(StatusRequest {})
                .await
                .map_err(|s| anyhow::anyhow!("{}", s.message()))?
                .into_inner();
            println!(
                "map version {}  epoch {}  orchestrator {}",
                s.map_version, s.epoch, s.orchestrator
            );
            println!(
                "client latency: avg {:.0} us, p99 {:.0} us",
                s.avg_latency_us, s.p99_latency_us
            );
            println!(
                "{:>4}  {:<22} {:>9} {:>10} alive",
                "kn", "endpoint", "occupancy", "ops/epoch"
            );
            for k in &s.kns {
                println!(
                    "{:>4}  {:<22} {:>9.3} {:>10} {}",
                    k.kn_id, k.endpoint, k.occupancy, k.ops, k.alive
                );
            }
            if !s.replicated.is_empty() {
                println!("replicated keys (hex -> factor):");
                for (k, r) in &s.replicated {
                    println!("  {k} -> {r}");
                }
            }
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            println!("recent decisions:");
            for d in s
                .recent
                .iter()
                .filter(|d| d.action != "none")
                .rev()
                .take(10)
            {
                println!(
                    "  [{}] {} (map {}): {}",
                    decision_time(d.at_ms, now_ms),
                    d.action,
                    d.map_version,
                    d.reason
                );
            }
            return Ok(());
        }
    };
    let r = reply
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner();
    println!("{} (map version {})", r.message, r.map_version);
    Ok(())
}

/// When a decision was taken (`at_ms`: Unix milliseconds, the monitor's clock), as a UTC time
/// and how long before `now_ms` (this host's clock) that was.
fn decision_time(at_ms: u64, now_ms: u64) -> String {
    let (days, ms) = (at_ms / 86_400_000, at_ms % 86_400_000);
    let (y, m, d) = civil_from_days(days);
    let at = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    );
    // Clocks of two hosts: a decision "in the future" gets no age rather than a negative one.
    let Some(age) = now_ms.checked_sub(at_ms) else {
        return at;
    };
    let secs = age as f64 / 1000.0;
    let ago = if secs < 60.0 {
        format!("{secs:.1} s ago")
    } else if secs < 3600.0 {
        format!("{:.1} min ago", secs / 60.0)
    } else {
        format!("{:.1} h ago", secs / 3600.0)
    };
    format!("{at}, {ago}")
}

/// (year, month, day) of the proleptic Gregorian calendar, `days` after 1970-01-01 (Howard
/// Hinnant's `civil_from_days`: eras of 400 years, years starting in March so that the leap
/// day comes last).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_times_read_as_times() {
        // 2026-11-25T16:40:12.345Z.
        let at = 1_795_624_812_345;
        assert_eq!(
            decision_time(at, at + 12_300),
            "2026-11-25T16:40:12.345Z, 12.3 s ago"
        );
        assert_eq!(
            decision_time(at, at + 1_500_000),
            "2026-11-25T16:40:12.345Z, 25.0 min ago"
        );
        assert_eq!(
            decision_time(at, at + 36 * 3_600_000),
            "2026-11-25T16:40:12.345Z, 36.0 h ago"
        );
        // The monitor's clock ahead of this host's: no negative age.
        assert_eq!(decision_time(at, at - 5), "2026-11-25T16:40:12.345Z");
        assert_eq!(decision_time(0, 0), "1970-01-01T00:00:00.000Z, 0.0 s ago");
        // A leap day.
        assert_eq!(
            decision_time(951_782_400_000, 0),
            "2000-02-29T00:00:00.000Z"
        );
    }
}
