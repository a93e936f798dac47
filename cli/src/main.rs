//! `dinomo`: one binary for everything. `dinomo up` starts a whole local cluster (as child
//! processes of this same binary); `dinomo kv`, `dinomo status` talk to a cluster; and
//! `dinomo dpm-node|kv-node|routing-node|monitor` run single nodes; `dinomo admin` drives the
//! monitor's actions (the same code as the standalone
//! binaries).

mod admin;
mod backup_set;
mod credentials;
mod fail_dpm;
mod kv;
mod scenario;
mod status;
mod up;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc for every process of this binary (all nodes of `dinomo
/// up`, the bench): glibc's malloc/free (`malloc_consolidate`, `unlink_chunk`) were 6 to 12 %
/// of a KV node's and a client's CPU on the request path (docs/perf/request-path-profile.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Dinomo: a key-value store for disaggregated persistent memory.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a local cluster (dpm-node, KV nodes, routing node) with embedded defaults; Ctrl-C
    /// stops it; running it again reopens the same data.
    Up(up::UpArgs),
    /// Get, put, insert, update or delete a key. Exit status: 0 done, 1 the key was not found
    /// (or, for insert, exists), 2 the command failed.
    Kv(kv::KvArgs),
    /// Show the cluster: nodes, ownership, hit ratios, round trips per op, DPM state.
    Status(status::StatusArgs),
    /// YCSB workloads (load, a, b, c, d, f) and the DINOMO paper's mixes against Dinomo or
    /// Redis (`--target redis://HOST:PORT`): throughput, latency percentiles, hit ratios, RTs/op.
    Bench(dinomo_bench::ycsb::BenchArgs),
    /// Run a dpm-node.
    DpmNode(dinomo_dpm_node::cli::Args),
    /// Run a KV node.
    KvNode(dinomo_kv_node::cli::Args),
    /// Run a routing node.
    RoutingNode(dinomo_routing_node::cli::Args),
    /// Run the monitor (policy engine, reconfiguration, failover, hot-key replication).
    Monitor(dinomo_monitor::cli::Args),
    /// The paper's timeline experiments (Figs. 6-8: autoscaling, hot-key replication, KN
    /// failure) on a fresh local cluster; writes a per-second CSV and a PNG chart.
    Scenario(scenario::ScenarioArgs),
    /// Admin actions: add, remove or fail a KV node, the monitor's status (through the
    /// monitor); fail the dpm-node primary; add or remove a dpm-node backup.
    Admin(admin::AdminArgs),
    /// Make a cluster CA and certificates (`dinomo up` makes its own under
    /// <data-dir>/credentials): init a folder, or issue one more identity.
    Credentials(credentials::CredentialsArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = match &cli.command {
        // A KV node may run on fewer threads than cores (`--worker-threads`).
        Command::KvNode(a) => a.runtime()?,
        Command::Bench(a) => a.runtime()?,
        _ => dinomo_node_common::runtime(None)?,
    };
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Up(a) => {
            dinomo_dpm_node::cli::init_tracing();
            up::run(a).await
        }
        Command::Kv(a) => {
            dinomo_node_common::init_tracing_or("warn");
            a.security.client("client")?.install_for_process();
            kv::run(a).await
        }
        Command::Status(a) => {
            dinomo_node_common::init_tracing_or("warn");
            a.security.client("admin")?.install_for_process();
            status::run(a).await
        }
        Command::Bench(a) => {
            dinomo_node_common::init_tracing_or("warn");
            if a.target.starts_with("dinomo://") {
                a.security.client("client")?.install_for_process();
            }
            dinomo_bench::ycsb::run(a).await.map(|_| ())
        }
        Command::DpmNode(a) => {
            dinomo_dpm_node::cli::init_tracing();
            dinomo_dpm_node::cli::run(a).await
        }
        Command::KvNode(a) => {
            dinomo_kv_node::cli::init_tracing();
            dinomo_kv_node::cli::run(a).await
        }
        Command::RoutingNode(a) => {
            dinomo_routing_node::cli::init_tracing();
            dinomo_routing_node::cli::run(a).await
        }
        Command::Monitor(a) => {
            dinomo_monitor::cli::init_tracing();
            dinomo_monitor::cli::run(a).await
        }
        Command::Admin(a) => {
            dinomo_node_common::init_tracing_or("warn");
            a.security.client("admin")?.install_for_process();
            admin::run(a).await
        }
        Command::Credentials(a) => {
            dinomo_node_common::init_tracing_or("warn");
            credentials::run(a)
        }
        Command::Scenario(a) => {
            dinomo_node_common::init_tracing();
            scenario::run(a).await
        }
    }
}
