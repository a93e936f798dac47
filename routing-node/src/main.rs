//! The routing-node binary: see [`dinomo_routing_node::cli`].

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dinomo_routing_node::cli::init_tracing();
    dinomo_routing_node::cli::run(dinomo_routing_node::cli::Args::parse()).await
}
