//! The kv-node binary: see [`dinomo_kv_node::cli`].

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let args = dinomo_kv_node::cli::Args::parse();
    let runtime = args.runtime()?;
    runtime.block_on(async {
        dinomo_kv_node::cli::init_tracing();
        dinomo_kv_node::cli::run(args).await
    })
}
