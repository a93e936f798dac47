//! `dinomo kv`: single-key commands through the SDK.

use anyhow::Context;
use clap::{Args, Subcommand};
use dinomo_client::{Client, ClientError};

#[derive(Debug, Args)]
pub struct KvArgs {
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    /// A routing node (host:port).
    #[arg(long, env = "DINOMO_ROUTING", default_value = "127.0.0.1:7900")]
    routing: String,
    #[command(subcommand)]
    op: KvOp,
}

#[derive(Debug, Subcommand)]
enum KvOp {
    /// Print the value of KEY (exit status 1 if it does not exist).
    Get { key: String },
    /// Create or replace KEY.
    Put { key: String, value: String },
    /// Create KEY (exit status 1 if it exists).
    Insert { key: String, value: String },
    /// Replace KEY (exit status 1 if it does not exist).
    Update { key: String, value: String },
    /// Delete KEY (exit status 1 if it did not exist).
    Delete { key: String },
}

/// Exit status when the command itself failed (the cluster could not be reached, a write's
/// outcome is unknown, ...), told apart from 1, an answer about the key, as grep does.
const FAILED: i32 = 2;

/// Runs one command; exits 1 on an answer about the key (not found, already exists) and
/// [`FAILED`] when the command failed.
pub async fn run(a: KvArgs) -> anyhow::Result<()> {
    if let Err(e) = answer(a).await {
        eprintln!("Error: {e:#}");
        std::process::exit(FAILED);
    }
    Ok(())
}

async fn answer(a: KvArgs) -> anyhow::Result<()> {
    let client = Client::connect(&[&a.routing])
        .await
        .with_context(|| format!("connecting through the routing node {}", a.routing))?;
    // An answer about the key, not a failure of the tool: said in one line, exit status 1.
    let refused = |key: &str, why: &str| -> anyhow::Result<()> {
        eprintln!("{key}: {why}");
        std::process::exit(1)
    };
    let missing = |key: &str| refused(key, "not found");
    match a.op {
        KvOp::Get { key } => match client.get(key.clone()).await? {
            Some(v) => println!("{}", String::from_utf8_lossy(&v)),
            None => missing(&key)?,
        },
        KvOp::Put { key, value } => client.put(key, value).await?,
        KvOp::Insert { key, value } => match client.insert(key.clone(), value).await {
            Err(ClientError::AlreadyExists) => refused(&key, "already exists")?,
            r => r?,
        },
        KvOp::Update { key, value } => match client.update(key.clone(), value).await {
            Err(ClientError::NotFound) => missing(&key)?,
            r => r?,
        },
        KvOp::Delete { key } => {
            if !client.delete(key.clone()).await? {
                missing(&key)?;
            }
        }
    }
    Ok(())
}
