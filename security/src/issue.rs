//! A cluster CA and the certificates it issues (feature `issue`: `dinomo up`, `dinomo
//! credentials`, tests).
//!
//! Invariants of a credentials folder made here: the folder is 0700 and every key file 0600;
//! files are written to a temporary name and renamed, so a crash leaves either the old file or
//! the new one; a folder with a CA certificate but no CA key (or the reverse) is refused rather
//! than silently replaced, since replacing the CA would lock out every certificate in use.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

use crate::caller::{Caller, Role};
use crate::credentials::first_certificate_der;
use crate::error::SecurityError;

/// How long the CA lives.
const CA_LIFETIME: Duration = Duration::days(3650);
/// How long a leaf lives; `init` re-issues leaves that expire within [`RENEW_BEFORE`].
const LEAF_LIFETIME: Duration = Duration::days(365);
pub const RENEW_BEFORE: Duration = Duration::days(30);

/// One identity a cluster folder holds: its file stem, its URI and the service DNS name it
/// serves under (none for callers only).
#[derive(Clone, Debug)]
pub struct Leaf {
    pub file: String,
    pub caller: Caller,
    pub dns: Option<&'static str>,
}

/// The identities `dinomo up` needs: one per node kind, a client and an admin.
pub fn standard_leaves() -> Vec<Leaf> {
    let leaf = |file: &str, role, name: &str, dns| Leaf {
        file: file.into(),
        caller: Caller::new(role, name),
        dns,
    };
    vec![
        leaf("dpm", Role::Node, "dpm", Some("dpm.dinomo")),
        leaf("kn", Role::Node, "kn", Some("kv.dinomo")),
        leaf("routing", Role::Node, "routing", Some("routing.dinomo")),
        leaf("monitor", Role::Monitor, "monitor", Some("monitor.dinomo")),
        leaf("client", Role::Client, "default", None),
        leaf("admin", Role::Admin, "default", None),
    ]
}

/// What [`init`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct InitReport {
    pub created_ca: bool,
    /// File stems of the leaves written (new or renewed).
    pub issued: Vec<String>,
}

/// Makes `dir` a complete credentials folder for a cluster: creates the CA if there is none,
/// issues each standard leaf that is missing or expires within [`RENEW_BEFORE`], and keeps
/// everything else.
pub fn init(dir: &Path) -> Result<InitReport, SecurityError> {
    create_private_dir(dir)?;
    let mut report = InitReport::default();
    let (ca_cert, ca_key) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    match (ca_cert.exists(), ca_key.exists()) {
        (true, true) => {}
        (false, false) => {
            let (cert, key) = new_ca()?;
            write_file(&ca_key, key.as_bytes(), 0o600)?;
            write_file(&ca_cert, cert.as_bytes(), 0o644)?;
            report.created_ca = true;
        }
        (has_cert, _) => {
            let (have, missing) = if has_cert {
                (&ca_cert, &ca_key)
            } else {
                (&ca_key, &ca_cert)
            };
            return Err(SecurityError::Missing(format!(
                "{} is half made: {} exists but {} does not; restore it, or move the folder \
                 away to start a new CA (every certificate it issued stops working)",
                dir.display(),
                have.display(),
                missing.display()
            )));
        }
    }
    for leaf in standard_leaves() {
        let cert = dir.join(format!("{}.pem", leaf.file));
        let key = dir.join(format!("{}-key.pem", leaf.file));
        let fresh = report.created_ca
            || !cert.exists()
            || !key.exists()
            || expires_within(&cert, RENEW_BEFORE)?
            // A crash between writing the key and the certificate leaves a pair that does not
            // match: issue it again rather than keep a node that cannot shake hands.
            || !key_matches(&cert, &key)?;
        if fresh {
            issue(dir, &leaf)?;
            report.issued.push(leaf.file.clone());
        }
    }
    Ok(report)
}

