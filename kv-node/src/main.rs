//! The kv-node binary: see [`dinomo_kv_node::cli`].

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dinomo_kv_node::cli::init_tracing();
    dinomo_kv_node::cli::run(dinomo_kv_node::cli::Args::parse()).await
}
