//! rustls configurations for connections that are not tonic channels: the KV nodes' binary data
//! path (the KV wire, `dinomo_proto::wire`), which shares a port with gRPC and is told apart by
//! ALPN.
//!
//! Invariants, the same as [`Security::endpoint`] and [`Security::server_tls`] keep for gRPC:
//! - the cluster CA is the only trust anchor, both ways;
//! - a client verifies the server as the service it dials (`<service>.dinomo`), never as an
//!   address;
//! - a server takes client certificates as optional, so that a caller without one is told
//!   which role it needs (by the access table) instead of failing a bare handshake;
//! - the crypto provider is ring, named here rather than taken from a process default, so that
//!   no process has to install one first.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::credentials::Identity;
use crate::error::SecurityError;
use crate::transport::{Security, Service};

/// The ALPN name gRPC (HTTP/2) negotiates.
pub const ALPN_H2: &[u8] = b"h2";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> SecurityError {
    SecurityError::Missing(format!("{what}: {e}"))
}

fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, SecurityError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_err(what, e))?;
    if certs.is_empty() {
        return Err(tls_err(what, "no CERTIFICATE block"));
    }
    Ok(certs)
}

fn roots(id: &Identity) -> Result<RootCertStore, SecurityError> {
    let mut roots = RootCertStore::empty();
    for ca in certificates(&id.ca_pem, "the cluster CA")? {
        roots
            .add(ca)
            .map_err(|e| tls_err("the cluster CA certificate", e))?;
    }
    Ok(roots)
}

fn own_key(
    id: &Identity,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), SecurityError> {
    let certs = certificates(&id.cert_pem, "this identity's certificate")?;
    let key = PrivateKeyDer::from_pem_slice(&id.key_pem)
        .map_err(|e| tls_err("this identity's private key", e))?;
    Ok((certs, key))
}

impl Security {
    /// The server side of a port that serves gRPC and other protocols told apart by ALPN:
    /// `alpn` lists them in the server's order of preference. `None` under `--insecure`.
    pub fn rustls_server(
        &self,
        alpn: &[&[u8]],
    ) -> Result<Option<Arc<ServerConfig>>, SecurityError> {
        let Security::Mutual(id) = self else {
            return Ok(None);
        };
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(id)?), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| tls_err("the client certificate verifier", e))?;
        let (certs, key) = own_key(id)?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err("TLS versions", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| tls_err("the server's certificate and key", e))?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Some(Arc::new(config)))
    }

    /// The client side of a connection to `service` that negotiates protocol `alpn`, and the
    /// name the server's certificate must carry. `None` under `--insecure`.
    pub fn rustls_client(
        &self,
        service: Service,
        alpn: &[u8],
    ) -> Result<Option<(Arc<ClientConfig>, ServerName<'static>)>, SecurityError> {
        let Security::Mutual(id) = self else {
            return Ok(None);
        };
        let (certs, key) = own_key(id)?;
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err("TLS versions", e))?
            .with_root_certificates(roots(id)?)
            .with_client_auth_cert(certs, key)
            .map_err(|e| tls_err("this identity's certificate and key", e))?;
        config.alpn_protocols = vec![alpn.to_vec()];
        let name =
            ServerName::try_from(service.domain()).map_err(|e| tls_err("the service's name", e))?;
        Ok(Some((Arc::new(config), name)))
    }
}