/// A folder for one node under `dir/nodes/<name>/` holding only what that node needs: the
/// CA certificate and its own certificate and key (never the CA key or another identity's
/// key), refreshed from `dir` at each call. Returns it.
pub fn node_folder(dir: &Path, name: &str) -> Result<PathBuf, SecurityError> {
    let folder = dir.join("nodes").join(name);
    create_private_dir(&dir.join("nodes"))?;
    create_private_dir(&folder)?;
    for (file, mode) in [
        ("ca.pem".to_string(), 0o644),
        (format!("{name}.pem"), 0o644),
        (format!("{name}-key.pem"), 0o600),
    ] {
        let bytes = std::fs::read(dir.join(&file)).map_err(|source| SecurityError::Read {
            path: dir.join(&file),
            source,
        })?;
        write_file(&folder.join(&file), &bytes, mode)?;
    }
    Ok(folder)
}

/// Issues `leaf` with the CA in `dir`, writing `<file>.pem` and `<file>-key.pem` there.
pub fn issue(dir: &Path, leaf: &Leaf) -> Result<(), SecurityError> {
    let ca_pem = read_string(&dir.join("ca.pem"))?;
    let ca_key = KeyPair::from_pem(&read_string(&dir.join("ca-key.pem"))?).map_err(issue_err)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(issue_err)?;
    let (cert, key) = new_leaf(leaf, &issuer)?;
    write_file(
        &dir.join(format!("{}-key.pem", leaf.file)),
        key.as_bytes(),
        0o600,
    )?;
    write_file(
        &dir.join(format!("{}.pem", leaf.file)),
        cert.as_bytes(),
        0o644,
    )?;
    Ok(())
}

