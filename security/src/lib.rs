//! Who may call what (docs/decisions/0005-security.md).
//!
//! Every gRPC endpoint of a Dinomo cluster runs mutual TLS with one private cluster CA as the
//! only trust anchor. A caller's identity is the one SAN URI `dinomo://<role>/<name>` of its
//! certificate ([`Caller`]); what each role may call is one table ([`access::TABLE`]), enforced
//! before any handler runs by the [`AccessLayer`] every server installs. Channels are built only
//! through [`Security::endpoint`], which dials `https://` with the cluster CA and the caller's
//! certificate, so a plain-text `http://` channel cannot slip in (tonic would silently dial
//! plain text for an `http://` URI with a TLS config).
//!
//! [`Security::Insecure`] turns TLS and the access checks off: an explicit opt-out for
//! development, logged as a warning at every start.

pub mod access;
mod args;
mod caller;
mod credentials;
mod error;
#[cfg(feature = "issue")]
pub mod issue;
mod tls;
mod transport;

pub use access::{AccessLayer, AccessService};
pub use args::SecurityArgs;
pub use caller::{Caller, Role};
pub use credentials::{Identity, CREDENTIALS_ENV, DEFAULT_CLIENT_CREDENTIALS, INSECURE_ENV};
pub use error::SecurityError;
pub use tls::ALPN_H2;
/// The TLS stream types of [`Security::rustls_server`] and [`Security::rustls_client`]
/// connections, re-exported so that every crate uses the same version.
pub use tokio_rustls;
pub use transport::{Security, Service};
