//! The command-line flags every node and command shares for its credentials.

use std::path::PathBuf;

use crate::{Role, Security, SecurityError};

/// `--credentials DIR` and `--insecure`, with their environment variables.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct SecurityArgs {
    /// Credentials folder: ca.pem plus this identity's certificate and key (made by `dinomo
    /// up` under <data-dir>/credentials, or by `dinomo credentials init`), or a Kubernetes TLS
    /// Secret's tls.crt, tls.key and ca.crt. Client commands default to .dinomo/credentials.
    #[arg(long, env = "DINOMO_CREDENTIALS", global = true)]
    pub credentials: Option<PathBuf>,
    /// No TLS and no access checks: anyone who reaches the ports can read, write and
    /// reconfigure the cluster. For development on a trusted machine only. The variable takes
    /// 1/0, true/false, yes/no or on/off.
    #[arg(
        long,
        env = "DINOMO_INSECURE",
        global = true,
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub insecure: bool,
}

impl SecurityArgs {
    /// A node's security as identity `name`, which must have `role` (no default folder: a
    /// node must be told). A folder whose certificate has another role (a Kubernetes Secret
    /// of another component mounted by mistake) is refused rather than served with.
    pub fn node(&self, name: &str, role: Role) -> Result<Security, SecurityError> {
        let s = Security::for_node(self.credentials.as_deref(), self.insecure, name)?;
        if let Some(id) = s.identity() {
            if id.caller.role != role {
                return Err(SecurityError::Missing(format!(
                    "{}: the certificate is {}, but this node acts as role {role}",
                    id.dir.display(),
                    id.caller
                )));
            }
        }
        Ok(s)
    }

    /// A client command's security as identity `name` (default folder .dinomo/credentials).
    pub fn client(&self, name: &str) -> Result<Security, SecurityError> {
        Security::for_client(self.credentials.as_deref(), self.insecure, name)
    }
}
