//! The dpm-node binary: see [`dinomo_dpm_node::cli`].

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dinomo_dpm_node::cli::init_tracing();
    dinomo_dpm_node::cli::run(dinomo_dpm_node::cli::Args::parse()).await
}
