//! Secured channels and servers: the one place that decides between `https://` with the
//! cluster CA and the caller's certificate, and plain text under `--insecure`.
//!
//! Invariant: with [`Security::Mutual`] every channel dials `https://` (tonic dials plain text
//! for an `http://` URI even with a TLS config, so the scheme is rewritten here, never taken from
//! the caller), trusts only the cluster CA, and verifies the server as the service it dials
//! (`<service>.dinomo`), not as an address: KN addresses come from the cluster map.

use std::path::Path;
use std::sync::{Arc, RwLock};

use tonic::transport::{
    Certificate, ClientTlsConfig, Endpoint, Identity as TlsIdentity, ServerTlsConfig,
};

use crate::access::AccessLayer;
use crate::credentials::{Identity, INSECURE_ENV};
use crate::error::SecurityError;

/// The services a channel dials; each server's certificate names `<service>.dinomo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    Dpm,
    Kv,
    Routing,
    Monitor,
}

impl Service {
    /// The DNS name in the server's certificate.
    pub fn domain(self) -> &'static str {
        match self {
            Service::Dpm => "dpm.dinomo",
            Service::Kv => "kv.dinomo",
            Service::Routing => "routing.dinomo",
            Service::Monitor => "monitor.dinomo",
        }
    }
}

/// How a process talks and listens: mutual TLS as one identity, or plain text.
#[derive(Clone, Debug)]
pub enum Security {
    /// No TLS and no access checks (`--insecure`).
    Insecure,
    Mutual(Arc<Identity>),
}

/// This process's identity for the channels it opens without a config of their own (the
/// admin helpers, health probes, the monitor's calls): a binary installs it once at start
/// ([`Security::install_for_process`]); until then, and in tests that never install one, it is
/// [`Security::Insecure`]. Servers and SDK clients take theirs explicitly from their configs.
static PROCESS: RwLock<Option<Security>> = RwLock::new(None);

impl Security {
    /// Makes `self` the process's identity (see [`Security::of_process`]).
    pub fn install_for_process(&self) {
        *PROCESS.write().unwrap_or_else(|e| e.into_inner()) = Some(self.clone());
    }

    /// The process's identity: the one installed last, else [`Security::Insecure`].
    pub fn of_process() -> Security {
        PROCESS
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or(Security::Insecure)
    }

    /// An SDK client's security when its program says nothing: the process's identity if one
    /// was installed (the CLI does); else plain text under `$DINOMO_INSECURE`; else the `client`
    /// identity from `$DINOMO_CREDENTIALS` or `.dinomo/credentials` if that folder has one;
    /// else plain text (which a cluster with TLS refuses at the handshake).
    pub fn for_sdk() -> Security {
        if let Some(s) = PROCESS.read().unwrap_or_else(|e| e.into_inner()).clone() {
            return s;
        }
        if insecure_from_env() {
            return Security::Insecure;
        }
        let dir = Identity::client_dir(None);
        match Identity::load(&dir, "client") {
            Ok(id) => Security::Mutual(Arc::new(id)),
            Err(e) => {
                tracing::debug!(error = %e, "no client credentials found: plain text");
                Security::Insecure
            }
        }
    }

    /// A node's security: `--credentials DIR` (or `$DINOMO_CREDENTIALS`, which clap folds into
    /// the flag) with identity `name`, or `--insecure`. Neither is an error naming both: a node
    /// never falls back to plain text on its own.
    pub fn for_node(
        credentials: Option<&Path>,
        insecure: bool,
        name: &str,
    ) -> Result<Self, SecurityError> {
        match (credentials, insecure) {
            (_, true) => Ok(Security::Insecure),
            (Some(dir), false) => Ok(Security::Mutual(Arc::new(Identity::load(dir, name)?))),
            (None, false) => Err(SecurityError::Missing(format!(
                "no credentials: pass --credentials DIR (or set {}) with {name}.pem, \
                 {name}-key.pem and ca.pem, or --insecure to serve without TLS",
                crate::CREDENTIALS_ENV
            ))),
        }
    }

