//! Credentials on disk: a folder with the cluster CA and one certificate and key per identity.
//!
//! Layout (made by `dinomo up` / `dinomo credentials init`): `ca.pem`, and per identity
//! `<name>.pem` + `<name>-key.pem` (`dpm`, `kn`, `routing`, `monitor`, `client`, `admin`). A
//! folder without those files may hold a Kubernetes TLS Secret instead: `tls.crt`, `tls.key`,
//! `ca.crt`. `ca-key.pem` is never read here: only the issuer (feature `issue`) uses it.

use std::path::{Path, PathBuf};

use crate::caller::Caller;
use crate::error::SecurityError;

/// The environment variable naming a credentials folder, for every command and node.
pub const CREDENTIALS_ENV: &str = "DINOMO_CREDENTIALS";
/// The environment variable that, set to `1` or `true`, means `--insecure`.
pub const INSECURE_ENV: &str = "DINOMO_INSECURE";
/// Where client commands look last: `dinomo up`'s default data directory's credentials.
pub const DEFAULT_CLIENT_CREDENTIALS: &str = ".dinomo/credentials";

/// One loaded identity: the CA to trust, and the certificate and key to present.
#[derive(Clone)]
pub struct Identity {
    pub dir: PathBuf,
    /// The certificate's identity.
    pub caller: Caller,
    pub(crate) ca_pem: Vec<u8>,
    pub(crate) cert_pem: Vec<u8>,
    pub(crate) key_pem: Vec<u8>,
}

impl std::fmt::Debug for Identity {
    // Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("dir", &self.dir)
            .field("caller", &self.caller.uri())
            .finish()
    }
}

impl Identity {
    /// Loads identity `name` (`<name>.pem`, `<name>-key.pem`, `ca.pem`) from `dir`, or the
    /// folder's Kubernetes TLS Secret layout (`tls.crt`, `tls.key`, `ca.crt`) if it has no such
    /// files.
    pub fn load(dir: &Path, name: &str) -> Result<Self, SecurityError> {
        let ours = [
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}-key.pem")),
            dir.join("ca.pem"),
        ];
        let secret = [dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.crt")];
        let files = if ours[0].exists() {
            ours
        } else if secret[0].exists() {
            secret
        } else {
            return Err(SecurityError::Missing(format!(
                "no credentials for {name:?} in {}: expected {name}.pem, {name}-key.pem and ca.pem \
                 (made by `dinomo up` or `dinomo credentials init`), or a Kubernetes TLS Secret's \
                 tls.crt, tls.key and ca.crt",
                dir.display()
            )));
        };
        let [cert_pem, key_pem, ca_pem] = files.each_ref().map(|p| read(p));
        let (cert_pem, key_pem, ca_pem) = (cert_pem?, key_pem?, ca_pem?);
        let der =
            first_certificate_der(&cert_pem).map_err(|reason| SecurityError::BadCertificate {
                path: files[0].clone(),
                reason,
            })?;
        let caller =
            Caller::from_certificate(&der).map_err(|reason| SecurityError::BadCertificate {
                path: files[0].clone(),
                reason,
            })?;
        Ok(Identity {
            dir: dir.to_path_buf(),
            caller,
            ca_pem,
            cert_pem,
            key_pem,
        })
    }

    /// Where a client command finds its credentials: `flag`, then `$DINOMO_CREDENTIALS`, then
    /// `.dinomo/credentials`.
    pub fn client_dir(flag: Option<&Path>) -> PathBuf {
        flag.map(Path::to_path_buf)
            .or_else(|| std::env::var_os(CREDENTIALS_ENV).map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CLIENT_CREDENTIALS))
    }
}

fn read(path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|source| SecurityError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The DER bytes of the first certificate in a PEM file.
pub(crate) fn first_certificate_der(pem: &[u8]) -> Result<Vec<u8>, String> {
    for item in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let item = item.map_err(|e| format!("not PEM: {e}"))?;
        if item.label == "CERTIFICATE" {
            return Ok(item.contents);
        }
    }
    Err("no CERTIFICATE block".into())
}
