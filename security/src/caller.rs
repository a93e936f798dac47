//! A caller's identity: the role and name in its certificate's one `dinomo://<role>/<name>` URI.
//!
//! Invariant: a certificate names exactly one `dinomo://` URI with a known role; anything else
//! (no URI, two URIs, an unknown role, an empty name) is not an identity.

use std::fmt;
use std::str::FromStr;

/// What a caller is allowed to do, from the role table in [`crate::access`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Reads and writes keys, routes, reports latencies.
    Client,
    /// A KV node or routing node: registers, allocates and seals its segments, reads metadata.
    Node,
    /// The monitor: fences, merges, publishes maps, drives reconfiguration.
    Monitor,
    /// An operator: status, manual reconfiguration, policy.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Client, Role::Node, Role::Monitor, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Node => "node",
            Role::Monitor => "monitor",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?} (client, node, monitor or admin)"))
    }
}

/// Who is calling, as proven by the TLS handshake. Handlers that make field-level checks find
/// it in the request's extensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Caller {
    pub role: Role,
    pub name: String,
}

pub(crate) const URI_SCHEME: &str = "dinomo://";

impl Caller {
    pub fn new(role: Role, name: impl Into<String>) -> Self {
        Caller {
            role,
            name: name.into(),
        }
    }

    /// `dinomo://<role>/<name>`.
    pub fn uri(&self) -> String {
        format!("{URI_SCHEME}{}/{}", self.role, self.name)
    }

    /// Parses `dinomo://<role>/<name>`.
    pub fn from_uri(uri: &str) -> Result<Self, String> {
        let rest = uri
            .strip_prefix(URI_SCHEME)
            .ok_or_else(|| format!("{uri:?} is not a {URI_SCHEME} URI"))?;
        let (role, name) = rest
            .split_once('/')
            .ok_or_else(|| format!("{uri:?} has no name (dinomo://<role>/<name>)"))?;
        if name.is_empty() || name.contains('/') {
            return Err(format!(
                "{uri:?}: the name must be one non-empty path segment"
            ));
        }
        Ok(Caller::new(role.parse()?, name))
    }

    /// The identity in a DER certificate: its one `dinomo://` SAN URI.
    pub fn from_certificate(der: &[u8]) -> Result<Self, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("cannot parse the certificate: {e}"))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| format!("bad subject alternative names: {e}"))?
            .ok_or("the certificate has no subject alternative names (needs one dinomo://<role>/<name> URI)")?;
        let mut uris = san.value.general_names.iter().filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) if u.starts_with(URI_SCHEME) => Some(*u),
            _ => None,
        });
        let first = uris
            .next()
            .ok_or("the certificate names no dinomo://<role>/<name> URI")?;
        if uris.next().is_some() {
            return Err("the certificate names more than one dinomo:// URI".into());
        }
        Caller::from_uri(first)
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (role {})", self.uri(), self.role)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip_and_bad_ones_are_refused() {
        let c = Caller::from_uri("dinomo://admin/alice").unwrap();
        assert_eq!(c, Caller::new(Role::Admin, "alice"));
        assert_eq!(Caller::from_uri(&c.uri()).unwrap(), c);
        for bad in [
            "https://admin/alice",
            "dinomo://admin",
            "dinomo://admin/",
            "dinomo://root/alice",
            "dinomo://admin/a/b",
        ] {
            assert!(Caller::from_uri(bad).is_err(), "{bad}");
        }
    }
}