/// A new self-signed CA: (certificate PEM, key PEM).
pub fn new_ca() -> Result<(String, String), SecurityError> {
    let key = KeyPair::generate().map_err(issue_err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "Dinomo cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::hours(1);
    params.not_after = now + CA_LIFETIME;
    let cert = params.self_signed(&key).map_err(issue_err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A leaf for `leaf` signed by `issuer`: (certificate PEM, key PEM).
pub fn new_leaf(
    leaf: &Leaf,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<(String, String), SecurityError> {
    new_leaf_valid_for(leaf, issuer, LEAF_LIFETIME)
}

/// As [`new_leaf`], valid from an hour ago for `lifetime` (tests use short ones).
pub fn new_leaf_valid_for(
    leaf: &Leaf,
    issuer: &Issuer<'_, KeyPair>,
    lifetime: Duration,
) -> Result<(String, String), SecurityError> {
    let key = KeyPair::generate().map_err(issue_err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, leaf.caller.uri());
    let uri = leaf.caller.uri().try_into().map_err(issue_err)?;
    params.subject_alt_names = vec![SanType::URI(uri)];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    if let Some(dns) = leaf.dns {
        params
            .subject_alt_names
            .push(SanType::DnsName(dns.try_into().map_err(issue_err)?));
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::hours(1);
    params.not_after = now + lifetime;
    let cert = params.signed_by(&key, issuer).map_err(issue_err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Loads the CA in `dir` as an issuer.
pub fn load_issuer(dir: &Path) -> Result<Issuer<'static, KeyPair>, SecurityError> {
    let ca_pem = read_string(&dir.join("ca.pem"))?;
    let ca_key = KeyPair::from_pem(&read_string(&dir.join("ca-key.pem"))?).map_err(issue_err)?;
    Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(issue_err)
}

/// Whether the certificate in `path` expires within `margin` from now.
pub fn expires_within(path: &Path, margin: Duration) -> Result<bool, SecurityError> {
    let pem = std::fs::read(path).map_err(|source| SecurityError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |reason: String| SecurityError::BadCertificate {
        path: path.to_path_buf(),
        reason,
    };
    let der = first_certificate_der(&pem).map_err(bad)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).map_err(|e| bad(e.to_string()))?;
    let not_after = cert.validity().not_after.timestamp();
    Ok(not_after < (OffsetDateTime::now_utc() + margin).unix_timestamp())
}

/// Whether the private key in `key` belongs to the certificate in `cert`.
fn key_matches(cert: &Path, key: &Path) -> Result<bool, SecurityError> {
    use rcgen::PublicKeyData;
    let pem = std::fs::read(cert).map_err(|source| SecurityError::Read {
        path: cert.to_path_buf(),
        source,
    })?;
    let bad = |reason: String| SecurityError::BadCertificate {
        path: cert.to_path_buf(),
        reason,
    };
    let der = first_certificate_der(&pem).map_err(bad)?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&der).map_err(|e| bad(e.to_string()))?;
    let Ok(pair) = KeyPair::from_pem(&read_string(key)?) else {
        return Ok(false);
    };
    Ok(pair.subject_public_key_info() == parsed.public_key().raw)
}

fn issue_err(e: impl std::fmt::Display) -> SecurityError {
    SecurityError::Issue(e.to_string())
}

fn read_string(path: &Path) -> Result<String, SecurityError> {
    std::fs::read_to_string(path).map_err(|source| SecurityError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn create_private_dir(dir: &Path) -> Result<(), SecurityError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let werr = |source| SecurityError::Write {
        path: dir.to_path_buf(),
        source,
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(werr)?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(werr)
}

/// Writes `bytes` to `path` with `mode` through a temporary file and a rename.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), SecurityError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp: PathBuf = path.with_extension("tmp");
    let werr = |source| SecurityError::Write {
        path: path.to_path_buf(),
        source,
    };
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(werr)?;
    f.write_all(bytes).map_err(werr)?;
    f.sync_all().map_err(werr)?;
    std::fs::rename(&tmp, path).map_err(werr)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::credentials::Identity;

    #[test]
    fn init_makes_a_private_complete_folder_and_keeps_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("credentials");
        let first = init(&dir).unwrap();
        assert!(first.created_ca);
        assert_eq!(first.issued.len(), standard_leaves().len());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("ca-key.pem")), 0o600);
        assert_eq!(mode(&dir.join("kn-key.pem")), 0o600);
        for leaf in standard_leaves() {
            let id = Identity::load(&dir, &leaf.file).unwrap();
            assert_eq!(id.caller, leaf.caller);
        }
        let ca = std::fs::read(dir.join("ca.pem")).unwrap();
        assert_eq!(
            init(&dir).unwrap(),
            InitReport::default(),
            "a second run keeps everything"
        );
        assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), ca);
    }

    #[test]
    fn init_renews_a_leaf_near_expiry_and_refuses_a_half_made_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("c");
        init(&dir).unwrap();
        let leaf = &standard_leaves()[4];
        let issuer = load_issuer(&dir).unwrap();
        let (cert, key) = new_leaf_valid_for(leaf, &issuer, Duration::days(3)).unwrap();
        write_file(&dir.join("client.pem"), cert.as_bytes(), 0o644).unwrap();
        write_file(&dir.join("client-key.pem"), key.as_bytes(), 0o600).unwrap();
        assert!(expires_within(&dir.join("client.pem"), RENEW_BEFORE).unwrap());
        let report = init(&dir).unwrap();
        assert_eq!(report.issued, vec!["client".to_string()]);
        assert!(!expires_within(&dir.join("client.pem"), RENEW_BEFORE).unwrap());

        // A key that is not the certificate's (a crash between the two writes): issued again.
        std::fs::copy(dir.join("admin-key.pem"), dir.join("client-key.pem")).unwrap();
        assert_eq!(init(&dir).unwrap().issued, vec!["client".to_string()]);
        assert_eq!(init(&dir).unwrap(), InitReport::default());

        std::fs::remove_file(dir.join("ca-key.pem")).unwrap();
        let e = init(&dir).unwrap_err().to_string();
        assert!(e.contains("half made") && e.contains("ca-key.pem"), "{e}");
    }
}