    /// A client command's or SDK's security: `--insecure` (or `$DINOMO_INSECURE`), else
    /// identity `name` from `--credentials`, `$DINOMO_CREDENTIALS` or `.dinomo/credentials`.
    pub fn for_client(
        credentials: Option<&Path>,
        insecure: bool,
        name: &str,
    ) -> Result<Self, SecurityError> {
        if insecure || insecure_from_env() {
            return Ok(Security::Insecure);
        }
        let dir = Identity::client_dir(credentials);
        Identity::load(&dir, name)
            .map(|i| Security::Mutual(Arc::new(i)))
            .map_err(|e| {
                SecurityError::Missing(format!(
                    "{e}; pass --credentials DIR or set {} (a `dinomo up` cluster keeps them in \
                 <data-dir>/credentials), or --insecure for a cluster started with --insecure",
                    crate::CREDENTIALS_ENV
                ))
            })
    }

    pub fn is_insecure(&self) -> bool {
        matches!(self, Security::Insecure)
    }

    /// The identity this process presents, if any.
    pub fn identity(&self) -> Option<&Identity> {
        match self {
            Security::Insecure => None,
            Security::Mutual(i) => Some(i),
        }
    }

    /// Logs, as a warning, what `--insecure` means for the listener at `addr`.
    pub fn warn_if_insecure(&self, what: &str, addr: impl std::fmt::Display) {
        if self.is_insecure() {
            tracing::warn!(
                "{what} runs with --insecure: no TLS, anyone who reaches {addr} can read, write \
                 and reconfigure the cluster"
            );
        }
    }

    /// A channel endpoint for `target` (`host:port`, or a URI whose scheme is replaced) of
    /// `service`. Callers add their own timeouts.
    pub fn endpoint(&self, target: &str, service: Service) -> Result<Endpoint, SecurityError> {
        let authority = target
            .strip_prefix("http://")
            .or_else(|| target.strip_prefix("https://"))
            .unwrap_or(target)
            .trim_end_matches('/');
        let bad = |reason: String| SecurityError::BadAddress {
            addr: target.to_string(),
            reason,
        };
        if authority.is_empty() || authority.contains('/') {
            return Err(bad("expected host:port".into()));
        }
        match self {
            Security::Insecure => {
                Endpoint::from_shared(format!("http://{authority}")).map_err(|e| bad(e.to_string()))
            }
            Security::Mutual(id) => {
                let tls = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&id.ca_pem))
                    .identity(TlsIdentity::from_pem(&id.cert_pem, &id.key_pem))
                    .domain_name(service.domain());
                Endpoint::from_shared(format!("https://{authority}"))
                    .map_err(|e| bad(e.to_string()))?
                    .tls_config(tls)
                    .map_err(|e| bad(e.to_string()))
            }
        }
    }

    /// The server's TLS configuration: its certificate, the cluster CA as the only root for
    /// client certificates, and client certificates optional so that a caller without one is
    /// told what is missing by the access layer instead of a bare handshake failure.
    pub fn server_tls(&self) -> Option<ServerTlsConfig> {
        match self {
            Security::Insecure => None,
            Security::Mutual(id) => Some(
                ServerTlsConfig::new()
                    .identity(TlsIdentity::from_pem(&id.cert_pem, &id.key_pem))
                    .client_ca_root(Certificate::from_pem(&id.ca_pem))
                    .client_auth_optional(true),
            ),
        }
    }

    /// A gRPC server builder with this process's TLS and the access layer in front of every
    /// service (the role table, or nothing under `--insecure`).
    pub fn server_builder(
        &self,
    ) -> Result<
        tonic::transport::Server<tower_layer::Stack<AccessLayer, tower_layer::Identity>>,
        SecurityError,
    > {
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = self.server_tls() {
            builder = builder.tls_config(tls).map_err(|e| {
                SecurityError::Missing(format!("the server's TLS configuration: {e}"))
            })?;
        }
        Ok(builder.layer(self.access_layer()))
    }

    /// A gRPC server builder with the access layer, for a server that does the TLS handshake
    /// itself ([`Security::rustls_server`]) and hands tonic the TLS streams: the access layer
    /// reads the peer's certificate from them as from tonic's own.
    pub fn server_builder_for_own_tls(
        &self,
    ) -> tonic::transport::Server<tower_layer::Stack<AccessLayer, tower_layer::Identity>> {
        tonic::transport::Server::builder().layer(self.access_layer())
    }

    /// The access layer for this process's server: the role table, or nothing under
    /// `--insecure`.
    pub fn access_layer(&self) -> AccessLayer {
        match self {
            Security::Insecure => AccessLayer::disabled(),
            Security::Mutual(_) => AccessLayer::enforcing(),
        }
    }
}

fn insecure_from_env() -> bool {
    std::env::var(INSECURE_ENV)
        .map(|v| matches!(v.as_str(), "1" | "true" | "yes"))
        .unwrap_or(false)
}
