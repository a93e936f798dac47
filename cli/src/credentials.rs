//! Credentials for local clusters and by hand: `dinomo credentials init|issue`, and the
//! folder `dinomo up` and `dinomo scenario` make on first run and reuse after.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use dinomo_security::issue::{self, Leaf};
use dinomo_security::{Caller, Role, Security, SecurityArgs};

#[derive(Debug, Args)]
pub struct CredentialsArgs {
    #[command(subcommand)]
    pub command: CredentialsCommand,
}

#[derive(Debug, Subcommand)]
pub enum CredentialsCommand {
    /// Make DIR a cluster's credentials folder: a new CA (unless DIR has one) and a
    /// certificate for each node kind (dpm, kn, routing, monitor), a client and an admin.
    /// Certificates that expire within 30 days are renewed; everything else is kept.
    Init {
        /// The folder (created mode 0700).
        dir: PathBuf,
    },
    /// Issue one more identity with the CA in DIR: writes DIR/<FILE>.pem and <FILE>-key.pem.
    Issue {
        /// client, node, monitor or admin.
        #[arg(long)]
        role: Role,
        /// The name in the identity dinomo://<role>/<name>, e.g. alice.
        #[arg(long)]
        name: String,
        /// The file stem (default: <role>-<name>).
        #[arg(long)]
        file: Option<String>,
        /// A server identity: the service it serves (dpm, kv, routing or monitor).
        #[arg(long, value_parser = ["dpm", "kv", "routing", "monitor"])]
        serves: Option<String>,
        dir: PathBuf,
    },
}

pub fn run(a: CredentialsArgs) -> anyhow::Result<()> {
    match a.command {
        CredentialsCommand::Init { dir } => {
            let r = issue::init(&dir)?;
            println!(
                "{}: {}{}",
                dir.display(),
                if r.created_ca { "new CA; " } else { "" },
                if r.issued.is_empty() {
                    "every certificate kept".to_string()
                } else {
                    format!("issued {}", r.issued.join(", "))
                }
            );
        }
        CredentialsCommand::Issue {
            role,
            name,
            file,
            serves,
            dir,
        } => {
            let caller =
                Caller::from_uri(&format!("dinomo://{role}/{name}")).map_err(anyhow::Error::msg)?;
            let dns = serves.map(|s| match s.as_str() {
                "dpm" => "dpm.dinomo",
                "kv" => "kv.dinomo",
                "routing" => "routing.dinomo",
                _ => "monitor.dinomo",
            });
            let file = file.unwrap_or_else(|| format!("{role}-{name}"));
            let plain = !file.is_empty()
                && file
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !plain || file == "ca" {
                anyhow::bail!(
                    "--file {file:?}: a file stem of letters, digits, '-' and '_' other than \
                     \"ca\" (the CA's own files)"
                );
            }
            let leaf = Leaf { file, caller, dns };
            issue::issue(&dir, &leaf)?;
            println!(
                "{}: issued {} as {}.pem and {}-key.pem",
                dir.display(),
                leaf.caller.uri(),
                leaf.file,
                leaf.file
            );
        }
    }
    Ok(())
}

/// How a local cluster's processes are secured.
#[derive(Debug)]
pub struct LocalCluster {
    /// The cluster's credentials folder (`None`: --insecure).
    dir: Option<PathBuf>,
    /// For the launcher's own calls (reading the published map, status).
    pub admin: Security,
    /// For the launcher's clients (scenario load).
    pub client: Security,
}

impl LocalCluster {
    /// `--insecure`, else the folder `--credentials` (or `$DINOMO_CREDENTIALS`) names, else
    /// `default_dir`: made a complete credentials folder on first use, reused after.
    pub fn prepare(args: &SecurityArgs, default_dir: &Path) -> anyhow::Result<Self> {
        if args.insecure {
            tracing::warn!(
                "--insecure: the cluster runs without TLS; anyone who reaches its ports can read, \
                 write and reconfigure it"
            );
            return Ok(LocalCluster {
                dir: None,
                admin: Security::Insecure,
                client: Security::Insecure,
            });
        }
        let dir = args
            .credentials
            .clone()
            .unwrap_or_else(|| default_dir.to_path_buf());
        let r = issue::init(&dir)
            .with_context(|| format!("preparing the cluster's credentials in {}", dir.display()))?;
        if r.created_ca {
            tracing::info!(dir = %dir.display(), "created the cluster CA and its certificates");
        } else if !r.issued.is_empty() {
            tracing::info!(dir = %dir.display(), renewed = ?r.issued, "renewed certificates");
        }
        let load = |name| {
            Security::for_node(Some(&dir), false, name)
                .with_context(|| format!("loading the {name} identity"))
        };
        Ok(LocalCluster {
            admin: load("admin")?,
            client: load("client")?,
            dir: Some(dir),
        })
    }

    /// The flags node `name` (dpm, kn, routing, monitor) starts with: `--credentials` naming
    /// a folder with only its own key (see [`issue::node_folder`]), or `--insecure`.
    pub fn node_args(&self, name: &str) -> anyhow::Result<Vec<String>> {
        Ok(match &self.dir {
            None => vec!["--insecure".into()],
            Some(dir) => {
                let folder = issue::node_folder(dir, name)
                    .with_context(|| format!("preparing the {name} node's credentials"))?;
                vec!["--credentials".into(), folder.display().to_string()]
            }
        })
    }

    /// The monitor's flags: its own, and the KNs' it starts (`--kn-arg`).
    pub fn monitor_args(&self) -> anyhow::Result<Vec<String>> {
        let mut args = self.node_args("monitor")?;
        args.extend(
            self.node_args("kn")?
                .into_iter()
                .map(|a| format!("--kn-arg={a}")),
        );
        Ok(args)
    }
}
