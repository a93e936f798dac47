//! `dinomo admin`: the monitor's admin actions (add, remove or fail a KV node) and its status.

use anyhow::Context;
use clap::{Args, Subcommand};
use dinomo_proto::monitor::monitor_service_client::MonitorServiceClient;
use dinomo_proto::monitor::{AddKnRequest, KnRequest, PolicyRequest, StatusRequest};

#[derive(Debug, Args)]
pub struct AdminArgs {
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
    let url = if a.monitor.starts_with("http") {
        a.monitor.clone()
    } else {
        format!("http://{}", a.monitor)
    };
    let mut m = MonitorServiceClient::connect(url)
        .await
        .with_context(|| format!("cannot reach the monitor at {}", a.monitor))?;
    let reply = match a.action {
        Action::AddKn => m.add_kn(AddKnRequest {}).await,
        Action::RemoveKn { kn } => m.remove_kn(KnRequest { kn_id: kn }).await,
        Action::FailKn { kn } => m.fail_kn(KnRequest { kn_id: kn }).await,
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
                    d.at_ms, d.action, d.map_version, d.reason
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
