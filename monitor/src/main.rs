//! The `monitor` binary: see [`dinomo_monitor::cli`].
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    dinomo_monitor::cli::init_tracing();
    dinomo_monitor::cli::run(dinomo_monitor::cli::Args::parse()).await
}
